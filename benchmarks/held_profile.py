"""Where the caller's thread spends a cross-island collective of CUDA tensors: the held time per op (issued
behind queued compute, `async_op=False`), and a cProfile of rank 0's calls (the caller's thread only).

    torchrun --standalone --nproc-per-node 2 benchmarks/held_profile.py [--ops all_reduce,all_gather] [--reps 40]
             [--mib 16] [--compute-ms 20] [--top 30]

Per-rank islands come from TEST_ISLANDS ("nvidia-0,nvidia-1"); HETCCL_HOST and HETCCL_TORCH_STREAM_ORDER pick
the path as in benchmarks/fsdp_step.py's variants. Needs a GPU. cProfile slows Python calls, so the held times
are printed for a pass without the profiler first, then the profile of a second pass.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

if os.environ.get("TEST_ISLANDS"):
    os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[int(os.environ["RANK"])]

import hetccl.torch  # noqa: E402,F401  (registers the backend)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="all_reduce,broadcast,reduce_scatter,all_gather")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--mib", type=float, default=16)
    p.add_argument("--compute-ms", type=float, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--backend", default="hetccl")
    a = p.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group(a.backend)
    r, n = dist.get_rank(), dist.get_world_size()
    m = torch.randn(2048, 2048, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(m, m)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) * 1000 / 20
    count = int(a.mib * (1 << 20)) // 4
    x = torch.ones(count, device=dev)
    big = torch.ones(n * count, device=dev)
    calls = {"all_reduce": lambda: dist.all_reduce(x), "broadcast": lambda: dist.broadcast(x, src=0),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(x, big),
             "all_gather": lambda: dist.all_gather_into_tensor(big, x)}

    def rounds(op: str, reps: int, prof: cProfile.Profile | None) -> list[float]:
        held = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            for _ in range(max(1, int(a.compute_ms / per))):
                torch.mm(m, m)
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            calls[op]()
            held.append((time.perf_counter() - t0) * 1000)
            if prof is not None:
                prof.disable()
        torch.cuda.synchronize()
        return held

    for op in a.ops.split(","):
        rounds(op, 3, None)  # warm-up
        held = rounds(op, a.reps, None)
        prof = cProfile.Profile() if r == 0 else None
        rounds(op, a.reps, prof)
        print(f"rank {r} {op}: held median {statistics.median(held):.3f} ms, min {min(held):.3f}, "
              f"max {max(held):.3f} (n={len(held)})", flush=True)
        if prof is not None:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(a.top)
            print(f"---- rank 0 {op}: profile, by own time ({a.reps} calls)\n" + s.getvalue()[-12000:], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
