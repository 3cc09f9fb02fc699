"""Device buffers: recognise GPU memory and expose it as (pointer, bytes, dtype, device, stream).

Accepted: torch CUDA tensors (ROCm builds of torch report HIP through torch.version.hip), CuPy arrays,
anything with `__cuda_array_interface__` (v2/v3) and DLPack capsules' owners (`__dlpack__`). The stream is
the buffer's *current* stream (torch.cuda.current_stream / cupy's current stream / the interface's
`stream` field), so a collective is ordered after the work already queued there, like torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes import DType, parse_dtype
from ..errors import ConfigError

_TYPESTR = {"|i1": DType.INT8, "|u1": DType.UINT8, "<i4": DType.INT32, "<i8": DType.INT64, "<f2": DType.FLOAT16,
            "<f4": DType.FLOAT32, "<f8": DType.FLOAT64, "<V2": DType.BFLOAT16}


@dataclass
class DeviceBuf:
    ptr: int
    dtype: DType
    count: int
    device: int
    vendor: str  # "cuda" | "hip"
    stream: int  # handle of the stream the collective is ordered on (0 = legacy default)
    obj: Any
    framework: str  # "torch" | "cupy" | "cai"

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def is_device(obj: Any) -> bool:
    """True for GPU memory (cheap: no import of torch or cupy)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return getattr(getattr(obj, "device", None), "type", "cpu") == "cuda"
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dl = getattr(obj, "__dlpack_device__", None)
    if dl is not None:
        try:
            return int(dl()[0]) in _DLPACK_GPU
        except Exception:  # a broken exporter is not device memory we can use
            return False
    return False


_DLPACK_GPU = {2, 10, 13}  # kDLCUDA, kDLROCM, kDLCUDAManaged


def current_stream_handle(device: int) -> int:
    """The raw handle of the calling thread's current stream on `device` (torch's private accessor costs a
    fraction of a microsecond; torch.cuda.current_stream builds a Stream object, some 10 us)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device)) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def as_device_buf(obj: Any, name: str = "buffer") -> DeviceBuf:
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch

        if obj.device.type == "cpu":
            raise ConfigError(f"{name} is a CPU tensor where device memory is needed; pass a CUDA/ROCm tensor")
        if not obj.is_contiguous():
            raise ConfigError(f"{name} is not contiguous; pass tensor.contiguous() and copy the result back")
        vendor = "hip" if getattr(torch.version, "hip", None) else "cuda"
        dev = obj.device.index if obj.device.index is not None else torch.cuda.current_device()
        stream = current_stream_handle(dev)
        return DeviceBuf(obj.data_ptr(), parse_dtype(obj.dtype), obj.numel(), dev, vendor, stream, obj, "torch")
    if mod.startswith("cupy"):
        import cupy

        if not obj.flags.c_contiguous:
            raise ConfigError(f"{name} is not contiguous; pass cupy.ascontiguousarray(x) and copy back")
        stream = cupy.cuda.get_current_stream().ptr
        vendor = "hip" if getattr(cupy.cuda.runtime, "is_hip", False) else "cuda"
        return DeviceBuf(obj.data.ptr, parse_dtype(obj.dtype.name if obj.dtype.name != "bfloat16" else
                                                   "bfloat16"), obj.size, obj.device.id, vendor, stream, obj, "cupy")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None and hasattr(obj, "__dlpack__"):  # e.g. JAX arrays: a zero-copy torch view through DLPack
        import torch

        t = torch.from_dlpack(obj)  # the exporter's stream is made to wait for torch's current stream
        buf = as_device_buf(t, name)
        buf.obj, buf.framework = t, "torch"
        return buf
    if cai is None:
        raise ConfigError(f"{name} is not device memory")
    shape = cai.get("shape", ())
    count = 1
    for s in shape:
        count *= s
    dt = _TYPESTR.get(cai.get("typestr", ""))
    if dt is None:
        raise ConfigError(f"{name} has element type {cai.get('typestr')!r}, which hetccl does not reduce")
    strides = cai.get("strides")
    if strides is not None:
        expect, ok = dt.itemsize, True
        for dim, st in zip(reversed(shape), reversed(strides), strict=True):
            ok &= st == expect or dim == 1
            expect *= dim
        if not ok:
            raise ConfigError(f"{name} is not contiguous")
    if cai.get("data", (0, False))[1]:
        raise ConfigError(f"{name} is read-only but hetccl must write the result into it")
    stream = cai.get("stream") or 0
    stream = 0 if stream in (1, 2) else stream  # 1/2: legacy / per-thread default stream markers
    return DeviceBuf(int(cai["data"][0]), dt, count, -1, "cuda", int(stream), obj, "cai")
