"""One rank of the GPU benchmark (launched by gpu_compare.py through `hetccl run`).

Backends: hetccl (islands from --islands, one label per rank), torch-nccl, torch-gloo (CUDA tensors). Method
(nccl-tests'): a barrier and a device synchronise, then k all_reduces back to back, then a device synchronise;
time of one = elapsed / k on the slowest rank; the median over --reps repetitions is reported; busbw = algbw *
2(n-1)/n; the first result of every size is checked."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from benchcommon import sizes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True, choices=["hetccl", "torch-nccl", "torch-gloo"])
    p.add_argument("--islands", default="")
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    if a.islands:
        os.environ["HETCCL_ISLAND"] = a.islands.split(",")[rank]
    rows = []
    if a.backend == "hetccl":
        import hetccl

        async def run() -> None:
            comm = await hetccl.init()
            for size in sizes(a.min_bytes, a.max_bytes, a.factor):
                rows.append(await measure_async(comm, size, a.iters, a.reps, world, rank))
            await comm.close()

        hetccl.run(run())
    else:
        import torch.distributed as dist

        dist.init_process_group("nccl" if a.backend == "torch-nccl" else "gloo")
        for size in sizes(a.min_bytes, a.max_bytes, a.factor):
            rows.append(measure_torch(dist, size, a.iters, a.reps, world, rank))
        dist.destroy_process_group()
    if rank == 0:
        with open(a.json, "w") as f:
            json.dump(rows, f)


def _iters(size: int, iters: int) -> int:
    return max(5, min(iters, int(2e9 // max(size, 1))))


async def measure_async(comm, size: int, iters: int, reps: int, n: int, rank: int) -> dict:
    count = size // 4
    x = torch.full((count,), float(rank + 1), device="cuda")
    await comm.all_reduce(x)
    wrong = int((x != n * (n + 1) / 2).sum())
    for _ in range(3):
        await comm.all_reduce(x)
    k = _iters(size, iters)
    times = np.zeros(reps)
    for i in range(reps):
        await comm.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            await comm.all_reduce(x)  # enqueued on the current stream (cross-island: complete on return)
        torch.cuda.synchronize()
        times[i] = (time.perf_counter() - t) / k
    await comm.synchronize()
    from hetccl.dtypes import ReduceOp, as_buf

    await comm.flat_all_reduce(as_buf(times), ReduceOp.MAX)  # host memory, flat whatever the islands
    return row(size, n, times, wrong)


def measure_torch(dist, size: int, iters: int, reps: int, n: int, rank: int) -> dict:
    count = size // 4
    x = torch.full((count,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    wrong = int((x != n * (n + 1) / 2).sum())
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    k = _iters(size, iters)
    times = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        times[i] = (time.perf_counter() - t) / k
    times = times.cuda() if dist.get_backend() == "nccl" else times
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return row(size, n, times.cpu().numpy(), wrong)


def row(size: int, n: int, times, wrong: int) -> dict:
    t = statistics.median(list(times))
    algbw = size / t / 1e9
    return {"size": size, "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n, "wrong": wrong}


if __name__ == "__main__":
    main()
