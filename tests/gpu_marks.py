"""What the GPU tests share: how many CUDA GPUs this machine has, the skip marks that say so, and the NCCL
settings every device run keeps (no NVLink SHARP / multicast on the lent machines)."""

from __future__ import annotations

import pytest


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


NGPU = _gpus()
needs_1 = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU; runs on the GPU machine")
needs_2 = pytest.mark.skipif(NGPU < 2, reason=f"needs 2 CUDA GPUs (found {NGPU}); runs on the GPU machine")
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
