"""Where the vendor libraries are looked for: the search helpers of the NCCL/RCCL binding (`ccl`), kept apart
from the declarations, and the error that lists every place searched."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from .. import params
from ..errors import TransportError

T = TypeVar("T")


class Candidate(NamedTuple):
    """One place a library may be: `label` says where it comes from (for error messages), `path` is a file
    path or a bare soname handed to the dynamic loader."""

    label: str
    path: str


class Tried(NamedTuple):
    label: str
    path: str
    reason: str


def package_dirs(name: str) -> list[str]:
    """The directories of the top-level package `name` (all of them for a namespace package such as the
    `nvidia` of NVIDIA's wheels) found on sys.path, without importing the package."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    seen: list[str] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def rocm_lib_dirs() -> list[str]:
    """$ROCM_PATH/lib (and $HIP_PATH/lib), then /opt/rocm/lib, without duplicates."""
    dirs = []
    for var in ("ROCM_PATH", "HIP_PATH"):
        root = os.environ.get(var)
        if root:
            dirs.append(os.path.join(root, "lib"))
    dirs.append("/opt/rocm/lib")
    out: list[str] = []
    for d in dirs:
        if os.path.normpath(d) not in (os.path.normpath(x) for x in out):
            out.append(d)
    return out


def system_names(find_name: str, sonames: tuple[str, ...]) -> list[str]:
    """Bare library names for the dynamic loader (LD_LIBRARY_PATH, ldconfig cache, default paths):
    ctypes.util.find_library's answer first, then the given sonames."""
    names: list[str] = []
    try:
        found = ctypes.util.find_library(find_name)
    except Exception:  # find_library shells out; never let that break a search
        found = None
    if found:
        names.append(found)
    for n in sonames:
        if n not in names:
            names.append(n)
    return names


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _dladdr_fn() -> Any:
    for name in (None, "libdl.so.2"):
        try:
            fn = ctypes.CDLL(name).dladdr
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        fn.restype = ctypes.c_int
        return fn
    return None


def file_of_symbol(name: str, symbol: str) -> str | None:
    """The file the dynamic loader picked for library `name` (a bare soname), found through dladdr on
    one of its symbols; None when that cannot be told."""
    try:
        handle = ctypes.CDLL(name)
        addr = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
        dladdr = _dladdr_fn()
        info = _DlInfo()
        if dladdr is not None and addr and dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    except (OSError, AttributeError, ValueError):
        pass
    return None


def format_tried(tried: list[Tried]) -> str:
    return "; ".join(f"{t.label}: {t.reason}" if t.path == "-" else f"{t.label} ({t.path}): {t.reason}"
                     for t in tried) or "nothing"


def name_missing(symbols: list[str], limit: int = 8) -> str:
    """'a, b, c' or 'a, ..., h and 5 more' for an error message."""
    if len(symbols) <= limit:
        return ", ".join(symbols)
    return f"{', '.join(symbols[:limit])} and {len(symbols) - limit} more"


class Unusable(Exception):
    """A candidate library that exists but cannot serve; args[0] says why."""


def short_oserror(exc: OSError) -> str:
    """dlopen's own message, without cffi's note about find_library."""
    text = str(exc).split(".  Additionally", 1)[0]
    if text.startswith("cannot load library '") and "': " in text:
        text = text.split("': ", 1)[1]
    return text


def search_library(what: str, env: str, default_file: str, candidates: Callable[[], list[Candidate | Tried]],
                   opener: Callable[[str], T], searched: str, install: str) -> T:
    """Open the library named by $`env` (only that one: an explicit choice never falls back), else the first
    candidate that `opener` accepts. Every failure is a TransportError saying what was tried and why each
    place was refused, and what to install or set."""
    value = params.get(env) or ""
    if value:
        path = os.path.join(value, default_file) if os.path.isdir(value) else value
        if not os.path.exists(path):
            raise TransportError(
                f"{env}={value}: no such file. Point {env} at {default_file} (or the directory holding it), "
                f"or unset it to search {searched}")
        try:
            return opener(os.path.abspath(path))
        except Unusable as exc:
            raise TransportError(f"{env}={value}: {path} {exc.args[0]}. Point {env} at a working {what} "
                                 f"({default_file}), or unset it to search {searched}") from None
    tried: list[Tried] = [Tried(env, "-", "not set")]
    for cand in candidates():
        if isinstance(cand, Tried):
            tried.append(cand)
            continue
        if os.sep in cand.path and not os.path.exists(cand.path):
            tried.append(Tried(cand.label, cand.path, "no such file"))
            continue
        try:
            return opener(cand.path)
        except Unusable as exc:
            tried.append(Tried(cand.label, cand.path, exc.args[0]))
    raise TransportError(f"no usable {what} found: tried {format_tried(tried)}. {install}")
