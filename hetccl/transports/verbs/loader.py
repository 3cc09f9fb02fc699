"""Loading pyverbs: a plain import, else the system copy of python3-pyverbs (a venv does not see it)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import SimpleNamespace

log = logging.getLogger("hetccl")


SYSTEM_SITE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/lib64/python3/site-packages",
                    f"/usr/lib/python3.{sys.version_info.minor}/site-packages",
                    f"/usr/lib64/python3.{sys.version_info.minor}/site-packages")

# ---------------------------------------------------------------------------------------------- pyverbs

_PV: SimpleNamespace | None = None


def _load_system_pyverbs() -> bool:
    """Distribution packages (Debian's python3-pyverbs) install pyverbs into the system Python's
    dist-packages, which a virtual environment does not see. Load just that package from there when its
    extension modules were built for this interpreter (the rest of dist-packages stays invisible)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
    # read through the package: hetccl.transports.verbs.SYSTEM_SITE_DIRS is the one to change (tests do)
    for base in getattr(sys.modules.get(__package__ or ""), "SYSTEM_SITE_DIRS", SYSTEM_SITE_DIRS):
        pkg = os.path.join(base, "pyverbs")
        init = os.path.join(pkg, "__init__.py")
        try:
            if not os.path.isfile(init) or not any(f.endswith(suffix) for f in os.listdir(pkg)):
                continue
        except OSError:
            continue
        spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[pkg])
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception:
            del sys.modules["pyverbs"]
            continue
        return True
    return False


def pyverbs() -> SimpleNamespace:
    """The pyverbs modules hetccl uses; ImportError with the reason when they cannot be imported."""
    global _PV
    if _PV is not None:
        return _PV
    # pyverbs.pyverbs_error calls logging.basicConfig(level=INFO) when imported: that would print every INFO
    # record of the application (and hetccl's init line on every rank) on stderr. Keep the root logger as it was.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        try:
            importlib.import_module("pyverbs.device")
        except ImportError as exc:
            sys.modules.pop("pyverbs", None)
            if not _load_system_pyverbs():
                raise ImportError(str(exc)) from None
        names = ("device", "enums", "cq", "pd", "mr", "qp", "wr", "addr", "pyverbs_error")
        mods = {n: importlib.import_module(f"pyverbs.{n}") for n in names}
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    _PV = SimpleNamespace(**mods)
    return _PV
