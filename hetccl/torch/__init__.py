"""PyTorch integration: `import hetccl.torch` registers the "hetccl" torch.distributed backend.

    import hetccl.torch
    import torch.distributed as dist
    dist.init_process_group("hetccl")   # under `hetccl run` or torchrun
"""

from __future__ import annotations

from .backend import BACKEND_NAME, HetcclBackend, UnsupportedError, register

register()

__all__ = ["BACKEND_NAME", "HetcclBackend", "UnsupportedError", "register"]
