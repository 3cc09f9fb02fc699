"""Device-buffer recognition and adaptation, on any machine: objects exporting __cuda_array_interface__ or
__dlpack_device__ are described without touching device memory."""

from __future__ import annotations

import numpy as np
import pytest

from hetccl import ConfigError, DType
from hetccl.gpu.buffers import as_device_buf, is_device
from hetccl.gpu.dispatch import vendor_of


class CAI:
    def __init__(self, shape, typestr="<f4", strides=None, readonly=False, stream=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0x7F0000001000, readonly),
                                         "version": 3, "strides": strides, "stream": stream}


class DL:
    def __init__(self, kind: int):
        self.kind = kind

    def __dlpack_device__(self):
        return (self.kind, 0)


def test_host_memory_is_not_device() -> None:
    assert not is_device(np.ones(3))
    assert not is_device(bytearray(8))
    assert not is_device(DL(1))  # kDLCPU
    torch = pytest.importorskip("torch")
    assert not is_device(torch.ones(3))


def test_gpu_exporters_are_device() -> None:
    assert is_device(CAI((4,)))
    assert is_device(DL(2)) and is_device(DL(10)) and is_device(DL(13))  # CUDA, ROCm, CUDA managed


@pytest.mark.parametrize("typestr,dtype", [("<f4", DType.FLOAT32), ("<f2", DType.FLOAT16), ("<i8", DType.INT64),
                                           ("|u1", DType.UINT8), ("<V2", DType.BFLOAT16)])
def test_cuda_array_interface_adapted(typestr: str, dtype: DType) -> None:
    buf = as_device_buf(CAI((3, 5), typestr, stream=1))
    assert buf.dtype == dtype and buf.count == 15 and buf.ptr == 0x7F0000001000
    assert buf.stream == 0  # 1 = the legacy default stream
    assert buf.nbytes == 15 * dtype.itemsize


def test_cuda_array_interface_errors() -> None:
    with pytest.raises(ConfigError, match="not contiguous"):
        as_device_buf(CAI((3, 5), strides=(4, 12)))
    with pytest.raises(ConfigError, match="read-only"):
        as_device_buf(CAI((3,), readonly=True))
    with pytest.raises(ConfigError, match="does not reduce"):
        as_device_buf(CAI((3,), typestr="<c8"))
    as_device_buf(CAI((3, 5), strides=(20, 4)))  # explicit C-contiguous strides are fine


def test_island_vendor_labels() -> None:
    assert vendor_of("nvidia") == "nvidia" and vendor_of("nvidia-a") == "nvidia" and vendor_of("amd:b") == "amd"
    assert vendor_of("cpu") is None and vendor_of("cpu-a") is None and vendor_of("gaudi") is None
