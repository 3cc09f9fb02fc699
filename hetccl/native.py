"""Thin wrappers over the C library (native/hetccl_native.c, built by cffi at install as hetccl._native)."""

from __future__ import annotations

import numpy as np

from .dtypes import DType, ReduceOp
from .errors import HetcclError

try:
    from ._native import ffi, lib
except ImportError as _exc:  # pragma: no cover - only on a broken install
    raise HetcclError(
        f"hetccl's native extension is missing ({_exc}); reinstall with `pip install -e .` so that cffi "
        "builds it (needs a C compiler)") from None

_from_buffer = ffi.from_buffer
_c_reduce = lib.hccl_reduce
_c_reduce3 = lib.hccl_reduce3
_c_copy = lib.hccl_copy
_CHARS = "char[]"


def ptr(arr: np.ndarray | memoryview, require_writable: bool = False):
    return _from_buffer(_CHARS, arr, require_writable)


def reduce_into(dst: np.ndarray, src: np.ndarray | memoryview, dtype: DType, op: ReduceOp,
                count: int | None = None) -> None:
    """dst = dst OP src, elementwise (byte views; count elements)."""
    if count is None:
        count = len(dst) // dtype.itemsize
    if count == 0:
        return
    if _c_reduce(_from_buffer(_CHARS, dst, True), _from_buffer(_CHARS, src), count, dtype,
                 0 if op == ReduceOp.AVG else op):
        raise HetcclError(f"native reduce refused dtype {dtype!r} op {op!r}")


def reduce3(dst: np.ndarray, a: np.ndarray | memoryview, b: np.ndarray | memoryview, dtype: DType,
            op: ReduceOp, count: int) -> None:
    if count and _c_reduce3(_from_buffer(_CHARS, dst, True), _from_buffer(_CHARS, a), _from_buffer(_CHARS, b),
                            count, dtype, 0 if op == ReduceOp.AVG else op):
        raise HetcclError(f"native reduce refused dtype {dtype!r} op {op!r}")


def divide(dst: np.ndarray, dtype: DType, divisor: int) -> None:
    count = len(dst) // dtype.itemsize
    if count and lib.hccl_div(_from_buffer(_CHARS, dst, True), count, dtype, divisor):
        raise HetcclError(f"native divide refused dtype {dtype!r}")


def copy(dst: np.ndarray | memoryview, src: np.ndarray | memoryview) -> None:
    n = len(src) if isinstance(src, np.ndarray) else src.nbytes
    if n:
        _c_copy(_from_buffer(_CHARS, dst, True), _from_buffer(_CHARS, src), n)


def build_info() -> str:
    return ffi.string(lib.hccl_build_info()).decode()


def wire_size(count: int, wire: int) -> int:
    """Bytes of `count` elements packed in wire format `wire` (hetccl_native.h: HCCL_WIRE_*)."""
    return lib.hccl_wire_size(count, wire)


def pack(dst: np.ndarray, src: np.ndarray | memoryview, count: int, dtype: DType, wire: int) -> None:
    """dst (wire_size(count, wire) bytes) = count elements of src (a float dtype) in wire format `wire`."""
    if count and lib.hccl_pack(_from_buffer(_CHARS, dst, True), _from_buffer(_CHARS, src), count, dtype, wire):
        raise HetcclError(f"native pack refused dtype {dtype!r} wire {wire}")


def unpack(dst: np.ndarray, src: np.ndarray | memoryview, count: int, dtype: DType, wire: int,
           op: ReduceOp | None = None) -> None:
    """dst (count elements of dtype) = the packed values of src, or (op) dst OP them."""
    code = -1 if op is None else (0 if op == ReduceOp.AVG else int(op))
    if count and lib.hccl_unpack(_from_buffer(_CHARS, dst, True), _from_buffer(_CHARS, src), count, dtype, wire,
                                 code):
        raise HetcclError(f"native unpack refused dtype {dtype!r} wire {wire} op {op!r}")


def unpack_reduce_pack(dst: np.ndarray, srcs: list[np.ndarray], count: int, dtype: DType, wire: int,
                       op: ReduceOp, packed: np.ndarray) -> None:
    """In one pass: packed = the wire format of the reduction of the packed srcs, and dst = what it carries."""
    if not count:
        return
    held = [_from_buffer(_CHARS, s) for s in srcs]  # alive for the call
    if lib.hccl_unpack_reduce_pack(_from_buffer(_CHARS, dst, True), ffi.new("void *[]", held), len(held), count,
                                   dtype, wire, 0 if op == ReduceOp.AVG else int(op),
                                   _from_buffer(_CHARS, packed, True)):
        raise HetcclError(f"native unpack_reduce_pack refused dtype {dtype!r} wire {wire} op {op!r}")
