"""No module of the package may (un)pickle anything: walked with ast, not grepped."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hetccl"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
BANNED_CALLS = {"torch.load", "pickle.loads", "pickle.load"}
NUMPY_NAMES = {"np", "numpy"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def pickle_uses(source: str, name: str = "<src>") -> list[str]:
    """Every import of a pickle-like module, torch.load, np.load(allow_pickle=True), and dynamic imports of
    a banned module by a constant name, as 'file:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{name}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in BANNED_MODULES:
                found.append(f"{name}:{node.lineno}: from {node.module} import ...")
            if mod == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{name}:{node.lineno}: from torch import load")
        elif isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func in BANNED_CALLS or func.endswith(".torch.load"):
                found.append(f"{name}:{node.lineno}: {func}()")
            if func.split(".")[0] in NUMPY_NAMES and func.endswith(".load"):
                for kw in node.keywords:
                    off = isinstance(kw.value, ast.Constant) and kw.value.value is False
                    if kw.arg == "allow_pickle" and not off:
                        found.append(f"{name}:{node.lineno}: {func}(allow_pickle=...)")
            if func in ("__import__", "importlib.import_module", "import_module") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in BANNED_MODULES:
                    found.append(f"{name}:{node.lineno}: {func}({arg.value!r})")
    return found


def test_checker_finds_every_kind() -> None:
    """The checker itself: each banned form is reported, harmless look-alikes are not."""
    bad = {
        "import pickle": 1, "import cPickle as p": 1, "from pickle import loads": 1, "import marshal": 1,
        "import shelve": 1, "import dill": 1, "from dill.source import x": 1, "import torch\ntorch.load(f)": 1,
        "from torch import load": 1, "import numpy as np\nnp.load(f, allow_pickle=True)": 1,
        "import numpy\nnumpy.load(f, allow_pickle=flag)": 1, "__import__('pickle')": 1,
        "import importlib\nimportlib.import_module('marshal')": 1, "import os, pickle": 1,
    }
    for src, n in bad.items():
        assert len(pickle_uses(src)) == n, (src, pickle_uses(src))
    good = ["import json", "np.load(f)", "np.load(f, allow_pickle=False)", "x = 'pickle'", "import msgpack",
            "from .wire import decode_control_body", "model.load(f)", "import picklefree"]
    for src in good:
        assert pickle_uses(src) == [], (src, pickle_uses(src))


def test_no_module_imports_or_uses_pickle() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 20, files  # the walk really covers the package
    found = [hit for f in files for hit in pickle_uses(f.read_text(encoding="utf-8"), str(f.relative_to(PKG.parent)))]
    assert found == [], "\n".join(found)



async def test_store_add_out_of_64_bit_range_is_refused_not_a_dropped_connection() -> None:
    """Found by benchmarks/fuzz_control.py: an `add` past 2**64 made the store fail to encode its reply and
    drop the connection (a rank would see "lost the rendezvous store"). Now it is an error reply, the key
    keeps its value and the connection keeps serving."""
    import hetccl
    from hetccl.store import StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0, b"secret")
    port = await server.start()
    client = StoreClient("127.0.0.1", port, b"secret", 5.0)
    try:
        await client.connect()
        assert await client.add("n", 2**62) == 2**62
        assert await client.add("n", 2**62 - 1) == 2**63 - 1
        for delta in (1, 2**62):
            try:
                await client.add("n", delta)
            except hetccl.HetcclError as exc:
                assert "64-bit" in str(exc), exc
            else:
                raise AssertionError("an add past 2**63 - 1 was accepted")
        assert await client.add("m", -(2**63)) == -(2**63)
        assert await client.get("n") == 2**63 - 1
    finally:
        client.close()
        await server.close()
