#!/usr/bin/env python3
"""torch.distributed Gloo anchor, measured the way `hetccl bench` measures hetccl (see benchcommon.py).

Adapted from the project's anchor script shared/anchors/gloo_allreduce.py: --nprocs local processes
(torch.multiprocessing spawn), each init_process_group("gloo") over tcp://127.0.0.1 with
GLOO_SOCKET_IFNAME=lo, so every byte goes over loopback TCP. CPU float32 tensors, one intra-op thread.

Ops (hetccl names): all_reduce (in place, dist.all_reduce), all_gather (dist.all_gather_single, out of
place), broadcast (root 0), reduce_scatter (dist.reduce_scatter_single, out of place), all_to_all
(dist.all_to_all_single). The first call of every size is checked (#wrong = elements off, all ranks).

  python benchmarks/anchor_gloo.py --nprocs 2 -b 4K -e 64M -f 4 --ops all_reduce,all_gather --json out.json
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchcommon as bc  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_attr(mod, *names):
    for nm in names:
        if hasattr(mod, nm):
            return nm, getattr(mod, nm)
    return None, None


def make_case(op: str, size: int, rank: int, n: int):
    """(run, check -> #wrong elements, after_check, variant) for one op and size, or None if size does not split."""
    import torch
    import torch.distributed as dist

    count = size // 4
    f32 = torch.float32
    if op == "all_reduce":
        buf = torch.full((count,), float(rank + 1), dtype=f32)
        want = n * (n + 1) / 2

        def run():
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)

        def check():
            return int((buf != want).sum())

        def after():
            buf.zero_()  # in place: keep the values finite over many iterations
        return run, check, after, "ip", "dist.all_reduce (in place)"
    if op == "broadcast":
        buf = torch.full((count,), float(rank + 1), dtype=f32)

        def run():
            dist.broadcast(buf, src=0)

        def check():
            return int((buf != 1.0).sum())
        return run, check, None, "oop", "dist.broadcast root 0"
    if count % n:
        return None
    per = count // n
    if op == "all_gather":
        inp = torch.full((per,), float(rank + 1), dtype=f32)
        out = torch.empty((count,), dtype=f32)
        name, fn = _first_attr(dist, "all_gather_single", "all_gather_into_tensor")
        if fn is None:
            outs = list(out.chunk(n))
            name = "all_gather"

            def run():
                dist.all_gather(outs, inp)
        else:
            def run():
                fn(out, inp)
        want = torch.arange(1, n + 1, dtype=f32).repeat_interleave(per)

        def check():
            return int((out != want).sum())
        return run, check, None, "oop", "dist.%s" % name
    if op == "reduce_scatter":
        inp = ((rank + 1) * torch.arange(1, n + 1, dtype=f32)).repeat_interleave(per)
        out = torch.empty((per,), dtype=f32)
        name, fn = _first_attr(dist, "reduce_scatter_single", "reduce_scatter_tensor")
        if fn is None:
            ins = list(inp.chunk(n))
            name = "reduce_scatter"

            def run():
                dist.reduce_scatter(out, ins, op=dist.ReduceOp.SUM)
        else:
            def run():
                fn(out, inp, op=dist.ReduceOp.SUM)
        want = (rank + 1) * n * (n + 1) / 2

        def check():
            return int((out != want).sum())
        return run, check, None, "oop", "dist.%s" % name
    if op == "all_to_all":
        inp = (rank * n + torch.arange(n, dtype=f32)).repeat_interleave(per)
        out = torch.empty((count,), dtype=f32)

        def run():
            dist.all_to_all_single(out, inp)
        want = (torch.arange(n, dtype=f32) * n + rank).repeat_interleave(per)

        def check():
            return int((out != want).sum())
        return run, check, None, "oop", "dist.all_to_all_single"
    raise ValueError("unknown op %r" % op)


def worker(rank: int, args, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    n = args.nprocs
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=n)
    rows, total_wrong, impls = [], 0, {}

    def max_over_ranks(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        header_done = False
        for size in bc.sizes(args.minbytes, args.maxbytes, args.stepfactor):
            case = make_case(op, size, rank, n)
            if case is None:
                continue
            run, check, after, variant, impl = case
            impls[op] = impl
            if rank == 0 and not header_done:
                print(bc.header(op, n, "gloo " + impl), flush=True)
                header_done = True
            dist.barrier()
            run()
            wrong = torch.tensor([check()], dtype=torch.int64)
            dist.all_reduce(wrong)
            if after:
                after()
            for _ in range(args.warmup_iters):
                run()
            t0 = time.perf_counter()
            dist.barrier()
            run()
            est = max_over_ranks(torch.tensor([time.perf_counter() - t0], dtype=torch.float64))
            iters = bc.n_iters(est.item(), args.iters, args.budget)
            times = torch.zeros(iters, dtype=torch.float64)
            for i in range(iters):
                dist.barrier()
                t = time.perf_counter()
                run()
                times[i] = time.perf_counter() - t
            max_over_ranks(times)
            total_wrong += int(wrong.item())
            if rank == 0:
                r = bc.row(op, n, size, iters, bc.median(times.tolist()), int(wrong.item()), variant)
                rows.append(r)
                print(bc.row_line(r, variant), flush=True)
            del run, check, after, case
    if rank == 0:
        print("\n# Out of bounds values : %d %s" % (total_wrong, "OK" if total_wrong == 0 else "FAILED"),
              flush=True)
        bc.write_json(args.json, "gloo", n, rows, torch=torch.__version__, impl=impls,
                      transport="tcp 127.0.0.1 (GLOO_SOCKET_IFNAME=lo)")
    dist.barrier()
    dist.destroy_process_group()
    if total_wrong:
        sys.exit(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(ap)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    args = ap.parse_args()
    for op in args.ops.split(","):
        if op not in bc.OPS:
            ap.error("unknown op %r; choose from %s" % (op, ",".join(bc.OPS)))
    import torch
    import torch.multiprocessing as mp

    port = free_port()
    print("# gloo anchor: torch %s, %d ranks over 127.0.0.1:%d (GLOO_SOCKET_IFNAME=lo), %d cpus" % (
        torch.__version__, args.nprocs, port, os.cpu_count()), flush=True)
    mp.spawn(worker, args=(args, port), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
