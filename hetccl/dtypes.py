"""Data types, reduce operations and the adaptation of user buffers to flat byte views.

A user buffer (numpy array, torch CPU tensor, anything with the buffer protocol; device buffers in a later
layer) becomes a `Buf`: a writable flat uint8 numpy view over the same memory plus a dtype code, so that
transports and algorithms only ever see bytes and element counts.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from .errors import ConfigError


class DType(enum.IntEnum):
    # the numbers are the native library's codes (native/hetccl_native.h)
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    INT64 = 3
    FLOAT16 = 4
    BFLOAT16 = 5
    FLOAT32 = 6
    FLOAT64 = 7

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self >= DType.FLOAT16


_ITEMSIZE = {
    DType.INT8: 1, DType.UINT8: 1, DType.INT32: 4, DType.INT64: 8,
    DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT64: 8,
}


class ReduceOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4  # sum, then divide by the number of ranks


_NUMPY_DTYPES = {
    "int8": DType.INT8, "uint8": DType.UINT8, "int32": DType.INT32, "int64": DType.INT64,
    "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16, "float32": DType.FLOAT32, "float64": DType.FLOAT64,
}
_NAMES = {v: k for k, v in _NUMPY_DTYPES.items()}
# struct/buffer-protocol format characters
_FORMATS = {"b": DType.INT8, "B": DType.UINT8, "i": DType.INT32, "l": DType.INT64, "q": DType.INT64,
            "e": DType.FLOAT16, "f": DType.FLOAT32, "d": DType.FLOAT64}


def dtype_name(dt: DType) -> str:
    return _NAMES[dt]


def parse_dtype(value: Any) -> DType:
    """A DType from a DType, a name ('float32', 'bf16', ...), a numpy dtype or a torch dtype."""
    if isinstance(value, DType):
        return value
    try:
        return _PARSED[value]  # torch and numpy dtypes are hashable: every collective parses one
    except (KeyError, TypeError):
        pass
    dt = _parse_dtype(value)
    try:
        if len(_PARSED) < 256:
            _PARSED[value] = dt
    except TypeError:
        pass
    return dt


_PARSED: dict[Any, DType] = {}


def _parse_dtype(value: Any) -> DType:
    text = str(value).lower().removeprefix("torch.")
    aliases = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
               "fp16": "float16", "fp32": "float32", "fp64": "float64", "int": "int32", "long": "int64",
               "char": "int8", "byte": "uint8"}
    text = aliases.get(text, text)
    try:
        return _NUMPY_DTYPES[np.dtype(text).name if text != "bfloat16" else text]
    except (TypeError, KeyError, ValueError, SyntaxError):
        raise ConfigError(
            f"unsupported dtype {value!r}; use one of {', '.join(_NUMPY_DTYPES)}") from None


def parse_op(value: Any) -> ReduceOp:
    """A ReduceOp from ReduceOp, 'sum'/'prod'/'min'/'max'/'avg' or anything with such a .name."""
    if isinstance(value, ReduceOp):
        return value
    name = getattr(value, "name", value)
    try:
        return ReduceOp[str(name).upper().removeprefix("REDUCEOP.")]
    except KeyError:
        raise ConfigError(f"unsupported reduce op {value!r}; use sum, prod, min, max or avg") from None


class Buf:
    """A flat byte view of a user buffer. `data` is a uint8 numpy array sharing the user's memory."""

    __slots__ = ("data", "dtype", "count", "obj")

    def __init__(self, data: np.ndarray, dtype: DType, count: int, obj: Any = None):
        self.data, self.dtype, self.count, self.obj = data, dtype, count, obj  # obj keeps the user's alive

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def elems(self, start: int, stop: int) -> np.ndarray:
        """Bytes of elements [start, stop)."""
        isz = self.dtype.itemsize
        return self.data[start * isz: stop * isz]

    def typed(self) -> np.ndarray:
        """A typed view (bf16 as uint16) for checks and small host-side work."""
        if self.dtype == DType.BFLOAT16:
            return self.data.view(np.uint16)
        return self.data.view(_NAMES[self.dtype])


def _from_torch(t: Any, name: str, writable: bool) -> Buf:
    import torch  # only reached when a torch tensor was passed

    if t.device.type != "cpu":
        raise ConfigError(
            f"{name} is a {t.device.type} tensor; this build moves CPU memory only "
            "(device buffers arrive with the NCCL/RCCL transports)")
    if not t.is_contiguous():
        raise ConfigError(f"{name} is not contiguous; pass tensor.contiguous() and copy the result back")
    dt = parse_dtype(t.dtype)
    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    data = raw.numpy()
    return Buf(data, dt, flat.numel(), t)


# the hot path's numpy dtypes (native byte order): those of _NUMPY_DTYPES that this numpy has (no bfloat16)
_FAST: dict[np.dtype, DType] = {np.dtype(n): dt for n, dt in _NUMPY_DTYPES.items() if hasattr(np, n)}


def as_buf(obj: Any, name: str = "buffer", writable: bool = True) -> Buf:
    """Adapt a user buffer; raise ConfigError for anything that cannot be used as asked."""
    if type(obj) is np.ndarray:  # hot path: a plain contiguous numpy array
        dt = _FAST.get(obj.dtype)
        flags = obj.flags
        if dt is not None and flags.c_contiguous and (flags.writeable or not writable) and obj.size:
            return Buf(obj.reshape(-1).view(np.uint8), dt, obj.size, obj)
    if obj is None:
        raise ConfigError(f"{name} is None; pass a numpy array, a torch tensor or a buffer")
    if isinstance(obj, Buf):
        return obj
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return _from_torch(obj, name, writable)
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        if hasattr(obj, "__cuda_array_interface__"):
            raise ConfigError(f"{name} is device memory; this build moves CPU memory only")
        try:
            mv = memoryview(obj)
        except TypeError:
            raise ConfigError(
                f"{name} of type {type(obj).__name__} exposes no buffer; pass a numpy array, "
                "a torch tensor or a bytes-like object") from None
        fmt = mv.format.lstrip("@=<")
        if fmt not in _FORMATS:
            raise ConfigError(f"{name} has buffer format {mv.format!r}, which hetccl does not reduce")
        arr = np.asarray(mv).view(_NAMES[_FORMATS[fmt]]) if mv.ndim else np.asarray(mv).reshape(1)
    if not arr.dtype.isnative:
        raise ConfigError(f"{name} is byte-swapped ({arr.dtype.str}); pass x.astype(x.dtype.newbyteorder('='))")
    if arr.dtype.name not in _NUMPY_DTYPES:
        raise ConfigError(f"{name} has dtype {arr.dtype}; use one of {', '.join(_NUMPY_DTYPES)}")
    if not arr.flags.c_contiguous:
        raise ConfigError(f"{name} is not contiguous; pass np.ascontiguousarray(x) and copy back")
    if writable and not arr.flags.writeable:
        raise ConfigError(f"{name} is read-only but hetccl must write the result into it; pass a copy")
    flat = arr.reshape(-1)
    data = flat.view(np.uint8) if flat.size else np.empty(0, np.uint8)
    dt = _NUMPY_DTYPES[arr.dtype.name]
    if type(obj) is np.ndarray:
        _FAST[arr.dtype] = dt
    return Buf(data, dt, flat.size, obj)


def block_ranges(count: int, n: int) -> list[tuple[int, int]]:
    """Split `count` elements into n contiguous blocks whose sizes differ by at most one."""
    base, extra = divmod(count, n)
    out, start = [], 0
    for b in range(n):
        size = base + (1 if b < extra else 0)
        out.append((start, start + size))
        start += size
    return out
