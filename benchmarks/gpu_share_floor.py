"""The floor of a small collective's time on one GPU time-sliced by several processes (issue 31's one-GPU rows).

Each process runs, on its own stream, a burst of tiny device work and a synchronize, 2000 times: a 4 KiB copy
to pinned host memory and back, or one small kernel. Alone, that costs the copies' latency; with a second
process doing the same at once, every burst waits for the GPU to switch contexts. A small collective between
two ranks of one GPU needs at least one such burst per rank per operation (its copy to the host, or its
kernel), so no backend's 4 KiB all_reduce on one shared GPU goes below the two-process figure.

`--neighbours` times one process's kernel bursts beside a second process that does something else: `idle`
(nothing), `held` (its stream waits on a host word, which its host thread stores every millisecond: what a
stream-ordered collective's copy back waits on), `copies`, `kernel`. `handshake` is the round trip of such a
word: the stream stores word a, a host thread sees it and stores word b, the stream waits for b (1 and 2
processes).

    python benchmarks/gpu_share_floor.py [--procs 1,2] [--iters 2000] [--neighbours idle,held,copies,kernel]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any


class _Words:
    """Two 32-bit words of host memory mapped for the GPU, as hetccl's stream order uses them."""

    def __init__(self) -> None:
        import numpy as np
        import torch
        from hetccl.bindings.streamops import load_streamops

        self.ops = load_streamops("cuda")
        self.host_t = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        self.host = self.host_t.numpy().view(np.uint32)
        self.dev = self.ops.device_pointer(self.host_t.data_ptr())


def _burst(kind: str, iters: int, results: Any, start: Any, stop: Any = None) -> None:
    import threading

    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    dev = torch.ones(1024, device="cuda")
    host = torch.empty(1024, pin_memory=True)
    words = _Words() if kind in ("held", "handshake") else None
    gen = [0]

    def answer(until: float, pause: float) -> None:  # the host side: word a seen -> store word b
        assert words is not None
        while time.perf_counter() < until:
            if pause:
                time.sleep(pause)
                words.host[1] = gen[0]
            elif words.host[0] == gen[0]:
                words.host[1] = gen[0]

    def once() -> None:
        with torch.cuda.stream(stream):
            if kind == "copies":
                host.copy_(dev, non_blocking=True)
                dev.copy_(host, non_blocking=True)
            elif kind in ("held", "handshake"):
                assert words is not None
                gen[0] += 1
                s = stream.cuda_stream
                words.ops.write(s, words.dev, gen[0])
                words.ops.wait_geq(s, words.dev + 4, gen[0])
            elif kind == "idle":
                time.sleep(0.001)
                return
            else:
                dev.add_(1)
        stream.synchronize()

    if words is not None:
        pause = 0.001 if kind == "held" else 0.0
        threading.Thread(target=answer, args=(time.perf_counter() + 3600, pause), daemon=True).start()
    for _ in range(100):
        once()
    start.wait(timeout=120)
    t0 = time.perf_counter()
    n = 0
    while (stop is None and n < iters) or (stop is not None and not stop.is_set()):
        once()
        n += 1
    if stop is None:
        results.put((time.perf_counter() - t0) / iters * 1e6)


def _neighbours(names: list[str], iters: int) -> None:
    ctx = mp.get_context("spawn")
    for name in names:
        results, start, stop = ctx.Queue(), ctx.Barrier(2), ctx.Event()
        timed = ctx.Process(target=_burst, args=("kernel", iters, results, start))
        other = ctx.Process(target=_burst, args=(name, iters, results, start, stop))
        timed.start()
        other.start()
        t = results.get(timeout=300)
        stop.set()
        for p in (timed, other):
            p.join(timeout=60)
        print(f"kernel + synchronize beside a process doing {name}: {t:.1f} us per burst", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,2", help="comma list of process counts")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--neighbours", default="", help="comma list of idle,held,copies,kernel")
    a = ap.parse_args()
    if a.neighbours:
        _neighbours(a.neighbours.split(","), a.iters)
        return
    ctx = mp.get_context("spawn")
    for kind in ("copies", "kernel", "handshake"):
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
