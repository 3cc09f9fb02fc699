"""Stream memory operations: a GPU stream that waits for, or writes, a 32-bit word in host-mapped memory.

This is what lets the cross-island link (`hetccl/gpu/pairlink.py`) run without the CPU in the loop: the
sender's copy stream publishes "chunk k is in the slot" by writing a counter after its copy, and the
receiver's copy stream waits for that counter before copying the slot, all enqueued ahead of time.

CUDA: the driver API (`libcuda.so.1`: cuStreamWaitValue32_v2 / cuStreamWriteValue32_v2,
cuMemHostGetDevicePointer_v2). HIP: the same calls in the HIP runtime (hipStreamWaitValue32 /
hipStreamWriteValue32, hipHostGetDevicePointer). `load_streamops()` raises `Unavailable` (a TransportError)
with the reason when they cannot be used; callers then fall back to CPU-signalled copies.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import TransportError

CDEF = r"""
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
CUresult cuInit(unsigned int flags);
CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, unsigned int value, unsigned int flags);
CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, unsigned int value, unsigned int flags);
CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, unsigned int value, unsigned int flags);
CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, unsigned int value, unsigned int flags);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int flags);
CUresult cuGetErrorName(CUresult error, const char **pStr);

typedef int hipError_t;
hipError_t hipStreamWaitValue32(void *stream, void *ptr, unsigned int value, unsigned int flags,
                                unsigned int mask);
hipError_t hipStreamWriteValue32(void *stream, void *ptr, unsigned int value, unsigned int flags);
hipError_t hipHostGetDevicePointer(void **devPtr, void *hstPtr, unsigned int flags);
"""

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ / hipStreamWaitValueGte: (int32)(*addr - value) >= 0
HIP_WAIT_GTE = 0x0


class Unavailable(TransportError):
    """Stream memory operations cannot be used here (no driver, old driver, unsupported device)."""


class StreamOps:
    """wait_geq(stream, addr, value) / write(stream, addr, value) on 32-bit words of host-mapped memory;
    `addr` comes from device_pointer(host_address)."""

    def __init__(self, vendor: str, ffi: Any, lib: Any):
        self.vendor, self.ffi, self.lib = vendor, ffi, lib
        if vendor == "cuda":
            self._wait = _first(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
            self._write = _first(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        else:
            self._wait, self._write = lib.hipStreamWaitValue32, lib.hipStreamWriteValue32

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ""
            if self.vendor == "cuda":
                p = self.ffi.new("const char **")
                if self.lib.cuGetErrorName(rc, p) == 0 and p[0] != self.ffi.NULL:
                    name = " " + self.ffi.string(p[0]).decode()
            raise TransportError(f"{what} failed with error {rc}{name}")

    def device_pointer(self, host_address: int) -> int:
        if self.vendor == "cuda":
            out = self.ffi.new("CUdeviceptr *")
            self._check(self.lib.cuMemHostGetDevicePointer_v2(out, self.ffi.cast("void *", host_address), 0),
                        "cuMemHostGetDevicePointer")
            return int(out[0])
        out = self.ffi.new("void **")
        self._check(self.lib.hipHostGetDevicePointer(out, self.ffi.cast("void *", host_address), 0),
                    "hipHostGetDevicePointer")
        return int(self.ffi.cast("uintptr_t", out[0]))

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        value &= 0xFFFFFFFF
        if self.vendor == "cuda":
            rc = self._wait(self.ffi.cast("CUstream", stream), addr, value, WAIT_GEQ)
        else:
            rc = self._wait(self.ffi.cast("void *", stream), self.ffi.cast("void *", addr), value, HIP_WAIT_GTE,
                            0xFFFFFFFF)
        self._check(rc, "stream wait on a host counter")

    def write(self, stream: int, addr: int, value: int) -> None:
        value &= 0xFFFFFFFF
        if self.vendor == "cuda":
            rc = self._write(self.ffi.cast("CUstream", stream), addr, value, 0)  # 0: with a memory barrier
        else:
            rc = self._write(self.ffi.cast("void *", stream), self.ffi.cast("void *", addr), value, 0)
        self._check(rc, "stream write of a host counter")


def _first(lib: Any, *names: str) -> Any:
    for n in names:
        try:
            return getattr(lib, n)
        except AttributeError:
            continue
    raise Unavailable(f"the GPU driver lacks {' and '.join(names)}")


_cache: dict[str, StreamOps] = {}
_lock = threading.Lock()


def load_streamops(vendor: str = "cuda") -> StreamOps:
    """The stream memory operations of `vendor` ("cuda" or "hip"); raises Unavailable with the reason."""
    with _lock:
        if vendor in _cache:
            return _cache[vendor]
        if os.environ.get("HETCCL_STREAM_MEMOPS", "1") == "0":
            raise Unavailable("disabled by HETCCL_STREAM_MEMOPS=0")
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        path = "libcuda.so.1" if vendor == "cuda" else os.environ.get("HETCCL_HIP_LIB", "libamdhip64.so")
        try:
            lib = ffi.dlopen(path)
        except OSError as exc:
            raise Unavailable(f"{path} cannot be loaded ({exc}); is the GPU driver installed?") from None
        if vendor == "cuda":
            rc = lib.cuInit(0)
            if rc != 0:
                raise Unavailable(f"cuInit failed with error {rc}")
        ops = StreamOps(vendor, ffi, lib)
        _cache[vendor] = ops
        return ops
