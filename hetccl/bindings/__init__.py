"""hetccl's own bindings to vendor libraries that are loaded at run time, never linked: NCCL / RCCL (`ccl`),
where those libraries are looked for (`search`), and the GPU driver's copies, events and stream memory
operations (`streamops`). CUDA / HIP runtime calls themselves go through torch (`torch.cuda`).

Everything here is cffi ABI mode (`ffi.cdef` + `ffi.dlopen`), so hetccl installs and imports without a
compiler, a CUDA toolkit or ROCm; a library is only looked for when device memory first needs it (a GPU
island's vendor communicator, the driver calls of the cross-island link), and a missing one is a
`TransportError` that says what was tried.

The public entry points are `load_nccl()` and `load_rccl()` (hetccl.bindings.ccl), also reachable here without
importing the submodule eagerly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_nccl", "load_rccl"]


def __getattr__(name: str) -> Any:  # lazy: importing hetccl.bindings must not pull in cffi parsing
    if name in ("load_nccl", "load_rccl"):
        from . import ccl

        return getattr(ccl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
