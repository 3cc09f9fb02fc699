"""Init at scale (issue 32): ranks as hosts of --per-host ranks each on this one machine, side by side with
another checkout (--repo) in one run, the two interleaved size by size.

    python benchmarks/init_scale.py [--ranks 8,16,32] [--per-host 8] [--reps 2] [--repo OTHER_CHECKOUT]

Per job: every rank's time from its launch to the end of `hetccl.init()` (the slowest rank's), the first
all_reduce (4 KiB, the slowest rank's), open files and peak RSS per rank (the largest), and the requests rank
0's store served by then and the bytes it sent (a checkout without the count says "-"). The ranks oversubscribe
the cores, as the issue's figures did, so the times are the machine's, not a cluster's. Then a model, each
measure as a + b N fitted over the sizes run, shown beside each measurement and projected to --project ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rankproc import free_port  # noqa: E402

RANK = r"""
import os, resource, sys, time
launched = float(os.environ["BENCH_LAUNCHED"])
import numpy as np
import hetccl
comm = hetccl.init_sync()
init_s = time.time() - launched
t = time.perf_counter()
comm.all_reduce(np.ones(1024, np.float32))
first_s = time.perf_counter() - t
server = comm.async_comm._fabric.server if comm.rank == 0 else None
served = getattr(server, "served", None)
sent = getattr(server, "bytes_served", None)  # checkouts before the records tree have no count
row = np.array([init_s, first_s, len(os.listdir("/proc/self/fd")),
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], np.float64)
comm.all_reduce(row, op="max")
if comm.rank == 0:
    print("ROW", init_s, *row.tolist(), -1 if served is None else served, -1 if sent is None else sent,
          flush=True)
comm.close()
"""


def run_job(n: int, per_host: int, repo: str | None, logs: str = "") -> dict:
    root = repo or str(HERE.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    port = free_port()
    hosts = ",".join(f"h{r // per_host}" for r in range(n))
    launched = time.time()
    procs = []
    for r in range(n):
        e = dict(env, HETCCL_RANK=str(r), HETCCL_WORLD_SIZE=str(n), HETCCL_LOCAL_RANK=str(r),
                 HETCCL_ADDR=f"127.0.0.1:{port}", HETCCL_SECRET="init-scale-bench", HETCCL_HOST=hosts,
                 HETCCL_TIMEOUT="300", BENCH_LAUNCHED=repr(launched))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=e, cwd=root, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    row = None
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=900)
        if logs:  # every rank's stderr (HETCCL_DEBUG=INFO says where its records came from)
            Path(logs, f"{n}-rank{r}.err").write_text(err)
        if p.returncode != 0:
            raise SystemExit(f"rank {r} of {n} ({root}) exited {p.returncode}:\n{err[-3000:]}")
        for line in out.splitlines():
            if line.startswith("ROW "):
                _, _, init_s, first_s, fds, rss, served, *sent = line.split()
                row = {"init": float(init_s), "first": float(first_s), "fds": float(fds), "rss": float(rss),
                       "served": int(float(served)), "sent": int(float(sent[0])) if sent else -1}
    assert row is not None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,16,32")
    ap.add_argument("--per-host", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--repo", default=None, help="another checkout to compare against (before)")
    ap.add_argument("--logs", default="", help="a folder for every rank's stderr")
    ap.add_argument("--project", type=int, default=8192, help="the size the model projects to (0: no model)")
    a = ap.parse_args()
    variants = [("this", None)] + ([("before", a.repo)] if a.repo else [])
    print(f"# init at scale, hosts of {a.per_host} ranks; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; "
          f"{' '.join(sys.argv)}")
    print("| ranks | variant | init s | first all_reduce ms | open files per rank | peak RSS MB | store requests "
          "| store bytes sent |")
    print("|---|---|---|---|---|---|---|---|")
    medians: dict[int, dict] = {}  # this checkout's medians per size, for the model
    for n in (int(x) for x in a.ranks.split(",")):
        got: dict[str, list[dict]] = {v: [] for v, _ in variants}
        for _ in range(a.reps):
            for v, repo in variants:  # interleaved
                got[v].append(run_job(n, a.per_host, repo, a.logs))
        for v, _ in variants:
            rows = got[v]
            med = {k: statistics.median(r[k] for r in rows) for k in ("init", "first", "fds", "rss")}
            served, sent = rows[0]["served"], rows[0]["sent"]
            if v == "this":
                medians[n] = {**med, "served": served}
            print(f"| {n} | {v} | {med['init']:.2f} | {med['first'] * 1e3:.1f} | {med['fds']:.0f} | "
                  f"{med['rss']:.0f} | {served if served >= 0 else '-'} | {sent if sent >= 0 else '-'} |",
                  flush=True)
    if a.project and len(medians) >= 2:
        print_model(medians, a.project)


MODEL = [("init", "init s"), ("fds", "open files per rank"), ("rss", "peak RSS MB"), ("served", "store requests")]


def print_model(medians: dict[int, dict], target: int) -> None:
    """Each measure fitted as a + b N (least squares over the sizes run), its value beside each measurement
    (the check), and its projection to `target` ranks. Connections: HETCCL_CONNECT as set for the runs (eager
    below HETCCL_CONNECT_LAZY_FROM ranks by default): a fit of eager runs projects every peer connected."""
    import numpy as np

    sizes = sorted(medians)
    mode = os.environ.get("HETCCL_CONNECT", "auto (eager below 256 ranks)")
    print(f"\n# model: a + b N over N = {', '.join(map(str, sizes))} (this checkout, HETCCL_CONNECT={mode})")
    print("| measure | a | b per rank | " + " | ".join(f"N={n}: model / measured" for n in sizes)
          + f" | N={target} |")
    print("|---|---|---|" + "---|" * len(sizes) + "---|")
    for key, name in MODEL:
        ys = [float(medians[n][key]) for n in sizes]
        b, a0 = np.polyfit(np.array(sizes, float), np.array(ys), 1)
        if b < 0:  # no growth measured (the noise of a flat measure): flat, not a fall to zero
            b, a0 = 0.0, float(np.mean(ys))
        cells = " | ".join(f"{a0 + b * n:.1f} / {y:.1f}" for n, y in zip(sizes, ys, strict=True))
        print(f"| {name} | {a0:.2f} | {b:.4f} | {cells} | {a0 + b * target:.0f} |", flush=True)


if __name__ == "__main__":
    main()
