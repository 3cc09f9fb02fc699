#!/usr/bin/env python3
"""hetccl vs Gloo vs Open MPI on this machine's CPUs, side by side, in one run.

Backends (all float32 CPU buffers, all ranks on this host):
  hetccl-shm  `python -m hetccl bench` with hetccl's default transports (shared memory between local ranks)
  hetccl-tcp  the same with HETCCL_TRANSPORTS=tcp (loopback TCP)
  gloo        torch.distributed Gloo over 127.0.0.1        (benchmarks/anchor_gloo.py)
  mpi-sm      Open MPI, pml ob1, btl vader,self (shm)       (benchmarks/anchor_mpi.py under mpirun)
  mpi-tcp     Open MPI, pml ob1, btl tcp,self on lo         (benchmarks/anchor_mpi.py under mpirun)
  hetccl-shm-before, hetccl-tcp-before
              hetccl-shm / hetccl-tcp run from another checkout (--before DIR, e.g. `git worktree add DIR
              <base>` with its native library built): a before/after comparison in the same run

Every backend is timed by the same method (hetccl bench's, see benchmarks/benchcommon.py): barrier, then the
collective; time = median over iterations of the slowest rank; nccl-tests sizes and busbw factors; the first
call of every size is checked. all_reduce is compared in place (hetccl's `ip` column; Gloo and MPI reduce in
place), the other ops out of place.

The whole set is repeated --reps times; within a repetition the backends are interleaved (their order is
rotated from one repetition and np to the next) so that slow drift hits all of them alike. The report
shows, per point, the median over repetitions. A contention guard (benchmarks/cpuguard.py) watches the CPU
used by processes that are not ours; a point measured while they used more than --guard-thresh % of a core
is measured again (after waiting for the load to clear) up to --guard-redo times, and flagged if it stays
contended.

  python benchmarks/compare_cpu.py                 # full run: np 2 and 4, 3 reps, 4 KiB..64 MiB, ~15-20 min
  python benchmarks/compare_cpu.py --quick         # smoke test: 1 rep, np 2, up to 1 MiB, ~1-2 min
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import benchcommon as bc  # noqa: E402
from cpuguard import CpuGuard  # noqa: E402

BACKENDS = ("hetccl-shm-before", "hetccl-shm", "hetccl-tcp-before", "hetccl-tcp", "gloo", "mpi-sm", "mpi-tcp")
BEFORE = ("hetccl-shm-before", "hetccl-tcp-before")
LABELS = {"hetccl-shm": "hetccl shm", "hetccl-tcp": "hetccl tcp", "hetccl-tcp-before": "hetccl tcp (before)",
          "hetccl-shm-before": "hetccl shm (before)",
          "gloo": "Gloo (tcp lo)",
          "mpi-sm": "Open MPI sm (vader)", "mpi-tcp": "Open MPI tcp (lo)"}
DEFAULT_OPS = "all_reduce,all_gather,broadcast,reduce_scatter,all_to_all"
# figures of shared/anchors/results-2026-11-29.md (same machine type, 3 runs, anchors' own scripts)
REFERENCE_2026_11_29 = {
    ("mpi-sm", "busbw64M"): 1.796, ("mpi-tcp", "busbw64M"): 0.991, ("gloo", "busbw64M"): 1.126,
    ("mpi-sm", "t4K"): 2.2, ("mpi-tcp", "t4K"): 29.4, ("gloo", "t4K"): 843.6,
}
# rank variables that would make a child think it already runs under a launcher
_STRIP_ENV = ("HETCCL_RANK", "HETCCL_WORLD_SIZE", "HETCCL_LOCAL_RANK", "HETCCL_LOCAL_WORLD_SIZE",
              "HETCCL_ADDR", "HETCCL_SECRET", "HETCCL_LAUNCHED", "HETCCL_TRANSPORTS", "RANK", "WORLD_SIZE",
              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")

_OP_RE = re.compile(r"^#\s+(%s)\s" % "|".join(bc.OPS))
_ROW_RE = re.compile(r"^\s+(\d+)\s+(\d+)\s+\S+")


def log(msg: str) -> None:
    print("[%s] %s" % (dt.datetime.now().strftime("%H:%M:%S"), msg), flush=True)


# ------------------------------------------------------------------------------------------------ commands
def invocations(be: str, np_: int, ops: list[str], minb: int, maxb: int, a, json_base: str):
    """[(label, argv, env, json_path, cwd)] that measure backend `be` on `ops` for sizes minb..maxb."""
    py = a.python
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    cwd = REPO
    if be in BEFORE:  # `python -m` imports hetccl from the working directory first
        cwd = os.path.abspath(a.before)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH")]))  # keep what else it held
    common = ["-b", str(minb), "-e", str(maxb), "-f", "4", "-n", str(a.iters), "-w", str(a.warmup),
              "--budget", str(a.budget)]
    out = []
    if be.startswith("hetccl"):
        if be in ("hetccl-tcp", "hetccl-tcp-before"):
            env["HETCCL_TRANSPORTS"] = "tcp"
        # all_reduce: hetccl bench times both variants, the in-place one is compared. The other ops are
        # compared out of place, so their in-place variant is skipped (half the time).
        groups = [(["all_reduce"], [])] if "all_reduce" in ops else []
        rest = [o for o in ops if o != "all_reduce"]
        if rest:
            groups.append((rest, ["--no-inplace"]))
        for i, (g, extra) in enumerate(groups):
            jp = "%s.%d.json" % (json_base, i)
            out.append(("%s np%d %s" % (be, np_, ",".join(g)),
                        [py, "-m", "hetccl", "bench", "--nprocs", str(np_), *common, "--ops", ",".join(g),
                         *extra, "--json", jp], env, jp, cwd))
        return out
    jp = json_base + ".json"
    if be == "gloo":
        argv = [py, os.path.join(HERE, "anchor_gloo.py"), "--nprocs", str(np_)]
    else:
        btl = ["--mca", "btl", "vader,self"] if be == "mpi-sm" else \
            ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
        argv = [a.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
                "--mca", "oob_tcp_if_include", "lo", "--mca", "pml", "ob1", *btl,
                py, os.path.join(HERE, "anchor_mpi.py"), "--transport", be.split("-")[1]]
    out.append(("%s np%d" % (be, np_), argv + common + ["--ops", ",".join(ops), "--json", jp], env, jp, cwd))
    return out


def run_one(label, argv, env, json_path, logf, timeout, cwd=REPO):
    """Run one benchmark command; stream its stdout, time-stamping each op header and row.
    Returns (rc, {(op, size): (t_start, t_end)}, json dict or None)."""
    if os.path.exists(json_path):
        os.remove(json_path)
    logf.write("\n### %s\n$ %s\n" % (label, " ".join(argv)))
    logf.flush()
    t_prev = time.time()
    spans, op = {}, None
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=logf, env=env, cwd=cwd, text=True, bufsize=1,
                         start_new_session=True)
    deadline = time.time() + timeout
    try:
        for line in p.stdout:
            now = time.time()
            logf.write(line)
            m = _OP_RE.match(line)
            if m:
                op, t_prev = m.group(1), now
                continue
            m = _ROW_RE.match(line)
            if m and op:
                spans[(op, int(m.group(1)))] = (t_prev, now)
                t_prev = now
            if now > deadline:
                raise TimeoutError
        rc = p.wait(timeout=max(1.0, deadline - time.time()))
    except (TimeoutError, subprocess.TimeoutExpired):
        logf.write("# compare_cpu: TIMEOUT after %.0f s, killing the job\n" % timeout)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        rc = 124
    logf.flush()
    data = None
    if os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    return rc, spans, data


def measure(be, np_, ops, minb, maxb, a, guard, raw_dir, tag, logf):
    """Measure one backend: {(op, size): point}; point = dict(time_us, busbw, algbw, wrong, foreign, ...)."""
    points, meta = {}, {}
    for label, argv, env, jp, cwd in invocations(be, np_, ops, minb, maxb, a, os.path.join(raw_dir, tag)):
        t0 = time.time()
        rc, spans, data = run_one(label, argv, env, jp, logf, a.timeout, cwd)
        if rc != 0:
            log("  %s: exit code %d (see %s)" % (label, rc, os.path.relpath(logf.name, REPO)))
        meta.setdefault("rc", []).append(rc)
        meta.setdefault("wall_s", []).append(round(time.time() - t0, 1))
        if not data:
            continue
        for k in ("transports", "torch", "library", "mpi4py", "impl", "transport", "mca"):
            if k in data:
                meta[k] = data[k]
        for r in data["results"]:
            if "transports" in r:
                meta["transports"] = r["transports"]
            v = "ip" if (r["op"] == "all_reduce" and "ip_time_us" in r) else "oop"
            if "%s_time_us" % v not in r:
                continue
            key = (r["op"], int(r["size"]))
            span = spans.get(key, (t0, time.time()))
            fpct, ftop = guard.foreign_over(*span) if guard else (0.0, "")
            points[key] = {"time_us": r["%s_time_us" % v], "busbw": r["%s_busbw" % v],
                           "algbw": r["%s_algbw" % v], "wrong": int(r.get("%s_wrong" % v, 0)),
                           "variant": v, "foreign": round(fpct, 1), "foreign_top": ftop, "attempt": 1,
                           "iters": r.get("iters", "")}
            if r["op"] == "all_reduce" and "oop_time_us" in r and v == "ip":
                points[key]["oop_time_us"] = r["oop_time_us"]
    return points, meta


def guard_wait_left(a, stats) -> float:
    """How long the next wait for quiet may take: --guard-wait, within what is left of --guard-wait-total."""
    return max(0.0, min(a.guard_wait, a.guard_wait_total - stats["waited_s"]))


def measure_guarded(be, np_, ops, sizes, a, guard, raw_dir, tag, logf, stats):
    points, meta = measure(be, np_, ops, sizes[0], sizes[-1], a, guard, raw_dir, tag, logf)
    if not guard:
        return points, meta
    for rnd in range(1, a.guard_redo + 1):
        bad = sorted(k for k, p in points.items() if p["foreign"] > a.guard_thresh)
        if not bad:
            break
        if stats["redo_s"] >= a.guard_redo_total:
            stats["redo_skipped"] += 1
            log("  %s np%d: %d point(s) contended, but the redo time (--guard-redo-total %.0f s) is spent; "
                "they stay flagged" % (be, np_, len(bad), a.guard_redo_total))
            break
        worst = max(bad, key=lambda k: points[k]["foreign"])
        log("  %s np%d: %d point(s) contended (worst %s %s: %.0f%% of a core by %s); redo %d/%d" % (
            be, np_, len(bad), worst[0], bc.hsize(worst[1]), points[worst]["foreign"],
            points[worst]["foreign_top"] or "?", rnd, a.guard_redo))
        waited, quiet = guard.wait_quiet(a.guard_thresh, guard_wait_left(a, stats),
                                         log=lambda m: log("  " + m))
        stats["waited_s"] += waited
        if not quiet:
            stats["redo_skipped"] += 1
            log("  %s np%d: still busy, no redo (the points stay flagged)" % (be, np_))
            break
        for op in sorted({k[0] for k in bad}):
            ss = [k[1] for k in bad if k[0] == op]
            stats["redo_runs"] += 1
            t_redo = time.time()
            new, _ = measure(be, np_, [op], min(ss), max(ss), a, guard, raw_dir,
                             "%s-redo%d-%s" % (tag, rnd, op), logf)
            stats["redo_s"] += time.time() - t_redo
            for k in [k for k in bad if k[0] == op]:
                if k in new and new[k]["foreign"] < points[k]["foreign"]:
                    new[k]["attempt"] = rnd + 1
                    points[k] = new[k]
                    stats["redone_points"] += 1
    return points, meta


# ------------------------------------------------------------------------------------------------ report
def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(a) -> dict:
    info = {"date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
            "kernel": platform.release(), "cpus": os.cpu_count()}
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    l3 = next((ln.split(":", 1)[1].strip() for ln in sh(["lscpu"]).splitlines() if ln.startswith("L3")), "")
    hyp = next((ln.split(":", 1)[1].strip() for ln in sh(["lscpu"]).splitlines()
                if ln.startswith("Hypervisor vendor")), "")
    info["cpu"] = model + (", L3 " + l3 if l3 else "") + (", VM (%s)" % hyp if hyp else "")
    try:
        with open("/proc/meminfo") as f:
            info["mem"] = "%.0f GiB" % (int(f.readline().split()[1]) / (1 << 20))
    except (OSError, ValueError, IndexError):
        pass
    code = ("import sys, numpy, torch, hetccl\n"
            "try:\n import mpi4py; m = mpi4py.__version__\nexcept Exception: m = 'missing'\n"
            "print(sys.version.split()[0], numpy.__version__, torch.__version__, "
            "getattr(hetccl, '__version__', '?'), m)")
    v = sh([a.python, "-c", code]).split()
    if len(v) == 5:
        info.update(python=v[0], numpy=v[1], torch=v[2], hetccl=v[3], mpi4py=v[4])
    info["openmpi"] = (sh([a.mpirun, "--version"]).splitlines() or ["missing"])[0]
    rev = sh(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = sh(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no", "hetccl", "native"])
    info["hetccl_git"] = rev + (" (+ uncommitted changes in hetccl/ or native/)" if dirty else "")
    native = [ln.split(":", 1)[1].strip() for ln in sh([a.python, "-m", "hetccl", "info"]).splitlines()
              if ln.startswith("native")]
    info["hetccl_native"] = native[0] if native else "?"
    return info


def fmt_t(us: float) -> str:
    if us >= 10000:
        return "%.0f" % us
    if us >= 100:
        return "%.0f" % us
    return "%.1f" % us


def fmt_bw(g: float) -> str:
    return "%.2f" % g if g >= 0.1 else "%.3f" % g


def aggregate(allpts: dict) -> dict:
    """allpts[(rep, be, np, op, size)] = point -> agg[(be, np, op, size)] = summary over reps."""
    groups: dict = {}
    for (_rep, be, np_, op, size), p in allpts.items():
        groups.setdefault((be, np_, op, size), []).append(p)
    agg = {}
    for key, ps in groups.items():
        be, np_, op, size = key
        ts = [p["time_us"] for p in ps]
        t = statistics.median(ts)
        algbw = size / (t * 1e-6) / 1e9
        agg[key] = {"time_us": t, "busbw": algbw * bc.bus_factor(op, np_), "n": len(ps),
                    "spread": (max(ts) - min(ts)) / t if t else 0.0,
                    "wrong": sum(p["wrong"] for p in ps),
                    "contended": sum(1 for p in ps if p["foreign"] > ARGS.guard_thresh) if ARGS.guard else 0,
                    "foreign_max": max(p["foreign"] for p in ps)}
    return agg


def cell(s) -> str:
    if s is None:
        return "—"
    txt = "%s / %s" % (fmt_t(s["time_us"]), fmt_bw(s["busbw"]))
    if s["wrong"]:
        txt += " WRONG"
    if s["contended"]:
        txt += " †"
    return txt


def write_report(path, a, info, agg, nps, ops, sizes, stats, metas, t_start, t_end, load0, load1, guard_mean,
                 failures, raw_rel):
    L = []
    w = L.append
    quick = " (quick smoke run: noisy, not for citing)" if a.quick else ""
    w("# CPU collectives on this machine: hetccl vs Gloo vs Open MPI, %s%s\n" % (info["date"][:10], quick))
    w("Generated by `benchmarks/compare_cpu.py %s` in %.1f min." % (" ".join(a.argv_echo), (t_end - t_start) / 60))
    w("")
    w("## Machine and versions\n")
    w("| | |")
    w("|---|---|")
    for k, lab in (("date", "date"), ("cpu", "CPU"), ("cpus", "cores"), ("mem", "memory"), ("kernel", "kernel"),
                   ("python", "Python"), ("hetccl", "hetccl"), ("hetccl_git", "hetccl commit"),
                   ("hetccl_native", "hetccl native"), ("torch", "torch (Gloo)"), ("numpy", "numpy"),
                   ("openmpi", "Open MPI"), ("mpi4py", "mpi4py")):
        if info.get(k):
            w("| %s | %s |" % (lab, info[k]))
    w("| load average (1/5/15 min) at start | %.2f / %.2f / %.2f |" % load0)
    w("| load average (1/5/15 min) at end | %.2f / %.2f / %.2f |" % load1)
    if guard_mean is not None:
        w("| CPU used by foreign processes, mean over the run | %.0f%% of one core |" % guard_mean)
    w("")
    w("## Method\n")
    w("- Backends: %s. Each backend runs as its own job of np ranks on this host (np %s)."
      % ("; ".join("**%s**" % LABELS[b] for b in a.backends), ", ".join(map(str, nps))))
    w("- Same method for all (hetccl bench's): per size one checked call, %d warm-up calls, then timed "
      "calls, each `barrier; t0; collective; t1`; %d timed calls at most, fewer for big sizes so that a size "
      "takes about %.2f s, never fewer than %d. Time = median over the timed calls of the slowest rank's time."
      % (a.warmup, a.iters, a.budget, bc.MIN_ITERS))
    w("- nccl-tests conventions: size = the buffer (all_reduce, broadcast), the output (all_gather), the input "
      "(reduce_scatter), one rank's send buffer (all_to_all); busbw = algbw x 2(n-1)/n for all_reduce, "
      "x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for broadcast. float32; GB/s = 1e9 B/s.")
    w("- all_reduce is compared **in place** (hetccl's `ip` column; Gloo's and MPI's all_reduce work in "
      "place); the other ops out of place. Gloo: %s. MPI: %s." % (
          ", ".join(sorted({v for m in metas.get("gloo", []) for v in (m.get("impl") or {}).values()})) or "-",
          ", ".join(sorted({v for b in ("mpi-sm", "mpi-tcp") for m in metas.get(b, [])
                            for v in (m.get("impl") or {}).values()})) or "-"))
    w("- %d repetition(s) of the whole set; within each, the backends are interleaved (order rotated per "
      "repetition and np). Cells: median over repetitions of time (us) / busbw (GB/s)." % a.reps)
    if a.guard:
        w("- Contention guard: a point measured while processes that are not ours used more than %.0f%% of a "
          "core is measured again after waiting (up to %.0f s) for the load to clear, up to %d times; "
          "**†** = still contended in at least one repetition (see the list at the end). This run: %d redo "
          "job(s) (%.0f s), %d point(s) replaced, %d redo(s) skipped (load did not clear, or the redo time "
          "of %.0f s was spent), %.0f s spent waiting (at most %.0f s in all)." % (
              a.guard_thresh, a.guard_wait, a.guard_redo, stats["redo_runs"], stats["redo_s"],
              stats["redone_points"], stats["redo_skipped"], a.guard_redo_total, stats["waited_s"],
              a.guard_wait_total))
    else:
        w("- Contention guard off (--no-guard).")
    trs = {b: sorted({t for m in metas.get(b, []) for t in (m.get("transports") or [])})
           for b in ("hetccl-shm", "hetccl-tcp")}
    if any(trs.values()):
        w("- hetccl transports reported by hetccl bench: %s." % "; ".join(
            "%s: %s" % (b, ",".join(t) or "?") for b, t in trs.items() if b in a.backends))
    w("")

    # headline
    np_h = 2 if 2 in nps else min(nps)
    big = max((s for s in sizes if s <= 64 << 20), default=sizes[-1])
    small = sizes[0]

    def g(be, op, size, field):
        s = agg.get((be, np_h, op, size))
        return None if s is None else s[field]

    w("## Headline (all_reduce, np %d)\n" % np_h)
    if big != 64 << 20:
        w("_Largest size measured is %s, so it stands in for 64 MiB._\n" % bc.hsize(big))
    w("| metric | hetccl | anchor | hetccl vs anchor | anchor on 2026-11-29 |")
    w("|---|---|---|---|---|")

    def ref(be, what):
        v = REFERENCE_2026_11_29.get((be, what))
        return "—" if v is None or np_h != 2 else ("%.2f GB/s" % v if what.startswith("busbw") else "%.1f us" % v)

    refkey_bw = "busbw64M" if big == 64 << 20 else "-"
    for hb, ab in (("hetccl-shm", "mpi-sm"), ("hetccl-shm-before", "mpi-sm"), ("hetccl-shm", "hetccl-shm-before"),
                   ("hetccl-tcp", "gloo"), ("hetccl-tcp-before", "gloo"),
                   ("hetccl-tcp", "hetccl-tcp-before"), ("hetccl-tcp", "mpi-tcp")):
        x, y = g(hb, "all_reduce", big, "busbw"), g(ab, "all_reduce", big, "busbw")
        w("| %s busbw: %s vs %s | %s | %s | %s | %s |" % (
            bc.hsize(big), LABELS[hb], LABELS[ab], "%.2f GB/s" % x if x else "—", "%.2f GB/s" % y if y else "—",
            "**%.2fx** busbw" % (x / y) if x and y else "—", ref(ab, refkey_bw)))
    th = g("hetccl-shm", "all_reduce", small, "time_us")
    for ab in ("mpi-sm", "gloo", "mpi-tcp"):
        ty = g(ab, "all_reduce", small, "time_us")
        w("| %s latency: %s vs %s | %s | %s | %s | %s |" % (
            bc.hsize(small), LABELS["hetccl-shm"], LABELS[ab], "%.1f us" % th if th else "—",
            "%.1f us" % ty if ty else "—",
            ("**%.2fx** %s" % ((ty / th, "faster") if ty >= th else (th / ty, "slower"))) if th and ty else "—",
            ref(ab, "t4K" if small == 4096 else "-")))
    for hb, ab in (("hetccl-tcp", "gloo"), ("hetccl-tcp", "hetccl-tcp-before")):
        tt = g(hb, "all_reduce", small, "time_us")
        ty = g(ab, "all_reduce", small, "time_us")
        if tt and ty:
            w("| %s latency: %s vs %s | %.1f us | %.1f us | **%.2fx** %s | %s |" % (
                bc.hsize(small), LABELS[hb], LABELS[ab], tt, ty,
                ty / tt if ty >= tt else tt / ty, "faster" if ty >= tt else "slower", ref(ab, "t4K")))
    w("")
    w("Ratios: busbw hetccl / anchor (>1: hetccl better); latency: how many times faster (anchor time / "
      "hetccl time) or slower hetccl is.\n")

    # full tables
    w("## Results per op and np: time (us) / busbw (GB/s)\n")
    cols = [b for b in BACKENDS if b in a.backends]
    for op in ops:
        for np_ in nps:
            if not any((b, np_, op, s) in agg for b in cols for s in sizes):
                continue
            w("### %s, np %d\n" % (op, np_))
            w("| size | " + " | ".join(LABELS[b] for b in cols) + " |")
            w("|---|" + "---|" * len(cols))
            for s in sizes:
                w("| %s | %s |" % (bc.hsize(s), " | ".join(cell(agg.get((b, np_, op, s))) for b in cols)))
            w("")

    # spread
    if a.reps > 1:
        w("## Run-to-run spread\n")
        w("(max - min) / median of the time over the %d repetitions, median over sizes (and worst size).\n"
          % a.reps)
        w("| op | np | " + " | ".join(LABELS[b] for b in cols) + " |")
        w("|---|---|" + "---|" * len(cols))
        for op in ops:
            for np_ in nps:
                cells = []
                for b in cols:
                    sp = [agg[(b, np_, op, s)]["spread"] for s in sizes if (b, np_, op, s) in agg]
                    cells.append("%.0f%% (%.0f%%)" % (100 * statistics.median(sp), 100 * max(sp)) if sp else "—")
                if any(c != "—" for c in cells):
                    w("| %s | %d | %s |" % (op, np_, " | ".join(cells)))
        w("")

    bad = sorted(k for k, s in agg.items() if s["contended"])
    if a.guard:
        w("## Points still contended after the redos (†)\n")
        if not bad:
            w("None.\n")
        else:
            for k in bad:
                s = agg[k]
                w("- %s np%d %s %s: %d of %d repetition(s), foreign CPU up to %.0f%% of a core" % (
                    k[0], k[1], k[2], bc.hsize(k[3]), s["contended"], s["n"], s["foreign_max"]))
            w("")
    if failures:
        w("## Failures\n")
        for f in failures:
            w("- " + f)
        w("")
    w("Raw per-run JSON, logs and `points.csv` (every repetition): `%s` (git-ignored).\n" % raw_rel)
    with open(path, "w") as f:
        f.write("\n".join(L))


# ------------------------------------------------------------------------------------------------ main
ARGS = None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nps", default="2 4", help='rank counts, space or comma separated (default "2 4")')
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the whole set (default 3)")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--ops", default=DEFAULT_OPS, help="comma list (default %s)" % DEFAULT_OPS)
    default_backends = ",".join(b for b in BACKENDS if b not in BEFORE)
    ap.add_argument("--backends", default=default_backends,
                    help="comma list (default all but the *-before ones: %s)" % default_backends)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 rep, np 2, up to 1M")
    ap.add_argument("--out", default="", help="report path (default benchmarks/results/cpu-<date>.md; "
                                              "with --quick benchmarks/results/raw/cpu-<date>-quick.md)")
    ap.add_argument("--iters", type=int, default=40, help="timed iterations per size at most (default 40)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    ap.add_argument("--budget", type=float, default=0.25,
                    help="seconds of timed calls per size, caps the iterations (default 0.25)")
    ap.add_argument("--no-guard", dest="guard", action="store_false", help="no contention guard")
    ap.add_argument("--guard-thresh", type=float, default=25.0,
                    help="foreign CPU (%% of one core) above which a point is contended (default 25)")
    ap.add_argument("--guard-redo", type=int, default=2, help="redo rounds for contended points (default 2)")
    ap.add_argument("--guard-wait", type=float, default=45.0,
                    help="seconds to wait at most for the foreign load to clear before a redo (default 45)")
    ap.add_argument("--guard-wait-total", type=float, default=180.0,
                    help="seconds of waiting for quiet in the whole run at most (default 180); then points "
                         "are measured as they come and flagged")
    ap.add_argument("--guard-redo-total", type=float, default=180.0,
                    help="seconds spent re-measuring in the whole run at most (default 180)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark job (default 900)")
    ap.add_argument("--python", default=sys.executable, help="python with hetccl, torch, numpy, mpi4py")
    ap.add_argument("--before", default="", metavar="DIR",
                    help="checkout that the *-before backends run (its native extension built)")
    ap.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    a = ap.parse_args(argv)
    a.argv_echo = argv
    if a.quick:
        a.reps, a.nps, a.max_bytes = 1, "2", "1M" if a.max_bytes == "64M" else a.max_bytes
    a.nps_list = [int(x) for x in re.split(r"[,\s]+", a.nps.strip()) if x]
    a.ops_list = [o.strip() for o in a.ops.split(",") if o.strip()]
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    for o in a.ops_list:
        if o not in bc.OPS:
            ap.error("unknown op %r; choose from %s" % (o, ",".join(bc.OPS)))
    for b in a.backends:
        if b not in BACKENDS:
            ap.error("unknown backend %r; choose from %s" % (b, ",".join(BACKENDS)))
    if set(BEFORE) & set(a.backends) and not os.path.isdir(os.path.join(a.before, "hetccl")):
        ap.error("backends %s need --before DIR, a checkout with hetccl/ in it" % ",".join(BEFORE))
    return a


def main(argv=None) -> int:
    global ARGS
    argv = sys.argv[1:] if argv is None else argv
    a = ARGS = parse_args(argv)
    nps, ops = a.nps_list, a.ops_list
    sizes = bc.sizes(bc.parse_size(a.min_bytes), bc.parse_size(a.max_bytes), 4)
    today = dt.date.today().isoformat()
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    raw_dir = os.path.join(HERE, "results", "raw", "cpu-%s%s" % (stamp, "-quick" if a.quick else ""))
    os.makedirs(raw_dir, exist_ok=True)
    if a.out:
        out = a.out
    elif a.quick:
        out = os.path.join(HERE, "results", "raw", "cpu-%s-quick.md" % today)
    else:
        out = os.path.join(HERE, "results", "cpu-%s.md" % today)
        i = 2
        while os.path.exists(out):
            out = os.path.join(HERE, "results", "cpu-%s-%d.md" % (today, i))
            i += 1
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if any(b.startswith("mpi") for b in a.backends) and not shutil.which(a.mpirun):
        log("mpirun not found: run benchmarks/setup.sh (or leave mpi-* out of --backends)")
        return 2

    info = environment(a)
    load0 = os.getloadavg()
    t_start = time.time()
    guard = None
    if a.guard:
        guard = CpuGuard(interval=1.0)
        guard.start()
    log("compare_cpu: backends %s, np %s, ops %s, %s..%s, %d rep(s); raw output in %s" % (
        ",".join(a.backends), nps, ",".join(ops), bc.hsize(sizes[0]), bc.hsize(sizes[-1]), a.reps,
        os.path.relpath(raw_dir, REPO)))
    log("load average %.2f %.2f %.2f; %s" % (load0 + (info.get("cpu", ""),)))
    stats = {"redo_runs": 0, "redone_points": 0, "waited_s": 0.0, "redo_skipped": 0, "redo_s": 0.0}
    allpts, metas, failures = {}, {}, []
    csv_path = os.path.join(raw_dir, "points.csv")
    fields = ["rep", "backend", "np", "op", "size", "time_us", "busbw", "algbw", "wrong", "variant",
              "iters", "foreign", "foreign_top", "attempt", "oop_time_us"]
    with open(csv_path, "w", newline="") as cf, open(os.path.join(raw_dir, "jobs.log"), "w") as logf:
        cw = csv.DictWriter(cf, fieldnames=fields, extrasaction="ignore")
        cw.writeheader()
        k = 0
        njobs, done = a.reps * len(nps) * len(a.backends), 0
        for rep in range(1, a.reps + 1):
            for np_ in nps:
                order = a.backends[k % len(a.backends):] + a.backends[:k % len(a.backends)]
                k += 1
                for be in order:
                    t0 = time.time()
                    if guard:
                        stats["waited_s"] += guard.wait_quiet(a.guard_thresh, guard_wait_left(a, stats),
                                                              log=lambda m: log("  " + m))[0]
                    tag = "rep%d-np%d-%s" % (rep, np_, be)
                    pts, meta = measure_guarded(be, np_, ops, sizes, a, guard, raw_dir, tag, logf, stats)
                    metas.setdefault(be, []).append(meta)
                    if any(rc != 0 for rc in meta.get("rc", [])):
                        failures.append("%s np%d rep %d: exit code(s) %s, see raw/%s/jobs.log" % (
                            be, np_, rep, meta.get("rc"), os.path.basename(raw_dir)))
                    missing = [(o, s) for o in ops for s in sizes if (o, s) not in pts]
                    if missing and len(missing) < len(ops) * len(sizes):
                        failures.append("%s np%d rep %d: no result for %s" % (
                            be, np_, rep, ", ".join("%s %s" % (o, bc.hsize(s)) for o, s in missing[:8])
                            + (" ..." if len(missing) > 8 else "")))
                    for (op, size), p in pts.items():
                        allpts[(rep, be, np_, op, size)] = p
                        cw.writerow({"rep": rep, "backend": be, "np": np_, "op": op, "size": size, **p})
                    cf.flush()
                    done += 1
                    ar = pts.get(("all_reduce", sizes[-1])) or {}
                    nwrong = sum(p["wrong"] for p in pts.values())
                    log("rep %d/%d np%d %-10s %3d points in %5.1f s%s%s" % (
                        rep, a.reps, np_, be, len(pts), time.time() - t0,
                        ("; all_reduce %s busbw %.2f GB/s" % (bc.hsize(sizes[-1]), ar["busbw"])) if ar else "",
                        ("; %d WRONG elements" % nwrong) if nwrong else ""))
                if rep == 1 and np_ == nps[-1] and a.reps > 1:
                    el = time.time() - t_start
                    log("repetition 1 took %.1f min; about %.0f min to go" % (el / 60, el * (njobs - done) / done / 60))
    t_end = time.time()
    load1 = os.getloadavg()
    guard_mean = guard.mean_since(t_start) if guard else None
    if guard:
        guard.stop()
    agg = aggregate(allpts)
    with open(os.path.join(raw_dir, "summary.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items() if k != "argv_echo"}, "env": info,
                   "load_start": load0, "load_end": load1, "guard_mean_foreign_pct": guard_mean,
                   "stats": stats, "meta": metas, "failures": failures,
                   "agg": [dict(backend=k[0], np=k[1], op=k[2], size=k[3], **v) for k, v in sorted(agg.items())]},
                  f, indent=1)
    write_report(out, a, info, agg, nps, ops, sizes, stats, metas, t_start, t_end, load0, load1, guard_mean,
                 failures, os.path.relpath(raw_dir, REPO))
    log("done in %.1f min; report: %s" % ((t_end - t_start) / 60, os.path.relpath(out, REPO)))
    return 1 if failures or any(s["wrong"] for s in agg.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
