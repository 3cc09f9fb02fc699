"""What the calls an ordered collective makes cost its caller's thread, on this GPU: torch's stream contexts and
allocator, driver copies and stream memory operations through cffi (hetccl's wrappers and the bare functions),
events, a kernel launch, waking an asyncio loop. Medians of 300 calls, one process.

    python benchmarks/launch_costs.py                    # alone on the GPU
    python benchmarks/launch_costs.py --beside matmul    # while a second process keeps the GPU busy with matmuls

`--beside matmul` is the machine two islands share in the GPU tests and benchmarks (each rank its own process
on the one GPU): compare the two to see how much of a collective's hold is the sharing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def _matmuls(seconds: float, ready: Any) -> None:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ready.set()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            torch.mm(a, a, out=c)
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beside", choices=("nothing", "matmul"), default="nothing")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()

    import hetccl.torch  # noqa: F401 (eager module loading before CUDA starts, as the backend needs)
    import torch
    from hetccl.bindings.streamops import load_streamops
    from hetccl.gpu import runtime, streamorder

    neighbour = None
    if args.beside == "matmul":
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        neighbour = ctx.Process(target=_matmuls, args=(120.0, ready), daemon=True)
        neighbour.start()
        ready.wait(60)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ops = load_streamops("cuda")
    s = torch.cuda.Stream(dev)
    hs = s.cuda_stream
    words = streamorder.words_for(0)
    pin = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(16 << 20, dtype=torch.uint8, device=dev)
    a, b, o = (torch.ones(1 << 20, device=dev) for _ in range(3))
    w = words.take(1)[0]
    words.store(w)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cs, pd, sd, wd = ops.ffi.cast("CUstream", hs), pin.data_ptr(), src.data_ptr(), words.address(w)
    ev = runtime.record_event(hs, 0)

    async def nop() -> int:
        return 1

    def device_context() -> None:
        with torch.cuda.device(0):
            pass

    def stream_context() -> None:
        with torch.cuda.stream(s):
            pass

    def on_stream() -> None:
        with runtime.on_stream(s):
            pass

    def batch(n: int) -> Callable[[], None]:
        def run() -> None:
            bt = ops.batch()
            for _ in range(n):
                bt.copy(pd, sd, 4096, hs)
                bt.write(hs, wd, w[1])
            bt.flush()
        return run

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("torch.cuda.device(0) enter + exit", device_context),
        ("torch.cuda.stream(s) enter + exit", stream_context),
        ("runtime.on_stream(s) enter + exit", on_stream),
        ("torch.cuda.current_stream(0)", lambda: torch.cuda.current_stream(0)),
        ("torch.empty, 1M floats", lambda: torch.empty(1 << 20, device=dev)),
        ("a tensor slice t[lo:hi]", lambda: a[100:5000]),
        ("t.record_stream(s)", lambda: a.record_stream(s)),
        ("StreamOps.copy, D2H 4 MiB to pinned", lambda: ops.copy(pd, sd, 4 << 20, hs)),
        ("StreamOps.copy, H2D 4 MiB from pinned", lambda: ops.copy(sd, pd, 4 << 20, hs)),
        ("cuMemcpyAsync on the cffi lib, D2H 4 MiB", lambda: ops.lib.cuMemcpyAsync(pd, sd, 4 << 20, cs)),
        ("Words.signal (stream write of a word)", lambda: words.signal(hs, w)),
        ("Words.hold (stream wait, word reached)", lambda: words.hold(hs, w)),
        ("a StreamBatch of 2 (copy + write), flushed", batch(1)),
        ("a StreamBatch of 32 (16 copies + 16 writes), flushed", batch(16)),
        ("runtime.record_event (a pooled driver event)", lambda: runtime.record_event(hs, 0)),
        ("runtime.stream_waits (driver)", lambda: runtime.stream_waits(hs, 0, ev)),
        ("torch.add(a, b, out=o), 1M floats", lambda: torch.add(a, b, out=o)),
        ("asyncio.run_coroutine_threadsafe", lambda: asyncio.run_coroutine_threadsafe(nop(), loop)),
        ("asyncio.run_coroutine_threadsafe + result()", lambda: asyncio.run_coroutine_threadsafe(nop(), loop).result()),
    ]
    print(f"# {torch.cuda.get_device_name(0)}, beside {args.beside}, median / p90 of {args.calls} calls, us")
    for name, fn in cases:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        times = []
        for i in range(args.calls):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
            if i % 50 == 49:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        times.sort()
        print(f"| {name} | {statistics.median(times) / 1e3:.2f} | {times[int(0.9 * len(times))] / 1e3:.2f} |")
    if neighbour is not None:
        neighbour.terminate()
        neighbour.join(10)


if __name__ == "__main__":
    main()
