"""`hetccl bench`: an nccl-tests style benchmark of hetccl's collectives on real ranks.

Run plainly it launches `--nprocs` local ranks (default 2) itself; under a launcher (hetccl run, torchrun,
srun, mpirun) it uses the launcher's ranks. For each op and size it checks one result (#wrong), then times
`-n` iterations, each after a barrier; the time of an iteration is the slowest rank's and the table shows the
median. Columns and bus-bandwidth factors follow nccl-tests (PERFORMANCE.md): size is the larger buffer
(all_gather: output; reduce_scatter: input).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
DEFAULT_OPS = "all_reduce,all_gather,reduce_scatter,broadcast,all_to_all"


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    from .config import parse_size

    p = argparse.ArgumentParser(prog="hetccl bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=4096, help="smallest size (default 4K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between steps (default 4)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=3, help="untimed iterations (default 3)")
    p.add_argument("-d", "--datatype", default="float32", help="dtype (default float32)")
    p.add_argument("-o", "--op", default="sum", help="reduce op (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root for broadcast/reduce (default 0)")
    p.add_argument("--ops", default=DEFAULT_OPS, help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to launch when not under a launcher")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    p.add_argument("--budget", type=float, default=2.0, help="seconds per size at most (fewer iterations)")
    p.add_argument("--no-inplace", action="store_true", help="skip the in-place variant")
    args = p.parse_args(argv)
    for op in args.ops.split(","):
        if op not in OPS:
            p.error(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if args.minbytes <= 0 or args.maxbytes < args.minbytes or args.stepfactor < 2:
        p.error("need 0 < minbytes <= maxbytes and stepfactor >= 2")
    return args


def _under_launcher() -> bool:
    return any(v in os.environ for v in ("HETCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not _under_launcher():
        from .launcher import launch

        return launch(args.nprocs, [sys.executable, "-m", "hetccl", "bench", *argv])
    import hetccl

    return hetccl.run(_run(args))


def _pattern(count: int, rank: int, np_dtype: Any) -> np.ndarray:
    """Small integers: every sum stays exact in every dtype, so results are checked exactly."""
    return ((np.arange(count) % 7) + rank).astype(np_dtype)


class _Case:
    """Buffers and the call of one op at one size, with its expected result."""

    def __init__(self, comm: Any, op: str, nbytes: int, np_dtype: Any, redop: str, root: int, inplace: bool):
        n, r = comm.size, comm.rank
        isz = np.dtype(np_dtype).itemsize
        self.comm, self.op, self.redop, self.root, self.inplace = comm, op, redop, root, inplace
        per = nbytes // isz
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            per = max(per // n, 1) if op != "all_to_all" else max(per // n, 1) * n
        self.count = per
        self.dtype = np_dtype
        c = per
        if op in ("all_reduce", "broadcast", "reduce"):
            self.src = _pattern(c, r, np_dtype)
            self.buf = self.src.copy()
            self.size_bytes = c * isz
        elif op == "all_gather":
            self.src = _pattern(c, r, np_dtype)
            self.out = np.zeros(n * c, np_dtype)
            self.size_bytes = n * c * isz
        elif op == "reduce_scatter":
            self.src = _pattern(n * c, r, np_dtype)
            self.out = np.zeros(c, np_dtype)
            self.size_bytes = n * c * isz
        else:  # all_to_all: c elements total per rank
            self.src = _pattern(c, r, np_dtype)
            self.out = np.zeros(c, np_dtype)
            self.size_bytes = c * isz
        self.work = self.src.copy()

    async def run(self) -> None:
        comm, op, r = self.comm, self.op, self.comm.rank
        if op == "all_reduce":
            if not self.inplace:
                np.copyto(self.buf, self.src)  # out-of-place = from a separate send buffer
            await comm.all_reduce(self.buf, op=self.redop)
        elif op == "broadcast":
            await comm.broadcast(self.buf, root=self.root)
        elif op == "reduce":
            await comm.reduce(self.buf, root=self.root, op=self.redop)
        elif op == "all_gather":
            c = self.count
            if self.inplace:
                await comm.all_gather(self.out, self.out[r * c:(r + 1) * c])
            else:
                await comm.all_gather(self.out, self.src)
        elif op == "reduce_scatter":
            if self.inplace:
                c = self.count
                await comm.reduce_scatter(self.work[r * c:(r + 1) * c], self.work, op=self.redop)
            else:
                await comm.reduce_scatter(self.out, self.src, op=self.redop)
        else:
            await comm.all_to_all(self.out, self.src)

    def reset(self) -> None:
        r, c = self.comm.rank, self.count
        if self.op in ("all_reduce", "broadcast", "reduce"):
            np.copyto(self.buf, self.src)
        elif self.op == "all_gather" and self.inplace:
            self.out[r * c:(r + 1) * c] = self.src
        elif self.op == "reduce_scatter" and self.inplace:
            np.copyto(self.work, self.src)

    def wrong(self) -> int:
        n, r, c = self.comm.size, self.comm.rank, self.count
        pats = [_pattern(self.src.size, p, np.float64) for p in range(n)]
        if self.op in ("all_reduce", "reduce", "reduce_scatter"):
            fn = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[self.redop]
            want = fn(pats, axis=0) / (n if self.redop == "avg" else 1)
            if self.op == "reduce_scatter":
                want = want[r * c:(r + 1) * c]
                got = self.work[r * c:(r + 1) * c] if self.inplace else self.out
            elif self.op == "reduce" and r != self.root:
                want, got = pats[r], self.buf
            else:
                got = self.buf
        elif self.op == "broadcast":
            want, got = pats[self.root], self.buf
        elif self.op == "all_gather":
            want, got = np.concatenate([p[:c] for p in pats]), self.out
        else:
            k = c // n
            want = np.concatenate([pats[p][r * k:(r + 1) * k] for p in range(n)])
            got = self.out[: n * k]
        want = np.asarray(want).astype(self.dtype).astype(np.float64)
        return int(np.count_nonzero(~np.isclose(np.asarray(got, np.float64), want, rtol=1e-3, atol=1e-3)))


async def _time_case(case: _Case, iters: int, warmup: int, budget: float) -> tuple[float, int]:
    comm = case.comm
    case.reset()
    await case.run()
    wrong = case.wrong()
    for _ in range(warmup):
        case.reset()
        await case.run()
    # same iteration count on every rank: agree on the estimate first
    t0 = time.perf_counter()
    await comm.barrier()
    await case.run()
    est = np.array([time.perf_counter() - t0], np.float64)
    await comm.all_reduce(est, op="max")
    iters = max(3, min(iters, int(budget / max(est[0], 1e-9))))
    times = np.zeros(iters, np.float64)
    for i in range(iters):
        await comm.barrier()
        t = time.perf_counter()
        await case.run()
        times[i] = time.perf_counter() - t
    await comm.all_reduce(times, op="max")
    tot = np.array([wrong], np.int64)
    await comm.all_reduce(tot)
    return statistics.median(times.tolist()), int(tot[0])


async def _run(args: argparse.Namespace) -> int:
    import hetccl

    from .dtypes import dtype_name, parse_dtype

    comm = await hetccl.init()
    n, r = comm.size, comm.rank
    dt = parse_dtype(args.datatype)
    if dt.name == "BFLOAT16":
        import ml_dtypes

        np_dtype: Any = ml_dtypes.bfloat16
    else:
        np_dtype = np.dtype(dtype_name(dt))
    isz = dt.itemsize
    kinds = sorted(set(comm._fabric.peer_transport.values())) or ["none"]
    results: list[dict[str, Any]] = []
    total_wrong = 0
    if r == 0:
        print(f"# hetccl bench: {n} ranks, {comm._fabric.topology.num_hosts} host(s), transports {kinds}, "
              f"dtype {dtype_name(dt)}, op {args.op}, iters {args.iters} (median of the slowest rank)")
    for op in args.ops.split(","):
        if r == 0:
            redop = args.op if op in ("all_reduce", "reduce_scatter", "reduce") else "none"
            root = args.root if op in ("broadcast", "reduce") else -1
            print(f"\n# {op}  (redop {redop}, root {root})")
            print(f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} |"
                  f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} |"
                  f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}")
            print(f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} |"
                  f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} |"
                  f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}")
        size = args.minbytes
        while size <= args.maxbytes:
            row: dict[str, Any] = {"op": op, "nranks": n, "type": dtype_name(dt), "transports": kinds}
            for inplace in (False, True):
                if inplace and (args.no_inplace or op in ("broadcast", "reduce", "all_to_all")):
                    continue
                case = _Case(comm, op, size, np_dtype, args.op, args.root, inplace)
                t, wrong = await _time_case(case, args.iters, args.warmup_iters, args.budget)
                algbw = case.size_bytes / t / 1e9
                key = "ip" if inplace else "oop"
                row.update({"size": case.size_bytes, "count": case.size_bytes // isz,
                            f"{key}_time_us": t * 1e6, f"{key}_algbw": algbw,
                            f"{key}_busbw": algbw * bus_factor(op, n), f"{key}_wrong": wrong})
                total_wrong += wrong
            results.append(row)
            if r == 0:
                redop = args.op if op in ("all_reduce", "reduce_scatter", "reduce") else "none"
                root = args.root if op in ("broadcast", "reduce") else -1

                def cols(k: str, row: dict[str, Any] = row) -> str:
                    if f"{k}_time_us" not in row:
                        return f" {'n/a':>9} {'':>7} {'':>7} {'':>6}"
                    return (f" {row[f'{k}_time_us']:9.1f} {row[f'{k}_algbw']:7.3f} {row[f'{k}_busbw']:7.3f}"
                            f" {row[f'{k}_wrong']:6d}")

                print(f"  {row['size']:>12} {row['count']:>12} {dtype_name(dt):>8} {redop:>6} {root:>5} |"
                      f"{cols('oop')} |{cols('ip')}", flush=True)
            size *= args.stepfactor
    if r == 0:
        print(f"\n# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tool": "hetccl", "nranks": n, "results": results}, f, indent=1)
    await comm.close()
    return 0 if total_wrong == 0 else 1
