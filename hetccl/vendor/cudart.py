"""Minimal cffi ABI-mode binding of the CUDA runtime (NVIDIA) and HIP (AMD): the few calls hetccl's GPU path
needs besides NCCL/RCCL, with one surface for both vendors.

Devices, streams (created non-blocking), events (timing disabled), event record/query/wait, async copies and
pinned host memory. Handles are plain integers (`cudaStream_t` / `hipStream_t` / events / pointers as
addresses), the same integers torch (`torch.cuda.current_stream().cuda_stream`) and CuPy
(`cupy.cuda.get_current_stream().ptr`) hand out, so they mix freely with those libraries and with NCCL.

`load_runtime("cuda")` looks at `$HETCCL_CUDART_LIB`, a libcudart already loaded in this process (torch or
CuPy imported first: using the same runtime keeps one set of globals), the nvidia-cuda-runtime wheels
(`nvidia/cu13/lib/libcudart.so.13`, `nvidia/cuda_runtime/lib/libcudart.so.12`), `$CUDA_HOME` /
`$CUDA_PATH` / `/usr/local/cuda`, then the system. `load_runtime("hip")` looks at `$HETCCL_HIP_LIB`, an
already loaded libamdhip64, `$ROCM_PATH/lib` and `/opt/rocm/lib`, a ROCm torch wheel, then the system.
"""

from __future__ import annotations

import enum
import os
import threading
from typing import Any

from ..errors import ConfigError, TransportError
from .search import (
    Candidate,
    Tried,
    Unusable,
    file_of_symbol,
    loaded_in_process,
    name_missing,
    package_dirs,
    rocm_lib_dirs,
    search_library,
    short_oserror,
    system_names,
)

# The CUDA and HIP declarations side by side (enums such as cudaMemcpyKind are int-sized and passed as int)
CDEF = r"""
typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream);
cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);

typedef int hipError_t;
typedef void *hipStream_t;
typedef void *hipEvent_t;
hipError_t hipRuntimeGetVersion(int *runtimeVersion);
hipError_t hipGetDeviceCount(int *count);
hipError_t hipSetDevice(int device);
hipError_t hipGetDevice(int *device);
hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags);
hipError_t hipStreamDestroy(hipStream_t stream);
hipError_t hipStreamSynchronize(hipStream_t stream);
hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned int flags);
hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned int flags);
hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream);
hipError_t hipEventQuery(hipEvent_t event);
hipError_t hipEventSynchronize(hipEvent_t event);
hipError_t hipEventDestroy(hipEvent_t event);
hipError_t hipMemcpyAsync(void *dst, const void *src, size_t sizeBytes, int kind, hipStream_t stream);
hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags);
hipError_t hipHostAlloc(void **ptr, size_t size, unsigned int flags);
hipError_t hipHostFree(void *ptr);
hipError_t hipFreeHost(void *ptr);
hipError_t hipGetLastError(void);
const char *hipGetErrorString(hipError_t error);
const char *hipGetErrorName(hipError_t error);
"""

# generic name -> the vendor's symbol(s), first one present wins
_SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {},
    "hip": {"HostAlloc": ("hipHostMalloc", "hipHostAlloc"), "FreeHost": ("hipHostFree", "hipFreeHost")},
}
GENERIC = (
    "RuntimeGetVersion", "GetDeviceCount", "SetDevice", "GetDevice", "StreamCreateWithFlags", "StreamDestroy",
    "StreamSynchronize", "StreamWaitEvent", "EventCreateWithFlags", "EventRecord", "EventQuery",
    "EventSynchronize", "EventDestroy", "MemcpyAsync", "HostAlloc", "FreeHost", "GetLastError",
    "GetErrorString", "GetErrorName",
)


def symbols_for(vendor: str, generic: str) -> tuple[str, ...]:
    prefix = "cuda" if vendor == "cuda" else "hip"
    return _SYMBOLS[vendor].get(generic, (prefix + generic,))


_ffi: Any = None
_ffi_lock = threading.Lock()


def get_ffi() -> Any:
    """The cffi FFI with CDEF parsed, made once."""
    global _ffi
    if _ffi is None:
        with _ffi_lock:
            if _ffi is None:
                import cffi

                ffi = cffi.FFI()
                ffi.cdef(CDEF)
                _ffi = ffi
    return _ffi


# values shared by CUDA and HIP
SUCCESS = 0
ERROR_NOT_READY = 600  # cudaErrorNotReady / hipErrorNotReady: queued work not finished, not an error
STREAM_NON_BLOCKING = 0x1  # cudaStreamNonBlocking / hipStreamNonBlocking
EVENT_DISABLE_TIMING = 0x2  # cudaEventDisableTiming / hipEventDisableTiming
HOST_ALLOC_DEFAULT = 0x0
HOST_ALLOC_PORTABLE = 0x1  # cudaHostAllocPortable / hipHostMallocPortable: pinned for every device
# "no usable GPU here" answers of GetDeviceCount: stub library (CUDA), insufficient driver, no device
_NO_DEVICE_CODES = {34, 35, 100}


class MemcpyKind(enum.IntEnum):
    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3
    DEFAULT = 4  # direction inferred from the pointers (unified addressing)


class EventStatus(enum.IntEnum):
    READY = 0
    NOT_READY = 1
    ERROR = 2


_HINTS = {
    2: "out of memory (device memory, or pinned host memory for HostAlloc); free memory or use smaller chunks",
    34: "this is the CUDA stub library, not a real runtime: set HETCCL_CUDART_LIB to a real libcudart",
    35: ("no usable GPU driver: none is installed (a CPU-only host), or it is older than this {rt} runtime; "
         "then use a runtime no newer than the driver supports (nvidia-smi shows the CUDA version) via "
         "HETCCL_{env}_LIB, or update the driver"),
    100: "no GPU is visible: check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES and that the driver is loaded",
    101: "invalid device ordinal: the rank's GPU index is beyond the visible devices (check the local rank and "
         "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
    700: "a kernel touched an illegal address; the GPU context is unusable now, restart the process",
}


def _decode_runtime_version(vendor: str, code: int) -> tuple[int, ...]:
    if vendor == "cuda":  # 1000 * major + 10 * minor
        return code // 1000, code % 1000 // 10
    # HIP_VERSION: major * 10_000_000 + minor * 100_000 + patch
    return code // 10_000_000, code % 10_000_000 // 100_000, code % 100_000


class GpuRuntime:
    """One loaded CUDA runtime (vendor "cuda") or HIP runtime (vendor "hip"). Handles are ints."""

    def __init__(self, vendor: str, path: str, lib: Any, fns: dict[str, Any]):
        self.vendor = vendor  # "cuda" | "hip"
        self.name = "CUDA" if vendor == "cuda" else "HIP"
        self.path = path
        self.lib = lib
        self.ffi = get_ffi()
        self.fn = fns  # generic name -> cffi function
        out = self.ffi.new("int *")
        res = fns["RuntimeGetVersion"](out)
        self.version: tuple[int, ...] = _decode_runtime_version(vendor, int(out[0])) if res == 0 else ()
        self.no_device_reason = ""  # why device_count() answered 0, when it did

    def __repr__(self) -> str:
        return f"GpuRuntime({self.name} {'.'.join(map(str, self.version))} at {self.path})"

    # -- errors
    def error_string(self, code: int) -> str:
        s = self.fn["GetErrorString"](int(code))
        return self.ffi.string(s).decode(errors="replace") if s != self.ffi.NULL else ""

    def error_name(self, code: int) -> str:
        s = self.fn["GetErrorName"](int(code))
        return self.ffi.string(s).decode(errors="replace") if s != self.ffi.NULL else f"error {code}"

    def describe(self, code: int, what: str) -> str:
        msg = (f"{self.name} runtime {'.'.join(map(str, self.version))} {what} failed: {self.error_name(code)} "
               f"({int(code)}): {self.error_string(code)}")
        hint = _HINTS.get(int(code))
        if hint:
            msg += "; " + hint.format(rt=self.name, env="CUDART" if self.vendor == "cuda" else "HIP")
        return msg

    def check(self, code: int, what: str) -> None:
        if code != SUCCESS:
            raise TransportError(self.describe(code, what))

    def _vp(self, x: Any, ctype: str = "void *") -> Any:
        if isinstance(x, int):
            return self.ffi.cast(ctype, x) if x else self.ffi.NULL
        return self.ffi.NULL if x is None else x

    @staticmethod
    def _int(p: Any) -> int:
        return int(get_ffi().cast("uintptr_t", p))

    # -- devices
    def device_count(self) -> int:
        """Visible GPUs; 0 (with the reason in `no_device_reason`) when there is no device or driver."""
        out = self.ffi.new("int *")
        res = self.fn["GetDeviceCount"](out)
        if res in _NO_DEVICE_CODES:
            self.no_device_reason = self.describe(res, "GetDeviceCount")
            self.fn["GetLastError"]()  # clear the (non-sticky) error so later calls do not report it
            return 0
        self.check(res, "GetDeviceCount")
        self.no_device_reason = ""
        return int(out[0])

    def set_device(self, device: int) -> None:
        self.check(self.fn["SetDevice"](int(device)), f"SetDevice({device})")

    def get_device(self) -> int:
        out = self.ffi.new("int *")
        self.check(self.fn["GetDevice"](out), "GetDevice")
        return int(out[0])

    # -- streams and events
    def stream_create(self, non_blocking: bool = True) -> int:
        """A new stream on the current device; non-blocking: it does not synchronise with the legacy
        default stream."""
        out = self.ffi.new("void **")
        self.check(self.fn["StreamCreateWithFlags"](out, STREAM_NON_BLOCKING if non_blocking else 0),
                   "StreamCreateWithFlags")
        return self._int(out[0])

    def stream_destroy(self, stream: int) -> None:
        self.check(self.fn["StreamDestroy"](self._vp(stream)), "StreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self.check(self.fn["StreamSynchronize"](self._vp(stream)), "StreamSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on `stream` after this waits for `event` (no host blocking)."""
        self.check(self.fn["StreamWaitEvent"](self._vp(stream), self._vp(event), 0), "StreamWaitEvent")

    def event_create(self) -> int:
        """A new event with timing disabled (the cheap kind, for ordering and completion polling)."""
        out = self.ffi.new("void **")
        self.check(self.fn["EventCreateWithFlags"](out, EVENT_DISABLE_TIMING), "EventCreateWithFlags")
        return self._int(out[0])

    def event_record(self, event: int, stream: int | None = 0) -> None:
        self.check(self.fn["EventRecord"](self._vp(event), self._vp(stream)), "EventRecord")

    def event_status(self, event: int) -> tuple[EventStatus, int]:
        """(READY | NOT_READY | ERROR, raw code) without raising."""
        res = self.fn["EventQuery"](self._vp(event))
        if res == SUCCESS:
            return EventStatus.READY, res
        if res == ERROR_NOT_READY:
            return EventStatus.NOT_READY, res
        return EventStatus.ERROR, res

    def event_query(self, event: int) -> bool:
        """True when the work before the event has finished, False while it has not; an error (a failed
        kernel, a lost device) raises TransportError."""
        status, res = self.event_status(event)
        if status is EventStatus.ERROR:
            raise TransportError(self.describe(res, "EventQuery"))
        return status is EventStatus.READY

    def event_synchronize(self, event: int) -> None:
        self.check(self.fn["EventSynchronize"](self._vp(event)), "EventSynchronize")

    def event_destroy(self, event: int) -> None:
        self.check(self.fn["EventDestroy"](self._vp(event)), "EventDestroy")

    # -- memory
    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: MemcpyKind = MemcpyKind.DEFAULT,
                     stream: int | None = 0) -> None:
        """Copy `nbytes` on `stream`; truly asynchronous only between device and pinned host memory."""
        self.check(self.fn["MemcpyAsync"](self._vp(dst), self._vp(src), int(nbytes), int(kind), self._vp(stream)),
                   f"MemcpyAsync({nbytes} bytes, {MemcpyKind(kind).name})")

    def host_alloc(self, nbytes: int, portable: bool = True) -> int:
        """Pinned (page-locked) host memory; free with free_host. Portable: pinned for every device."""
        if nbytes <= 0:
            raise ConfigError(f"pinned allocation of {nbytes} bytes; ask for at least 1")
        out = self.ffi.new("void **")
        self.check(self.fn["HostAlloc"](out, int(nbytes), HOST_ALLOC_PORTABLE if portable else HOST_ALLOC_DEFAULT),
                   f"HostAlloc({nbytes} bytes)")
        return self._int(out[0])

    def free_host(self, ptr: int) -> None:
        self.check(self.fn["FreeHost"](self._vp(ptr)), "FreeHost")

    def host_buffer(self, ptr: int, nbytes: int) -> Any:
        """A writable buffer-protocol view of host memory at `ptr` (np.frombuffer(view, np.uint8) works)."""
        return self.ffi.buffer(self.ffi.cast("char *", ptr), nbytes)


# ---------------------------------------------------------------------------------------------------------
# Finding and loading

_cache: dict[tuple[str, str], GpuRuntime] = {}
_lock = threading.RLock()


def _open(vendor: str, path: str) -> GpuRuntime:
    ffi = get_ffi()
    key = os.path.realpath(path) if os.sep in path else None
    if key is not None and (vendor, key) in _cache:
        return _cache[vendor, key]
    try:
        lib = ffi.dlopen(path)
    except OSError as exc:
        raise Unusable(f"cannot be loaded: {short_oserror(exc)}") from None
    fns: dict[str, Any] = {}
    missing: list[str] = []
    for generic in GENERIC:
        names = symbols_for(vendor, generic)
        for sym in names:
            try:
                fns[generic] = getattr(lib, sym)
                break
            except AttributeError:
                continue
        else:
            missing.append(" or ".join(names))
    name = "CUDA runtime" if vendor == "cuda" else "HIP runtime"
    if missing:
        ffi.dlclose(lib)
        raise Unusable(f"loads but lacks the symbols {name_missing(missing)}: it is not a {name}")
    if key is None:
        key = file_of_symbol(path, symbols_for(vendor, "GetDeviceCount")[0]) or path
        if (vendor, key) in _cache:
            ffi.dlclose(lib)
            return _cache[vendor, key]
    rt = GpuRuntime(vendor, key, lib, fns)
    _cache[vendor, key] = rt
    return rt


def _cuda_candidates() -> list[Candidate | Tried]:
    out: list[Candidate | Tried] = [Candidate("already loaded in this process", p)
                                    for p in loaded_in_process("libcudart.so")]
    dirs = package_dirs("nvidia")
    wheel = [os.path.join(d, *rel) for d in dirs for rel in (("cu13", "lib", "libcudart.so.13"),
                                                            ("cuda_runtime", "lib", "libcudart.so.12"),
                                                            ("cu12", "lib", "libcudart.so.12"))]
    found = [p for p in wheel if os.path.isfile(p)]
    if found:
        out += [Candidate("nvidia-cuda-runtime wheel", p) for p in found]
    else:
        out.append(Tried("nvidia-cuda-runtime wheel", "site-packages/nvidia/{cu13,cuda_runtime}/lib/libcudart.so.*",
                         "not installed"))
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    seen: set[str] = set()
    for root in roots:
        if not root or os.path.normpath(root) in seen:
            continue
        seen.add(os.path.normpath(root))
        files = [os.path.join(root, "lib64", n) for n in ("libcudart.so.13", "libcudart.so.12", "libcudart.so")]
        present = [f for f in files if os.path.exists(f)]
        out += [Candidate("CUDA toolkit", f) for f in present] or [Tried("CUDA toolkit", files[-1], "no such file")]
    out += [Candidate("system", n)
            for n in system_names("cudart", ("libcudart.so.13", "libcudart.so.12", "libcudart.so"))]
    return out


def _hip_candidates() -> list[Candidate | Tried]:
    out: list[Candidate | Tried] = [Candidate("already loaded in this process", p)
                                    for p in loaded_in_process("libamdhip64.so")]
    for d in rocm_lib_dirs():
        files = [os.path.join(d, n) for n in ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")]
        present = [f for f in files if os.path.exists(f)]
        out += [Candidate("ROCm", f) for f in present] or [Tried("ROCm", files[0], "no such file")]
    for d in package_dirs("torch"):  # a ROCm build of torch bundles libamdhip64 in torch/lib
        lib_dir = os.path.join(d, "lib")
        if os.path.isdir(lib_dir):
            out += [Candidate("torch wheel", os.path.join(lib_dir, n)) for n in sorted(os.listdir(lib_dir))
                    if n.startswith("libamdhip64.so")]
    out += [Candidate("system", n) for n in system_names("amdhip64", ("libamdhip64.so", "libamdhip64.so.6"))]
    return out


def load_runtime(vendor: str = "cuda") -> GpuRuntime:
    """The CUDA runtime ('cuda' / 'nvidia' / 'nccl') or HIP ('hip' / 'amd' / 'rocm' / 'rccl'); cached per file.
    Raises TransportError listing every place tried when none is usable."""
    v = vendor.lower()
    with _lock:
        if v in ("cuda", "nvidia", "nccl"):
            return search_library(
                "CUDA runtime", "HETCCL_CUDART_LIB", "libcudart.so.12", _cuda_candidates, lambda p: _open("cuda", p),
                "the libcudart already loaded, the nvidia-cuda-runtime wheels, $CUDA_HOME and the system",
                "Install one with `pip install nvidia-cuda-runtime-cu12` (CUDA 12) or `pip install "
                "nvidia-cuda-runtime` (CUDA 13), or set HETCCL_CUDART_LIB=/path/to/libcudart.so.12")
        if v in ("hip", "amd", "rocm", "rccl"):
            return search_library(
                "HIP runtime", "HETCCL_HIP_LIB", "libamdhip64.so", _hip_candidates, lambda p: _open("hip", p),
                "the libamdhip64 already loaded, $ROCM_PATH/lib, /opt/rocm/lib, a ROCm torch wheel and the system",
                "Install ROCm (the hip-runtime-amd package), set ROCM_PATH to the ROCm install, or set "
                "HETCCL_HIP_LIB=/path/to/libamdhip64.so")
    raise ConfigError(f"unknown GPU runtime vendor {vendor!r}; use 'cuda' or 'hip'")
