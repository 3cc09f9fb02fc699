"""The floor of a small collective's time on one GPU time-sliced by several processes (issue 31's one-GPU rows).

Each process runs, on its own stream, a burst of tiny device work and a synchronize, 2000 times: a 4 KiB copy
to pinned host memory and back, or one small kernel. Alone, that costs the copies' latency; with a second
process doing the same at once, every burst waits for the GPU to switch contexts. A small collective between
two ranks of one GPU needs at least one such burst per rank per operation (its copy to the host, or its
kernel), so no backend's 4 KiB all_reduce on one shared GPU goes below the two-process figure.

    python benchmarks/gpu_share_floor.py [--procs 1,2] [--iters 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any


def _burst(kind: str, iters: int, results: Any, start: Any) -> None:
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    dev = torch.ones(1024, device="cuda")
    host = torch.empty(1024, pin_memory=True)

    def once() -> None:
        with torch.cuda.stream(stream):
            if kind == "copies":
                host.copy_(dev, non_blocking=True)
                dev.copy_(host, non_blocking=True)
            else:
                dev.add_(1)
        stream.synchronize()

    for _ in range(100):
        once()
    start.wait(timeout=120)
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    results.put((time.perf_counter() - t0) / iters * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,2", help="comma list of process counts")
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for kind in ("copies", "kernel"):
        for n in (int(x) for x in a.procs.split(",")):
            results, start = ctx.Queue(), ctx.Barrier(n)
            procs = [ctx.Process(target=_burst, args=(kind, a.iters, results, start)) for _ in range(n)]
            for p in procs:
                p.start()
            times = [results.get(timeout=300) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            print(f"{kind} + synchronize, {n} process(es): "
                  + " ".join(f"{x:.1f}" for x in times) + " us per burst", flush=True)


if __name__ == "__main__":
    main()
