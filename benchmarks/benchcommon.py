"""Helpers shared by benchmarks/anchor_gloo.py, benchmarks/anchor_mpi.py and compare_cpu.py.

The method is the one of `hetccl bench` (hetccl/bench.py), so that all backends are measured alike:
  * per op and size: one checked call, `warmup` untimed calls, then one barrier+call to estimate the
    time (max over ranks), then iters = max(MIN_ITERS, min(iters, budget / estimate)) timed calls,
    each one `barrier(); t0; collective; t1`;
  * time = median over the timed iterations of the slowest rank's time of that iteration;
  * sizes and bus-bandwidth factors follow nccl-tests (PERFORMANCE.md):
      all_reduce, broadcast : size = the buffer;          busbw = algbw * 2(n-1)/n  (broadcast: * 1)
      all_gather            : size = the output (n * in); busbw = algbw * (n-1)/n
      reduce_scatter        : size = the input (n * out); busbw = algbw * (n-1)/n
      all_to_all            : size = one rank's send buffer; busbw = algbw * (n-1)/n
    algbw = size / time, GB/s = 1e9 B/s.
  * results are written as JSON in hetccl bench's layout: {"tool", "nranks", "results": [rows]}, a row
    being {op, size, count, nranks, type, <v>_time_us, <v>_algbw, <v>_busbw, <v>_wrong} with v = "ip"
    for an in-place call and "oop" for an out-of-place one.
"""

from __future__ import annotations

import json
import os

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all")
MIN_ITERS = 3  # as hetccl bench


def parse_size(text: str) -> int:
    """'4K', '64M', '1G', '4096', '64MiB', '64MB' -> bytes (powers of two, like nccl-tests)."""
    s = str(text).strip().upper()
    s = s[:-2] if s.endswith("IB") else s[:-1] if s.endswith("B") else s
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    return int(float(s) * mult)


def hsize(b: int) -> str:
    b = int(b)
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m and b % m == 0:
            return "%d %s" % (b // m, unit)
    return "%d B" % b


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, b = [], min_bytes
    while b <= max_bytes:
        out.append(b)
        b *= factor
    return out


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast


def n_iters(est_s: float, iters: int, budget_s: float) -> int:
    """hetccl bench's rule; est_s must be max-reduced over ranks so every rank runs the same count."""
    return max(MIN_ITERS, min(iters, int(budget_s / max(est_s, 1e-9))))


def median(xs):
    t = sorted(xs)
    m = len(t) // 2
    return t[m] if len(t) % 2 else 0.5 * (t[m - 1] + t[m])


def aligned_full(count: int, value, dtype, align: int = 0):
    """numpy array of `count` elements filled with value; with align > 0 its data pointer is a
    multiple of `align` bytes (plain numpy puts large arrays at 16 mod 4096)."""
    import numpy as np

    dt = np.dtype(dtype)
    if not align:
        return np.full(count, value, dtype=dt)
    raw = np.empty(count * dt.itemsize + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    a = raw[off:off + count * dt.itemsize].view(dt)
    a.fill(value)
    return a


def header(op: str, n: int, what: str) -> str:
    """The lines printed before an op's rows; compare_cpu.py recognises '# <op> ' as the op start."""
    return ("\n# %s  (nranks %d, %s)\n"
            "# %12s %12s %8s %7s | %11s %8s %8s %6s\n"
            "# %12s %12s %8s %7s | %11s %8s %8s %6s") % (
        op, n, what, "size", "count", "type", "iters", "time", "algbw", "busbw", "#wrong",
        "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "")


def row(op: str, n: int, size: int, iters: int, med_s: float, wrong: int, variant: str) -> dict:
    algbw = size / med_s / 1e9
    return {"op": op, "nranks": n, "type": "float32", "size": size, "count": size // 4,
            "iters": iters, f"{variant}_time_us": med_s * 1e6, f"{variant}_algbw": algbw,
            f"{variant}_busbw": algbw * bus_factor(op, n), f"{variant}_wrong": int(wrong)}


def row_line(r: dict, variant: str) -> str:
    return "  %12d %12d %8s %7d | %11.1f %8.3f %8.3f %6d" % (
        r["size"], r["count"], "float32", r["iters"], r[f"{variant}_time_us"],
        r[f"{variant}_algbw"], r[f"{variant}_busbw"], r[f"{variant}_wrong"])


def write_json(path: str, tool: str, n: int, rows: list[dict], **extra) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"tool": tool, "nranks": n, **extra, "results": rows}, f, indent=1)


def add_common_args(ap) -> None:
    """The options of `hetccl bench` that the anchors share (same names, same meaning)."""
    ap.add_argument("-b", "--minbytes", type=parse_size, default=4096)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size at most")
    ap.add_argument("-w", "--warmup_iters", type=int, default=3, help="untimed iterations")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per size at most (fewer iterations)")
    ap.add_argument("--ops", default="all_reduce,all_gather,broadcast",
                    help="comma list of " + ",".join(OPS))
    ap.add_argument("--json", default="", help="write the results as JSON (hetccl bench layout) here")
