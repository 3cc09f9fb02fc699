"""Where the caller's thread goes in a blocking cross-island collective: fp32 all_reduce, reduce_scatter,
all_gather and broadcast (16 MiB, or --sizes), each behind ~8 ms of matmuls queued on the current stream, two
GPU islands on one GPU.

    HETCCL_HOST=h0,h1 torchrun --standalone --nproc-per-node 2 benchmarks/held_probe.py      # the GPU machine
    HETCCL_HOST=h0,h1 torchrun ... benchmarks/held_probe.py --modes "as is" --sizes 16,64,200   # held by size

Per op and size (MiB: the buffer of all_reduce and broadcast, reduce_scatter's input, all_gather's output),
rank 0 prints the median time the blocking call keeps the thread (12 calls) in four modes (--modes): as is;
after a 3 ms pause (leftover work of hetccl's loop thread would finish in it); with a 0.1 ms GIL switch interval
(a thread holding the GIL would give it up sooner); under cProfile. It also prints the mean time per call spent
in the backend's steps (timed by wrappers: `_launch_ordered`, of it `enqueue_ordered` (checks and planning) and
`_Island.enqueue` (the device side), the Work's constructor and wait; with --fine, their steps down to the
driver calls) and cProfile's cumulative listing of the hetccl, torch.cuda and torch.distributed functions.
Without HETCCL_HOST the islands meet over the zero-copy link.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import hetccl.torch  # noqa: F401 (registers the backend; eager module loading before CUDA starts)
import torch
import torch.distributed as dist
from hetccl import communicator, hierarchical
from hetccl.torch import backend

RANK = int(os.environ.get("RANK", "0"))

SPENT: dict[str, float] = collections.defaultdict(float)
CALLS, MATMULS = 12, 25
MODES = ("as is", "3 ms pause", "switch 0.1 ms", "cProfile")


MAIN = threading.get_ident()


def timed(owner: Any, name: str, label: str | None = None) -> None:
    """Time owner.name on the caller's thread (not on hetccl's loop) under `label`."""
    fn = getattr(owner, name)
    label = label or name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != MAIN:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def fine_targets() -> list[tuple[Any, str]]:
    """--fine: the ordered launch's steps down to the driver calls and torch's contexts (each wrapper adds about
    a microsecond to the held time)."""
    from hetccl.bindings import streamops
    from hetccl.gpu import streamorder

    return [(backend.HetcclBackend, "_collective_stream"), (backend._Kinds, "enter"), (backend, "record_event"),
            (backend, "stream_waits"), (backend, "_cuda_devices"), (backend, "_Staged"),
            (communicator.Communicator, "enqueue_ordered"), (communicator.Communicator, "_device_call"),
            (hierarchical._Island, "__init__"), (hierarchical._Island, "scratch"),
            (hierarchical._SpanReduction, "__init__"), (hierarchical._SpanReduction, "landed"),
            (hierarchical, "_plan_leaders_all_reduce_on_device"), (hierarchical, "_plan_leaders_all_gather_in_pieces"),
            (hierarchical, "_plan_leaders_reduce_scatter_in_pieces"), (hierarchical, "reduce_into"),
            (streamorder.Stage, "__init__"), (streamorder.Stage, "to_host"), (streamorder.Stage, "from_host"),
            (streamorder.Stage, "seal"), (streamorder.Words, "pinned"), (streamorder.Words, "take"),
            (streamops.StreamOps, "run_batch"), (streamops.StreamOps, "record"), (streamops.StreamOps, "wait_event"),
            (torch.Tensor, "record_stream"), (torch.cuda.StreamContext, "__enter__")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--sizes", default="16", help="comma list of sizes in MiB")
    ap.add_argument("--fine", action="store_true", help="also time the steps below (fine_targets)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}")
    os.environ["HETCCL_ISLAND"] = f"nvidia-{RANK}"  # each rank its own island
    for owner, name in [(backend.HetcclBackend, "_launch_ordered"), (backend._EnqueuedWork, "__init__"),
                        (backend._EnqueuedWork, "wait"), (communicator.Communicator, "enqueue_ordered"),
                        (hierarchical._Island, "enqueue"), (backend.HetcclBackend, "_early_stream")]:
        timed(owner, name)
    for owner, name in fine_targets() if args.fine else []:
        timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("hetccl", device_id=dev)
    n = dist.get_world_size()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ops: dict[str, Callable[..., Any]] = {}
    for mib in (float(x) for x in args.sizes.split(",")):
        count = int(mib * (1 << 18)) // n * n  # fp32 elements
        full, part = torch.ones(count, device=dev), torch.ones(count // n, device=dev)
        out_full, out_part = torch.empty(count, device=dev), torch.empty(count // n, device=dev)
        ops.update({
            f"all_reduce {mib:g} MiB": lambda full=full, **kw: dist.all_reduce(full, **kw),
            f"reduce_scatter {mib:g} MiB":
                lambda full=full, o=out_part, **kw: dist.reduce_scatter_tensor(o, full, **kw),
            f"all_gather {mib:g} MiB": lambda o=out_full, p=part, **kw: dist.all_gather_into_tensor(o, p, **kw),
            f"broadcast {mib:g} MiB": lambda full=full, **kw: dist.broadcast(full, 0, **kw),
        })
    for name, call in ops.items():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        held: dict[str, float] = {}
        parts: dict[str, float] = {}
        listing = ""
        for mode in modes:
            times = []
            SPENT.clear()
            prof = cProfile.Profile() if mode == "cProfile" else None
            if mode == "switch 0.1 ms":
                sys.setswitchinterval(0.0001)
            for _ in range(CALLS):
                dist.barrier()
                torch.cuda.synchronize()
                for _ in range(MATMULS):
                    torch.mm(a, a, out=c)
                if mode == "3 ms pause":
                    time.sleep(0.003)
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                call(async_op=False)
                if prof is not None:
                    prof.disable()
                times.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            sys.setswitchinterval(0.005)
            held[mode] = round(statistics.median(times), 3)
            if mode == "as is":
                parts = {k: round(v / CALLS * 1e3, 3) for k, v in sorted(SPENT.items(), key=lambda kv: -kv[1])}
            if prof is not None:
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("hetccl|torch/cuda|distributed",
                                                                                      30)
                listing = text.getvalue()
        if RANK == 0:
            print(f"## {name}: held ms {held}; mean ms per call in {parts}")
            lines = listing.splitlines()
            start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
            print("\n".join(line for line in lines[start:] if line.strip()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
