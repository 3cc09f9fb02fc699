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

import array
import threading
from typing import Any

from .. import native, params
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
typedef void *CUevent;
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUstream stream);
CUresult cuEventCreate(CUevent *event, unsigned int flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventQuery(CUevent event);
CUresult cuEventDestroy_v2(CUevent event);
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags);
CUresult cuModuleGetLoadingMode(int *mode);

typedef int hipError_t;
hipError_t hipStreamWaitValue32(void *stream, void *ptr, unsigned int value, unsigned int flags,
                                unsigned int mask);
hipError_t hipStreamWriteValue32(void *stream, void *ptr, unsigned int value, unsigned int flags);
hipError_t hipHostGetDevicePointer(void **devPtr, void *hstPtr, unsigned int flags);
hipError_t hipMemcpyAsync(void *dst, const void *src, size_t nbytes, int kind, void *stream);
hipError_t hipEventCreateWithFlags(void **event, unsigned int flags);
hipError_t hipEventRecord(void *event, void *stream);
hipError_t hipEventQuery(void *event);
hipError_t hipEventDestroy(void *event);
hipError_t hipStreamWaitEvent(void *stream, void *event, unsigned int flags);
"""

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ / hipStreamWaitValueGte: (int32)(*addr - value) >= 0
HIP_WAIT_GTE = 0x0
EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING / hipEventDisableTiming
NOT_READY = 600  # CUDA_ERROR_NOT_READY / hipErrorNotReady
HIP_MEMCPY_DEFAULT = 4
LAZY_LOADING = 2  # CU_MODULE_LAZY_LOADING (CU_MODULE_EAGER_LOADING is 1)


class Unavailable(TransportError):
    """Stream memory operations cannot be used here (no driver, old driver, unsupported device)."""


class StreamOps:
    """wait_geq(stream, addr, value) / write(stream, addr, value) on 32-bit words of host-mapped memory;
    `addr` comes from device_pointer(host_address). Also the few driver calls the link enqueues per chunk
    (copy, event record / wait / query): a driver call through cffi costs about a microsecond, where the
    torch equivalents (stream contexts, tensor slices, Event objects) cost 5-20 us each, and a 256 MiB
    all_reduce enqueues some 700 of them. Streams and events are raw handles (ints)."""

    def __init__(self, vendor: str, ffi: Any, lib: Any):
        self.vendor, self.ffi, self.lib = vendor, ffi, lib
        # None where the driver lacks them: load_streamops() refuses such a driver, load_driver() does not
        if vendor == "cuda":
            self._wait_name = _first_name(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
            self._write_name = _first_name(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        else:
            self._wait_name = _first_name(lib, "hipStreamWaitValue32")
            self._write_name = _first_name(lib, "hipStreamWriteValue32")
        self._wait = getattr(lib, self._wait_name) if self._wait_name else None
        self._write = getattr(lib, self._write_name) if self._write_name else None
        self._batch_fns: tuple[int, int, int] | None = None  # the driver's addresses for hccl_stream_batch

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

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between unified addresses (device memory, registered host memory) on `stream`."""
        if self.vendor == "cuda":
            rc = self.lib.cuMemcpyAsync(dst, src, nbytes, self.ffi.cast("CUstream", stream))
        else:
            rc = self.lib.hipMemcpyAsync(self.ffi.cast("void *", dst), self.ffi.cast("void *", src), nbytes,
                                         HIP_MEMCPY_DEFAULT, self.ffi.cast("void *", stream))
        self._check(rc, f"async copy of {nbytes} bytes")

    def batch(self) -> StreamBatch:
        """An empty batch of copies and word operations, enqueued by one native call at its flush()."""
        return StreamBatch(self)

    def run_batch(self, items: list[int]) -> None:
        """Enqueue a StreamBatch's operations (5 integers each), in order; the first the driver refuses
        raises TransportError, the ones before it enqueued."""
        fns = self._batch_fns
        if fns is None:
            if self._wait_name is None or self._write_name is None:
                raise Unavailable("the GPU driver lacks stream memory operations")
            copy = "cuMemcpyAsync" if self.vendor == "cuda" else "hipMemcpyAsync"
            fns = self._batch_fns = tuple(int(self.ffi.cast("uintptr_t", self.ffi.addressof(self.lib, name)))
                                          for name in (copy, self._write_name, self._wait_name))
        ops = array.array("Q", items)
        rc = native.ffi.new("int *")
        failed = native.lib.hccl_stream_batch(native.ffi.cast("uint64_t *", ops.buffer_info()[0]), len(ops) // 5,
                                              0 if self.vendor == "cuda" else 1, *fns, rc)
        if failed >= 0:
            kind, nbytes = items[5 * failed], items[5 * failed + 4]
            self._check(rc[0], f"async copy of {nbytes} bytes" if kind == BATCH_COPY else
                        "stream write of a host counter" if kind == BATCH_WRITE else "stream wait on a host counter")

    def event(self) -> int:
        """A new event (timing disabled) in the calling thread's current context (destroy with drop)."""
        out = self.ffi.new("void **")
        if self.vendor == "cuda":
            rc = self.lib.cuEventCreate(self.ffi.cast("CUevent *", out), EVENT_DISABLE_TIMING)
        else:
            rc = self.lib.hipEventCreateWithFlags(out, EVENT_DISABLE_TIMING)
        self._check(rc, "event creation")
        return int(self.ffi.cast("uintptr_t", out[0]))

    def record(self, event: int, stream: int) -> None:
        if self.vendor == "cuda":
            rc = self.lib.cuEventRecord(self.ffi.cast("CUevent", event), self.ffi.cast("CUstream", stream))
        else:
            rc = self.lib.hipEventRecord(self.ffi.cast("void *", event), self.ffi.cast("void *", stream))
        self._check(rc, "event record")

    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on `stream` after this waits for the event's last record (no host blocking)."""
        if self.vendor == "cuda":
            rc = self.lib.cuStreamWaitEvent(self.ffi.cast("CUstream", stream), self.ffi.cast("CUevent", event), 0)
        else:
            rc = self.lib.hipStreamWaitEvent(self.ffi.cast("void *", stream), self.ffi.cast("void *", event), 0)
        self._check(rc, "stream wait on an event")

    def query(self, event: int) -> bool:
        """Whether the work before the event's last record has finished; a device error raises."""
        if self.vendor == "cuda":
            rc = self.lib.cuEventQuery(self.ffi.cast("CUevent", event))
        else:
            rc = self.lib.hipEventQuery(self.ffi.cast("void *", event))
        if rc == NOT_READY:
            return False
        self._check(rc, "event query")
        return True

    def lazy_loading(self) -> bool | None:
        """Whether this process loads GPU modules lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2);
        None where the driver cannot say (HIP, a CUDA driver older than 11.7)."""
        get = _first(self.lib, "cuModuleGetLoadingMode") if self.vendor == "cuda" else None
        if get is None:
            return None
        mode = self.ffi.new("int *")
        return get(mode) == 0 and mode[0] == LAZY_LOADING

    def drop(self, event: int) -> None:
        if self.vendor == "cuda":
            self.lib.cuEventDestroy_v2(self.ffi.cast("CUevent", event))
        else:
            self.lib.hipEventDestroy(self.ffi.cast("void *", event))


BATCH_COPY, BATCH_WRITE, BATCH_WAIT = 0, 1, 2  # hccl_stream_batch's kinds (native/hetccl_native.h)


class StreamBatch:
    """Copies, word stores and word waits collected in order and enqueued by one native call
    (hccl_stream_batch) at flush(): an ordered collective enqueues four a piece, and a Python call each cost its
    caller's thread 3-9 us on an H100 shared by two ranks, against the driver's own 1.5-2 us (2026-12-07,
    200 MiB all_reduce: 1.3 ms of enqueueing). Work enqueued otherwise (kernels, events) must come after a
    flush() of what was collected before it."""

    __slots__ = ("_ops", "_items")

    def __init__(self, ops: StreamOps):
        self._ops = ops
        self._items: list[int] = []

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._items += (BATCH_COPY, stream, dst, src, nbytes)

    def write(self, stream: int, addr: int, value: int) -> None:
        self._items += (BATCH_WRITE, stream, addr, value & 0xFFFFFFFF, 0)

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        self._items += (BATCH_WAIT, stream, addr, value & 0xFFFFFFFF, 0)

    def __len__(self) -> int:
        return len(self._items) // 5

    def flush(self) -> None:
        items = self._items
        if items:
            self._items = []
            self._ops.run_batch(items)


class RawEvent:
    """A StreamOps event with the query() of a torch Event (what runtime.wait_event polls); an owned one is
    destroyed with this object, or handed back to `pool` for the next record (creating one costs microseconds
    on every device collective)."""

    __slots__ = ("ops", "handle", "owned", "pool")

    def __init__(self, ops: StreamOps, handle: int, owned: bool = False, pool: list[int] | None = None):
        self.ops, self.handle, self.owned, self.pool = ops, handle, owned, pool

    def query(self) -> bool:
        return self.ops.query(self.handle)

    def __del__(self) -> None:
        if self.owned and self.pool is not None and len(self.pool) < 1024:  # nobody can query it any more
            self.pool.append(self.handle)
        elif self.owned:
            try:
                self.ops.drop(self.handle)
            except Exception:  # interpreter shutdown: the driver may be gone already
                pass


def _first(lib: Any, *names: str) -> Any:
    name = _first_name(lib, *names)
    return None if name is None else getattr(lib, name)


def _first_name(lib: Any, *names: str) -> str | None:
    for n in names:
        try:
            getattr(lib, n)
        except AttributeError:
            continue
        return n
    return None


_cache: dict[str, StreamOps] = {}
_lock = threading.Lock()


def load_driver(vendor: str = "cuda") -> StreamOps:
    """The driver calls of `vendor` ("cuda" or "hip"): copies and events always, stream memory operations
    where the driver has them; raises Unavailable with the reason when the driver cannot be loaded."""
    with _lock:
        if vendor in _cache:
            return _cache[vendor]
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        path = "libcuda.so.1" if vendor == "cuda" else (params.get("HETCCL_HIP_LIB") or "libamdhip64.so")
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


def load_streamops(vendor: str = "cuda") -> StreamOps:
    """The stream memory operations of `vendor` ("cuda" or "hip"); raises Unavailable with the reason."""
    if not params.get("HETCCL_STREAM_MEMOPS"):
        raise Unavailable("disabled by HETCCL_STREAM_MEMOPS=0")
    ops = load_driver(vendor)
    if ops._wait is None or ops._write is None:
        raise Unavailable("the GPU driver lacks " + ("cuStreamWaitValue32 and cuStreamWriteValue32"
                                                     if vendor == "cuda" else
                                                     "hipStreamWaitValue32 and hipStreamWriteValue32"))
    return ops
