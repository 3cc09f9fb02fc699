"""`hetccl bench`: an nccl-tests style benchmark of hetccl's collectives on real ranks.

Run plainly it launches `--nprocs` local ranks (default 2) itself; under a launcher (hetccl run, torchrun,
srun, mpirun) it uses the launcher's ranks. For each op and size it checks one result (#wrong), then times
`-n` iterations, each after a barrier; the time of an iteration is the slowest rank's and the table shows the
median. Columns and bus-bandwidth factors follow nccl-tests (PERFORMANCE.md): size is the larger buffer
(all_gather: output; reduce_scatter: input).

Tooling around the numbers:
  --plot FILE.png        busbw against size, one panel per op (with --anchor NAME=FILE.json curves too;
                         with --results FILE.json it plots saved results without running anything)
  --compare A.json B.json  per-size ratios of two result files (B/A busbw: >1 means B is faster); no job
A progress line runs on the terminal during long sweeps when `hetccl bench` launches its own ranks and stderr
is a terminal (--no-progress turns it off). One writer owns the terminal: the ranks' output and rank 0's
progress reports come to `hetccl bench` through the launcher's pipes, and the progress line (on stderr, drawn
with \r) is erased before each line of output and drawn again after it, so the two never collide.
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

from . import params

# every collective of the API, in nccl-tests' order
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter")
DEFAULT_OPS = ",".join(OPS)
ONE_VARIANT = ("broadcast", "reduce", "all_to_all", "gather", "scatter")  # no separate in-place variant here
PROGRESS_MARK = "\x1b]hetccl-bench-progress;"  # rank 0 -> `hetccl bench`: one stderr line per step done


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


def size_label(nbytes: float) -> str:
    """4096 -> '4K', 1048576 -> '1M', 67108864 -> '64M' (powers of 1024, as nccl-tests' -b/-e are written)."""
    n = float(nbytes)
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}{unit}"
    return f"{n:.0f}"


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
    p.add_argument("--no-progress", action="store_true", help="no progress line (it only shows on a terminal)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw busbw against size for every op run (needs matplotlib: hetccl[plot])")
    p.add_argument("--anchor", action="append", default=[], metavar="NAME=FILE.json",
                   help="with --plot: also draw these results (same JSON as --json); repeatable")
    p.add_argument("--results", default=None, metavar="FILE.json",
                   help="with --plot: plot these saved results instead of running the benchmark")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="print per-size ratios of two result files (B/A) and exit; no job is started")
    args = p.parse_args(argv)
    for spec in args.anchor:
        if "=" not in spec or not spec.split("=", 1)[0] or not spec.split("=", 1)[1]:
            p.error(f"--anchor {spec!r}: write NAME=FILE.json")
    if (args.anchor or args.results) and not args.plot:
        p.error("--anchor and --results go with --plot FILE.png")
    for op in args.ops.split(","):
        if op not in OPS:
            p.error(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if args.minbytes <= 0 or args.maxbytes < args.minbytes or args.stepfactor < 2:
        p.error("need 0 < minbytes <= maxbytes and stepfactor >= 2")
    return args


def _under_launcher() -> bool:
    return any(v in os.environ for v in ("HETCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))


def main(argv: list[str]) -> int:
    from .errors import HetcclError

    args = parse_args(argv)
    try:
        if args.compare:
            print(compare(load_results(args.compare[0]), load_results(args.compare[1]),
                          args.compare[0], args.compare[1]))
            return 0
        if args.results:
            plot(args.plot, {_label(load_results(args.results)): load_results(args.results)["results"],
                             **load_anchors(args.anchor)})
            return 0
        if args.plot:
            _require_matplotlib()
            load_anchors(args.anchor)  # fail before running anything
    except HetcclError as exc:
        print(f"hetccl bench: {exc}", file=sys.stderr)
        return 2
    if not _under_launcher():
        from .launcher import launch

        cmd = [sys.executable, "-m", "hetccl", "bench", *argv]
        if args.no_progress or not _isatty(sys.stderr):
            return launch(args.nprocs, cmd, tag_output=False)
        # rank 0 reports progress on its stderr; the launcher hands every line to us, and we alone write to
        # the terminal: the progress line is erased before a line of output and drawn again after it
        terminal = _Terminal(sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = terminal.out, terminal.err
        try:
            return launch(args.nprocs, cmd, env={"HETCCL_BENCH_PROGRESS": "1"}, tag_output=False)
        finally:
            terminal.close()
            sys.stdout, sys.stderr = terminal.real_out, terminal.real_err
    import hetccl

    return hetccl.run(_run(args))


# ---- results files: plots and comparisons (no job needed) ---------------------------------------------------
def load_results(path: str) -> dict[str, Any]:
    """A `hetccl bench --json` file: {"tool", "nranks", "results": [rows]}."""
    from .errors import ConfigError

    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read results {path!r}: {exc}") from None
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r and "size" in r for r in rows):
        raise ConfigError(f"{path!r} is not a `hetccl bench --json` file (needs results: [{{op, size, ...}}])")
    return doc


def load_anchors(specs: list[str]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for spec in specs:
        name, path = spec.split("=", 1)
        out[name] = load_results(path)["results"]
    return out


def _label(doc: dict[str, Any]) -> str:
    rows = doc.get("results") or [{}]
    kinds = rows[0].get("transports")
    return f"{doc.get('tool', 'hetccl')} ({doc.get('nranks', '?')} ranks" + (f", {'+'.join(kinds)})" if kinds else ")")


def compare(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """Per op and size present in both: busbw of A and B and the ratio B/A (out-of-place; in-place too when
    both have it), then the geometric mean of the ratios per op."""
    ia = {(r["op"], r["size"]): r for r in a["results"]}
    ib = {(r["op"], r["size"]): r for r in b["results"]}
    keys = sorted(set(ia) & set(ib), key=lambda k: (list(OPS).index(k[0]) if k[0] in OPS else 99, k[1]))
    lines = [f"# A = {name_a}", f"# B = {name_b}", "# ratio = busbw(B) / busbw(A): > 1 means B is faster",
             f"# {'op':<15} {'size (B)':>12} | {'A busbw':>9} {'B busbw':>9} {'ratio':>7} |"
             f" {'A ip':>9} {'B ip':>9} {'ratio':>7}"]
    per_op: dict[str, list[float]] = {}
    for k in keys:
        ra, rb = ia[k], ib[k]
        cols = []
        for v in ("oop", "ip"):
            x, y = ra.get(f"{v}_busbw"), rb.get(f"{v}_busbw")
            if x is None or y is None:
                cols.append(f" {'n/a':>9} {'':>9} {'':>7}")
                continue
            ratio = y / x if x > 0 else float("inf")
            if v == "oop" and 0 < ratio < float("inf"):
                per_op.setdefault(k[0], []).append(ratio)
            cols.append(f" {x:9.3f} {y:9.3f} {ratio:7.3f}")
        lines.append(f"  {k[0]:<15} {k[1]:>12} |{cols[0]} |{cols[1]}")
    if not keys:
        lines.append("# no (op, size) in common")
    for op, ratios in per_op.items():
        gm = float(np.exp(np.mean(np.log(ratios))))
        lines.append(f"# {op}: geometric mean ratio {gm:.3f} over {len(ratios)} size(s)")
    return "\n".join(lines)


def _require_matplotlib() -> Any:
    from .errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hetccl[plot]'") from None
    return plt


def plot(path: str, series: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """busbw (GB/s) against size: one panel per op, one line per series (in-place dashed). Returns each panel's
    size tick labels as drawn."""
    plt = _require_matplotlib()
    from matplotlib.ticker import FuncFormatter, NullLocator

    ops = [op for op in OPS if any(r["op"] == op for rows in series.values() for r in rows)]
    if not ops:
        from .errors import ConfigError

        raise ConfigError("nothing to plot: the results have no rows")
    cols = min(3, len(ops))
    nrow = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5.2 * cols, 3.8 * nrow), squeeze=False)
    for ax, op in zip(axes.flat, ops, strict=False):
        for i, (label, rows) in enumerate(series.items()):
            pts = sorted((r["size"], r) for r in rows if r["op"] == op)
            for v, style in (("oop", "-"), ("ip", "--")):
                xy = [(s, r[f"{v}_busbw"]) for s, r in pts if f"{v}_busbw" in r]
                if xy:
                    ax.plot([x for x, _ in xy], [y for _, y in xy], style, marker="o", markersize=3,
                            color=f"C{i}", label=label + (" in-place" if v == "ip" else ""))
        ax.set_xscale("log", base=2)
        sizes = sorted({r["size"] for rows in series.values() for r in rows if r["op"] == op})
        if sizes:  # a tick at every size measured (every other when there are many), read 4K, 1M, 64M
            ax.set_xticks(sizes if len(sizes) <= 10 else sizes[::2])
            ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(x)))
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    ticks = {op: [t.get_text() for t in ax.get_xticklabels()] for ax, op in zip(axes.flat, ops, strict=False)}
    plt.close(fig)
    return ticks


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _Progress:
    """Rank 0's side: one PROGRESS_MARK line on stderr per step, read by `hetccl bench` (see _Terminal)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def step(self, what: str) -> None:
        self.done += 1
        print(f"{PROGRESS_MARK}{self.done}/{self.total} {what}", file=sys.stderr, flush=True)


def _progress(args: argparse.Namespace, total: int) -> _Progress | None:
    if args.no_progress or not params.get("HETCCL_BENCH_PROGRESS"):
        return None
    return _Progress(total)


class _Terminal:
    """The one writer of `hetccl bench`'s terminal while its ranks run: every line of output (the launcher writes
    whole lines) first erases the progress line, then the progress line is drawn again below it."""

    BAR = 30

    def __init__(self, out: Any, err: Any):
        import threading

        self.real_out, self.real_err = out, err
        self._lock = threading.RLock()
        self._shown = False
        self._state: tuple[int, int, str] | None = None
        self._start = time.monotonic()
        self.out = _Stream(self, out, is_err=False)
        self.err = _Stream(self, err, is_err=True)

    def _erase(self) -> None:
        if self._shown:
            self.real_err.write("\r\x1b[K")
            self.real_err.flush()
            self._shown = False

    def _draw(self) -> None:
        if self._state is None:
            return
        done, total, what = self._state
        filled = self.BAR * done // max(total, 1)
        bar = "━" * filled + ("╸" if filled < self.BAR else "") + " " * max(self.BAR - filled - 1, 0)
        secs = int(time.monotonic() - self._start)
        self.real_err.write(f"\r\x1b[K{what[:28]:<28} {bar} {done}/{total} {secs // 60}:{secs % 60:02d}")
        self.real_err.flush()
        self._shown = True

    def write(self, text: str, is_err: bool) -> None:
        with self._lock:
            for line in text.splitlines(keepends=True):
                if is_err and line.startswith(PROGRESS_MARK):
                    count, _, what = line[len(PROGRESS_MARK):].strip().partition(" ")
                    try:
                        done, total = (int(x) for x in count.split("/"))
                    except ValueError:
                        continue
                    self._state = (done, total, what)
                    self._draw()
                    continue
                self._erase()
                target = self.real_err if is_err else self.real_out
                target.write(line)
                target.flush()
                if line.endswith("\n"):
                    self._draw()

    def close(self) -> None:
        with self._lock:
            self._erase()
            self._state = None


class _Stream:
    """A text stream that hands what is written to its _Terminal (no .buffer: the launcher writes str)."""

    def __init__(self, terminal: _Terminal, real: Any, is_err: bool):
        self._terminal, self._real, self._is_err = terminal, real, is_err

    def write(self, text: str) -> int:
        self._terminal.write(text, self._is_err)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return _isatty(self._real)

    def fileno(self) -> int:
        return self._real.fileno()


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
        if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
            per = max(per // n, 1) if op != "all_to_all" else max(per // n, 1) * n
        self.count = per
        self.dtype = np_dtype
        c = per
        if op in ("all_reduce", "broadcast", "reduce"):
            self.src = _pattern(c, r, np_dtype)
            self.buf = self.src.copy()
            self.size_bytes = c * isz
        elif op in ("all_gather", "gather"):
            self.src = _pattern(c, r, np_dtype)
            self.out = np.zeros(n * c, np_dtype)
            self.size_bytes = n * c * isz
        elif op in ("reduce_scatter", "scatter"):
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
        elif op == "gather":
            await comm.gather(self.out if r == self.root else None, self.src, root=self.root)
        elif op == "scatter":
            await comm.scatter(self.out, self.src if r == self.root else None, root=self.root)
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
        elif self.op == "all_gather" or (self.op == "gather" and r == self.root):
            want, got = np.concatenate([p[:c] for p in pats]), self.out
        elif self.op == "gather":
            return 0  # only the root receives
        elif self.op == "scatter":
            want, got = pats[self.root][r * c:(r + 1) * c], self.out
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
    nsizes, size = 0, args.minbytes
    while size <= args.maxbytes:
        nsizes, size = nsizes + 1, size * args.stepfactor
    variants = {op: 1 if args.no_inplace or op in ONE_VARIANT else 2 for op in args.ops.split(",")}
    bar = _progress(args, nsizes * sum(variants.values())) if r == 0 else None
    for op in args.ops.split(","):
        if r == 0:
            redop = args.op if op in ("all_reduce", "reduce_scatter", "reduce") else "none"
            root = args.root if op in ("broadcast", "reduce", "gather", "scatter") else -1
            print(f"\n# {op}  (redop {redop}, root {root})")
            # nccl-tests' grouping: which columns are the out-of-place and which the in-place variant
            print(f"# {'':>12} {'':>12} {'':>8} {'':>6} {'':>5} |{'out-of-place':^35}|{'in-place':^35}")
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
                if inplace and (args.no_inplace or op in ONE_VARIANT):
                    continue
                case = _Case(comm, op, size, np_dtype, args.op, args.root, inplace)
                t, wrong = await _time_case(case, args.iters, args.warmup_iters, args.budget)
                algbw = case.size_bytes / t / 1e9
                key = "ip" if inplace else "oop"
                row.update({"size": case.size_bytes, "count": case.size_bytes // isz,
                            f"{key}_time_us": t * 1e6, f"{key}_algbw": algbw,
                            f"{key}_busbw": algbw * bus_factor(op, n), f"{key}_wrong": wrong})
                total_wrong += wrong
                if bar is not None:
                    bar.step(f"{op} {size_label(size)}{' in-place' if inplace else ''}")
            results.append(row)
            if r == 0:
                redop = args.op if op in ("all_reduce", "reduce_scatter", "reduce") else "none"
                root = args.root if op in ("broadcast", "reduce", "gather", "scatter") else -1

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
        doc = {"tool": "hetccl", "nranks": n, "results": results}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if args.plot:
            plot(args.plot, {_label(doc): results, **load_anchors(args.anchor)})
            print(f"# plot: {args.plot}")
    await comm.close()
    return 0 if total_wrong == 0 else 1
