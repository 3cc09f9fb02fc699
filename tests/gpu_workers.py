"""Rank functions for GPU tests: device buffers (torch CUDA tensors, CuPy arrays) checked against numpy."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from workers import check, expected_reduce, make, np_dtype

import hetccl

GPU_DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def on_gpu(comm: hetccl.Communicator) -> bool:
    return os.environ.get("HETCCL_ISLAND", "nvidia").split("-")[0] != "cpu"


def to_dev(arr: np.ndarray, dtype: str, gpu: bool):
    """The rank's buffer: a CUDA tensor on GPU ranks, the numpy array itself on CPU ranks."""
    if not gpu:
        return arr.copy()
    import torch

    host = torch.from_numpy(arr.astype(np.float64) if dtype == "bfloat16" else arr.copy())
    return host.to(_torch_dtype(dtype)).cuda()


def to_np(buf, dtype: str) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    import torch

    t = buf.cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(np_dtype("bfloat16"))
    return t.numpy()


async def gpu_matrix(comm: hetccl.Communicator, counts: list[int], dtypes: list[str] | None = None,
                     ops: list[str] | None = None) -> None:
    import torch

    n, r = comm.size, comm.rank
    gpu = on_gpu(comm)
    if gpu:
        torch.cuda.set_device(int(os.environ.get("HETCCL_LOCAL_RANK", r)) % torch.cuda.device_count())
    for dtype in dtypes or GPU_DTYPES:
        for count in counts:
            for op in ops or ["sum", "prod", "min", "max", "avg"]:
                buf = to_dev(make(r, count, dtype), dtype, gpu)
                await comm.all_reduce(buf, op=op)
                check(to_np(buf, dtype), expected_reduce(n, count, dtype, op),
                      f"rank {r}/{n} gpu={gpu} all_reduce {dtype} {op} count={count}")
            inp = to_dev(make(r, n * count, dtype, salt=1), dtype, gpu)
            out = to_dev(np.zeros(count, np_dtype(dtype)), dtype, gpu)
            await comm.reduce_scatter(out, inp, op="sum")
            check(to_np(out, dtype), expected_reduce(n, n * count, dtype, "sum", salt=1)[r * count:(r + 1) * count],
                  f"rank {r} gpu reduce_scatter {dtype} count={count}")
            inp = to_dev(make(r, count, dtype), dtype, gpu)
            out = to_dev(np.zeros(n * count, np_dtype(dtype)), dtype, gpu)
            await comm.all_gather(out, inp)
            check(to_np(out, dtype), np.concatenate([make(p, count, dtype) for p in range(n)]),
                  f"rank {r} gpu all_gather {dtype} count={count}")
            root = count % n
            buf = to_dev(make(r, count, dtype, salt=2), dtype, gpu)
            await comm.broadcast(buf, root=root)
            check(to_np(buf, dtype), make(root, count, dtype, salt=2), f"rank {r} gpu broadcast {dtype} {count}")
            buf = to_dev(make(r, count, dtype, salt=6), dtype, gpu)
            await comm.reduce(buf, root=root, op="max")
            if r == root:
                check(to_np(buf, dtype), expected_reduce(n, count, dtype, "max", salt=6),
                      f"rank {r} gpu reduce {dtype} {count}")
            inp = to_dev(make(r, n * count, dtype, salt=3), dtype, gpu)
            out = to_dev(np.zeros(n * count, np_dtype(dtype)), dtype, gpu)
            await comm.all_to_all(out, inp)
            want = np.concatenate([make(p, n * count, dtype, salt=3)[r * count:(r + 1) * count] for p in range(n)])
            check(to_np(out, dtype), want, f"rank {r} gpu all_to_all {dtype} {count}")
    if gpu:
        # stream semantics: the collective follows work queued on the current stream, later work sees it
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.full((1 << 20,), 1.0, device="cuda")
            x.mul_(float(r + 1))  # queued before the collective on s
            await comm.all_reduce(x)
            y = x * 2  # queued after: must see the sum
        s.synchronize()
        assert float(y[0]) == 2 * n * (n + 1) / 2, float(y[0])
    else:  # CPU ranks join the same collectives with host memory
        x = np.full(1 << 20, float(r + 1), np.float32)
        await comm.all_reduce(x)
        assert x[0] == n * (n + 1) / 2, x[0]
    c = np.full(1000, r + 1, dtype=np.float32)
    if gpu:
        try:
            import cupy

            c = cupy.asarray(c)  # CuPy arrays travel through __cuda_array_interface__ / DLPack
        except ImportError:
            c = to_dev(c, "float32", True)
    await comm.all_reduce(c)
    assert float(c[0]) == n * (n + 1) / 2, c[0]
    if gpu:  # an exporter that speaks DLPack only (no __cuda_array_interface__, not a torch or CuPy type)
        d = torch.full((777,), float(r + 1), device="cuda")
        await comm.all_reduce(_DLPackOnly(d))
        assert float(d[776]) == n * (n + 1) / 2, float(d[776])
    else:
        await comm.all_reduce(np.full(777, float(r + 1), np.float32))
    await comm.barrier()


class _DLPackOnly:
    def __init__(self, t: Any):
        self.t = t

    def __dlpack__(self, **kw: Any) -> Any:
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self.t.__dlpack_device__()


def _use_local_gpu(comm: hetccl.Communicator) -> None:
    import torch

    torch.cuda.set_device(int(os.environ.get("HETCCL_LOCAL_RANK", comm.rank)) % torch.cuda.device_count())


async def gpu_die_midway(comm: hetccl.Communicator, victim: int) -> None:
    """The victim exits hard between device all_reduces: the survivor raises PeerLostError naming it within
    10 s, from the collective or from synchronize() (device collectives return once enqueued)."""
    import time

    import torch

    _use_local_gpu(comm)
    x = torch.ones(16 << 20, device="cuda")
    await comm.all_reduce(x)
    await comm.synchronize()
    if comm.rank == victim:
        os._exit(17)
    t0 = time.monotonic()
    try:
        for _ in range(200):
            await comm.all_reduce(x)
        await comm.synchronize()
    except hetccl.PeerLostError as exc:
        took = time.monotonic() - t0
        os.write(1, f"rank {comm.rank}: PeerLostError rank={exc.rank} after {took:.1f} s: {exc}\n".encode())
        os._exit(0 if exc.rank in (victim, -1) and took < 10 else 3)
    except hetccl.HetcclError as exc:
        os.write(1, f"rank {comm.rank}: other error {exc!r}\n".encode())
        os._exit(4)
    os._exit(5)


async def gpu_stuck_peer(comm: hetccl.Communicator) -> None:
    """Rank 1 skips the second all_reduce: rank 0's call returns (enqueued), and the watchdog ends it at the
    deadline: synchronize() raises CollectiveTimeout, later calls raise too, and the stream is released."""
    import time

    import torch

    _use_local_gpu(comm)
    x = torch.ones(1 << 20, device="cuda")
    await comm.all_reduce(x)
    await comm.synchronize()
    if comm.rank == 1:
        time.sleep(float(os.environ["HETCCL_TIMEOUT"]) + 6)
        os._exit(0)
    t0 = time.monotonic()
    await comm.all_reduce(x)  # returns at once: enqueued
    try:
        await comm.synchronize()
    except hetccl.CollectiveTimeout as exc:
        took = time.monotonic() - t0
        assert took < float(os.environ["HETCCL_TIMEOUT"]) + 3, took
        torch.cuda.current_stream().synchronize()  # the aborted communicator released the stream
        try:
            await comm.all_reduce(x)
        except hetccl.HetcclError:
            os.write(1, f"rank 0: watchdog timeout after {took:.1f} s: {exc}\n".encode())
            os._exit(0)
        os._exit(6)
    os._exit(5)
