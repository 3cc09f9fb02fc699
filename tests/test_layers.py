"""The import graph of hetccl/: no circles, and every import goes to the same or a lower layer.

Every import counts, including those inside functions (a lazy import still ties the two modules together);
only imports under `if TYPE_CHECKING:` are left out (they never run). `from pkg import name` counts as an
import of the submodule pkg.name where one exists, else of pkg. docs/architecture.md §2 explains the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hetccl"

# module (or package and everything under it) -> layer; the longest matching name decides
LAYERS: dict[str, int] = {
    # 9: entry points and integrations
    "hetccl": 9, "hetccl.__main__": 9, "hetccl.cli": 9, "hetccl.bench": 9, "hetccl.info": 9, "hetccl.topo": 9,
    "hetccl.launcher": 9, "hetccl.torch": 9, "hetccl.testing": 9,
    # 8: the public facade (checks arguments once, picks islands / device / host)
    "hetccl.communicator": 8, "hetccl.sync": 8,
    # 7: the hierarchical schedule (island step, leaders step, island step)
    "hetccl.hierarchical": 7, "hetccl.compress": 7,
    # 6: the flat engine (sequence numbers, fingerprints, host algorithms, the vendor op inside an island)
    "hetccl.group": 6,
    # 5: host algorithms, the collective runner and what it reports on a timeout
    "hetccl.algorithms.ring": 5, "hetccl.algorithms.latency": 5, "hetccl.algorithms.direct": 5,
    "hetccl.algorithms.staged_ring": 5,
    "hetccl.scheduler": 5, "hetccl.hangreport": 5,
    "hetccl.fastpath": 5,
    # 4: device memory operations (buffers, streams, vendor communicators, the link, staging) and bindings
    "hetccl.gpu": 4, "hetccl.bindings": 4,
    # 3: control plane (fabric, rendezvous, rank sources)
    "hetccl.bootstrap": 3, "hetccl.torchrun": 3, "hetccl.store": 3, "hetccl.waits": 3,
    "hetccl.recordtree": 3,
    # 2: transports
    "hetccl.transports": 2,
    # 1: observability and the cost model (the algorithms package itself: pure functions)
    "hetccl.observe": 1, "hetccl.algorithms": 1,
    # 1: message matching (the core's; transports deliver frames to it)
    "hetccl.matching": 1,
    # 0: host memory, formats, settings, sockets, process lifetime
    "hetccl.errors": 0, "hetccl.dtypes": 0, "hetccl.native": 0, "hetccl._native": 0, "hetccl.wire": 0,
    "hetccl.config": 0, "hetccl.netio": 0, "hetccl.auth": 0, "hetccl.flight": 0, "hetccl.ordering": 0,
    "hetccl.lifecycle": 0, "hetccl.shmseg": 0, "hetccl.params": 0,
}


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    mods = {}
    for path in (root / "hetccl").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported(name: str, is_pkg: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The hetccl modules one module imports anywhere in its body (relative imports resolved)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.orelse:
                    visit_node(stmt)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.add(sub if sub in known else mod)
        visit(node)

    visit(tree)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    known = set(mods)
    return {name: _imported(name, is_pkg, ast.parse(path.read_text()), known)
            for name, (path, is_pkg) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def layer_of(module: str) -> int | None:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len, default=None)
    if best is None or (best == "hetccl" and module != "hetccl"):
        return None
    return LAYERS[best]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(mod) is not None and layer_of(dep) is not None and layer_of(dep) > layer_of(mod):
                bad.append(f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)})")
    return bad


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"add these modules to LAYERS in tests/test_layers.py: {missing}"


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles (lazy imports inside functions count too): {found}"


def test_imports_run_down_the_layers() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_the_graph_sees_lazy_relative_imports(tmp_path: Path) -> None:
    """The checker itself: a function-level relative import is an edge, a TYPE_CHECKING one is not."""
    pkg = tmp_path / "hetccl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from ..a import f\nelse:\n    from .. import c\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["hetccl.a"] == {"hetccl.sub.b"} and graph["hetccl.sub.b"] == {"hetccl.c"}
    assert cycles(graph) == [["hetccl.a", "hetccl.c", "hetccl.sub.b"]]
