"""DDP communication hooks for `DistributedDataParallel.register_comm_hook`.

    from hetccl.torch import hooks
    ddp.register_comm_hook(None, hooks.allreduce_hook)        # state: a process group, or None for WORLD
    ddp.register_comm_hook(None, hooks.bf16_compress_hook)    # or hooks.fp16_compress_hook

Each hook launches an asynchronous all-reduce (a Work whose future the event loop completes) and returns at
once, so the reducer keeps running backward while the bucket is on the wire, like torch's built-in hooks.

No `from __future__ import annotations` here: DDP checks the hooks' annotations against the real objects.
"""

from typing import Any

import torch
import torch.distributed as dist


def _group(state: Any) -> Any:
    return state if state is not None else dist.group.WORLD


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across the group (what DDP does without a hook)."""
    group = _group(state)
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype) -> Any:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = _group(state)
        buf = bucket.buffer()
        compressed = buf.to(dtype).div_(dist.get_world_size(group))
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buf.copy_(fut.value()[0])
            return buf

        return work.get_future().then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = f"All-reduce the bucket in {dtype} (half the bytes), then cast back into the bucket."
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
