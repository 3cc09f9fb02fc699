"""DDP communication hooks for `DistributedDataParallel.register_comm_hook`.

    from hetccl.torch import hooks
    ddp.register_comm_hook(None, hooks.allreduce_hook)        # state: a process group, or None for WORLD
    ddp.register_comm_hook(None, hooks.bf16_compress_hook)    # or hooks.fp16_compress_hook
    ddp.register_comm_hook(hooks.ErrorFeedback(), hooks.error_feedback_hook)  # with HETCCL_CROSS_COMPRESS

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


class ErrorFeedback:
    """The state of `error_feedback_hook`: the process group (None: WORLD) and each bucket's residual."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.residuals: dict = {}


def error_feedback_hook(state: ErrorFeedback, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as allreduce_hook does, with error feedback for HETCCL_CROSS_COMPRESS: only the
    bytes between islands are compressed (inside islands, and in every sum, the gradients stay fp32), and this
    hook keeps what compression took from this rank's values (the bucket minus what crossed,
    `Communicator.first_hop`) and adds it to the bucket's next step, so that the error does not accumulate. A
    value that is not finite (a step that overflowed) leaves no residual.
    Exact for islands of one rank each (a rank's values are what its leader sends); elsewhere, on other
    backends and where nothing is compressed, it is allreduce_hook."""
    group = _group(state.group)
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    comm = getattr(group._get_backend(buf.device), "comm", None)
    if comm is not None and buf.dtype == torch.float32 and buf.is_contiguous():
        key = bucket.index()
        kept = state.residuals.get(key)
        if kept is not None and kept.shape == buf.shape:  # DDP may rebuild its buckets after the first step
            buf.add_(kept)
        # on the GPU the device packs and unpacks what would cross, on the current stream (gpu/codec.py)
        sent = comm.async_comm.first_hop(buf if buf.is_cuda else buf.numpy())
        if sent is not None:
            # an overflowed step (inf or NaN in the bucket: one GradScaler skips) leaves no residual there: kept,
            # it would make every later step's bucket NaN
            residual = buf - (sent if buf.is_cuda else torch.from_numpy(sent))
            state.residuals[key] = residual.nan_to_num_(0.0, 0.0, 0.0)
        else:
            state.residuals.pop(key, None)
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "ErrorFeedback", "error_feedback_hook"]
