"""Device (GPU) memory registration through dma-buf (GPUDirect RDMA)."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import numpy as np

from ...errors import (
    TransportError,
)
from .loader import pyverbs

log = logging.getLogger("hetccl")


CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def cuda_dmabuf_fd(ptr: int, nbytes: int) -> tuple[int, int, int]:
    """A dma-buf file descriptor for the device allocation range holding [ptr, ptr+nbytes):
    (fd, offset of ptr inside it, length). TransportError saying why when the driver cannot export it."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransportError(f"GPUDirect RDMA needs the CUDA driver (libcuda.so.1): {exc}") from None
    fn = getattr(cuda, "cuMemGetHandleForAddressRange", None)
    if fn is None:
        raise TransportError("GPUDirect RDMA: this CUDA driver has no cuMemGetHandleForAddressRange (dma-buf "
                             "export needs CUDA 11.7+ and the open kernel module)")
    page = 1 << 16  # dma-buf export works on whole GPU pages
    base = ptr & ~(page - 1)
    length = -(-(ptr + nbytes - base) // page) * page
    fd = ctypes.c_int(-1)
    rc = fn(ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(length),
            ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), ctypes.c_ulonglong(0))
    if rc != 0 or fd.value < 0:
        raise TransportError(f"GPUDirect RDMA: cuMemGetHandleForAddressRange failed with CUresult {rc} (the "
                             "driver or the GPU does not support dma-buf export)")
    return fd.value, ptr - base, length


def device_range(buf: Any) -> tuple[int, int, str] | None:
    """(address, bytes, vendor) of device memory, None for host memory. Transports sit below hetccl's GPU layer,
    so device memory is told by its protocols alone: an object with ptr, nbytes and vendor (gpu.buffers.DeviceBuf),
    a torch GPU tensor, or __cuda_array_interface__ (CuPy, Numba). TransportError for unusable device memory."""
    if all(hasattr(buf, a) for a in ("ptr", "nbytes", "vendor")):
        return int(buf.ptr), int(buf.nbytes), str(buf.vendor)
    if type(buf).__module__.startswith("torch"):
        if buf.device.type == "cpu":
            return None
        if not buf.is_contiguous():
            raise TransportError("GPUDirect RDMA: the tensor is not contiguous")
        import torch

        return buf.data_ptr(), buf.numel() * buf.element_size(), "hip" if torch.version.hip else "cuda"
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if cai.get("strides") is not None:
        raise TransportError("GPUDirect RDMA: strided device arrays are not registered")
    return int(cai["data"][0]), int(np.prod(cai.get("shape", ()))) * np.dtype(cai["typestr"]).itemsize, "cuda"


def register_device_buffer(pd: Any, buf: Any) -> Any:
    """Register GPU memory for RDMA through dma-buf (`ibv_reg_dmabuf_mr`). TransportError when impossible."""
    found = device_range(buf)
    if found is None:
        raise TransportError("GPUDirect RDMA: the buffer is not device memory")
    ptr, nbytes, vendor = found
    if vendor != "cuda":
        raise TransportError(f"GPUDirect RDMA: dma-buf export of {vendor} memory is not implemented")
    fd, offset, length = cuda_dmabuf_fd(ptr, nbytes)
    try:
        pv = pyverbs()
        access = pv.enums.IBV_ACCESS_LOCAL_WRITE | pv.enums.IBV_ACCESS_REMOTE_WRITE
        return pv.mr.DmaBufMR(pd, length, access, dmabuf=fd, offset=0), offset
    except Exception as exc:
        raise TransportError(f"GPUDirect RDMA: ibv_reg_dmabuf_mr failed: {exc}") from None
    finally:
        os.close(fd)
