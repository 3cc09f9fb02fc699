"""Per-op cost of a small host all_reduce through the async API and through the blocking facade (init_sync), side
by side in one job, interleaved (issue 31): run it under hetccl's launcher,

    hetccl run -n 2 python benchmarks/small_ops.py [--bytes 4096] [--iters 2000] [--reps 5]
    TEST_ISLANDS=cpu-0,cpu-1 hetccl run -n 2 python benchmarks/small_ops.py     # each rank its own CPU island
    hetccl run -n 2 python benchmarks/small_ops.py --op broadcast|all_gather|barrier

Rank 0 prints, per API, the median over repetitions of the mean time per operation (us), and the facade's
overhead over the async API. Through torch.distributed on CPU tensors (one backend per job; interleave jobs):

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/small_ops.py --torch hetccl
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/small_ops.py --torch gloo

CUDA tensors (`--device cuda`: rank i on GPU i % count; timed back to back, one device synchronize after each
repetition's loop, and waited for one by one, a synchronize after each, as a loss read with `.item()`):
`TEST_ISLANDS=nvidia-0,nvidia-1` makes each rank its own island (indexed by rank, as the tests do), with
`HETCCL_HOST=h0,h1` each its own host; `BENCH_NCCL_HOSTID=1` gives NCCL's ranks their own `NCCL_HOSTID` (two
hosts over its sockets, so two ranks may share a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import hetccl
import numpy as np


def _calls(comm: Any, buf: np.ndarray, op: str) -> Callable[[], Any]:
    """One small `op` on `comm` (a Communicator: a coroutine; a SyncCommunicator: done)."""
    if op == "broadcast":
        return lambda: comm.broadcast(buf, 0)
    if op == "all_gather":
        out = np.empty(buf.size * comm.size, buf.dtype)
        return lambda: comm.all_gather(out, buf)
    if op == "barrier":
        return comm.barrier
    return lambda: comm.all_reduce(buf)


async def _async_loop(comm: hetccl.Communicator, buf: np.ndarray, iters: int, op: str) -> float:
    call = _calls(comm, buf, op)
    t0 = time.perf_counter()
    for _ in range(iters):
        await call()
    return (time.perf_counter() - t0) / iters * 1e6


def torch_job(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("TEST_ISLANDS"):
        os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[rank]
    if os.environ.get("BENCH_NCCL_HOSTID"):
        os.environ["NCCL_HOSTID"] = f"h{os.environ.get('LOCAL_RANK', '0')}"
    if a.torch == "hetccl":
        import hetccl.torch  # noqa: F401  (registers the backend)
    sync = lambda: None  # noqa: E731
    if a.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        sync = torch.cuda.synchronize
        dist.init_process_group(a.torch, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group(a.torch)
    t = torch.ones(a.bytes // 4, device=dev)
    for _ in range(200):
        dist.all_reduce(t)
    sync()
    # back to back (one synchronize per loop), and on a GPU also each op waited for (a loss read with .item())
    kinds = {"back to back": a.iters} | ({"waited each": max(1, a.iters // 4)} if a.device == "cuda" else {})
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(a.reps):
        for kind, iters in kinds.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
                if kind == "waited each":
                    sync()
            sync()
            times[kind].append((time.perf_counter() - t0) / iters * 1e6)
    if dist.get_rank() == 0:
        for kind, v in times.items():
            print(f"torch {a.torch} ({a.device}, {kind}): median {statistics.median(v):.1f} us/op "
                  f"({' '.join(f'{x:.1f}' for x in v)}; {a.bytes} B, {dist.get_world_size()} ranks)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch", default="", help="through torch.distributed with this backend (under torchrun)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the tensor's device (--torch)")
    ap.add_argument("--op", choices=("all_reduce", "broadcast", "all_gather", "barrier"), default="all_reduce",
                    help="the collective (without --torch)")
    a = ap.parse_args()
    if a.torch:
        return torch_job(a)
    if os.environ.get("TEST_ISLANDS"):  # each rank its island, by rank: TEST_ISLANDS=cpu-0,cpu-1
        os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[int(os.environ["HETCCL_RANK"])]
    comm = hetccl.init_sync()
    buf = np.ones(a.bytes // 4, np.float32)
    times: dict[str, list[float]] = {"async API": [], "facade": []}
    call = _calls(comm, buf, a.op)
    for _ in range(200):
        call()
    for _ in range(a.reps):
        comm.barrier()
        times["async API"].append(comm.submit(_async_loop(comm.async_comm, buf, a.iters, a.op)).result(300))
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            call()
        times["facade"].append((time.perf_counter() - t0) / a.iters * 1e6)
    if comm.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"{k:>10}: median {med[k]:.1f} us/op ({' '.join(f'{x:.1f}' for x in v)})", flush=True)
        print(f"facade overhead over the async API: {med['facade'] - med['async API']:+.1f} us "
              f"({a.op}, {a.bytes} B, {comm.size} ranks)", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
