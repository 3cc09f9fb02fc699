#!/usr/bin/env python3
"""Dead-peer and stuck-rank trials on real jobs (issue 6: "repeats this 20 times ... reports 20/20").

Dead peer, per transport (shm, tcp), `--trials` times: a job of 2-4 ranks (random) loops on large checked
all_reduces (16 MiB float32); after a random delay the driver sends SIGKILL to a random rank (os.kill from
outside: no cooperative exit). A trial passes when
  * every survivor raises PeerLostError whose .rank is the dead rank, within 10 s of the kill,
  * every survivor then closes and exits 0 (within 30 s of the kill),
  * nothing of the job is left: no /dev/shm entry with the job id, no listening TCP socket on the job's
    store and data ports, no Unix socket (abstract doorbells included) with the job id.
Stuck rank, per transport, `--stuck-trials` times: a random rank stops calling collectives after a random
number of iterations but stays alive; every other rank must raise CollectiveTimeout within HETCCL_TIMEOUT
(3 s) + 2 s of the stuck rank's last collective, and exit; then the driver kills the stuck rank.

    python benchmarks/fault_trials.py --trials 20 --stuck-trials 5 --out benchmarks/results/faults.md
    python benchmarks/fault_trials.py --transports tcp --ranks 4 --victim 0 --trials 10 --stuck-trials 0
    python benchmarks/fault_trials.py --transports shm --ranks 32 --per-host 4 --victim-kind leader \
        --trials 20 --stuck-trials 0     # issue 32: 8 "hosts" of 4, a host's first rank killed

The second form is the case where attribution is hardest: the store's host dies, and each survivor closes its
connections as soon as it sees that; the others must still name rank 0, not the survivor that left first.

Prints a table per trial and a summary line "shm 20/20, tcp 20/20"; exits 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rankproc import Job, listening_tcp_ports, unix_sockets_matching

TRANSPORTS = {"shm": "shm,tcp", "tcp": "tcp"}
DETECT_LIMIT = 10.0
EXIT_LIMIT = 30.0
STUCK_TIMEOUT = 3.0
STUCK_MARGIN = 2.0
COUNT = 4 << 20  # float32 elements: 16 MiB all_reduces


def _leftovers(job: Job, jobid: str | None, ports: set[int]) -> list[str]:
    left = []
    if jobid:
        left += [f"shm {p}" for p in glob.glob(f"/dev/shm/*{jobid}*")]
        left += [f"unix {u}" for u in unix_sockets_matching(jobid)]
    left += [f"listening tcp port {p}" for p in sorted(ports & listening_tcp_ports())]
    return left


def _start(job: Job, n: int, res: dict) -> tuple[str, set[int]] | None:
    """Wait for every rank's "ready": the job's id and its listening ports (what _leftovers looks for), or None
    with the reason in res."""
    if not job.wait_event(list(range(n)), "ready", 90):
        res["why"] = "ranks did not start: " + " | ".join(
            f"rank {r} rc={job.procs[r].poll()} {job.stderr_tail(r, 400)!r}" for r in range(n))
        return None
    ready = {r: job.event(r, "ready") for r in range(n)}
    return ready[0]["job"], {job.store_port} | {ev["tcp_port"] for ev in ready.values() if ev.get("tcp_port")}


def dead_peer_trial(transport: str, rng: random.Random, workdir: Path, ranks: int | None = None,
                    victim: int | None = None, per_host: int = 0, victim_kind: str = "any",
                    extra: dict[str, str] | None = None) -> dict:
    n = ranks if ranks is not None else rng.randint(2, 4)
    if victim is None:  # per_host: a host's first rank leads it (its island's leader, the shm group's first)
        pool = [r for r in range(n) if victim_kind == "any" or (r % per_host == 0) == (victim_kind == "leader")]
        victim = rng.choice(pool)
    env = {"HETCCL_TRANSPORTS": TRANSPORTS[transport], **(extra or {})}
    if per_host:  # hosts of per_host ranks each, as other machines (HETCCL_HOST): TCP between them
        env["HETCCL_HOST"] = ",".join(f"h{r // per_host}" for r in range(n))
    delay = round(rng.uniform(0.1, 2.0), 2)
    res = {"kind": "kill -9", "transport": transport, "n": n, "victim": victim, "moment": f"+{delay:.2f} s",
           "ok": False, "why": "", "detect": None, "exit": None}
    job = Job.spawn(n, "fault_ranks:loop_until_error", env, workdir, count=COUNT)
    try:
        started = _start(job, n, res)
        if started is None:
            return res
        jobid, ports = started
        if not _leftovers(job, jobid, ports):  # the same check on the live job must see its sockets
            res["why"] = "the leftover check sees nothing of the running job (it would be blind)"
            return res
        time.sleep(delay)
        t_kill = time.monotonic()
        job.kill(victim)
        survivors = [r for r in range(n) if r != victim]
        exited = job.wait_exit(survivors, EXIT_LIMIT)
        job.wait_exit([victim], 5)
        why = []
        if job.procs[victim].returncode != -9:
            why.append(f"victim rc={job.procs[victim].returncode} (not killed by SIGKILL?)")
        for r in survivors:
            if job.event(r, "wrong"):
                why.append(f"rank {r} got a wrong result")
        return _judge(job, survivors, t_kill, ("PeerLostError", victim), DETECT_LIMIT, exited, why, res, jobid,
                      ports)
    finally:
        job.kill_all()


def _judge(job: Job, ranks: list[int], t0: float, expect: tuple[str, int | None], limit: float,
           exited: dict[int, float], why: list[str], res: dict, jobid: str, ports: set[int]) -> dict:
    """The end of a trial: each of `ranks` must have raised `expect` (class, and the rank it names unless None)
    within `limit` s of t0 and exited 0; then nothing of the job may be left. Fills and returns res."""
    detect, done = [], []
    for r in ranks:
        err = job.event(r, "error")
        if err is None:
            why.append(f"rank {r} reported no error (rc={job.procs[r].poll()}): {job.stderr_tail(r, 300)!r}")
            continue
        detect.append(err["t"] - t0)
        if err["cls"] != expect[0] or expect[1] is not None and err["exc_rank"] != expect[1]:
            why.append(f"rank {r} raised {err['cls']}(rank={err['exc_rank']}): {err['msg'][:120]}")
        if err["t"] - t0 > limit:
            why.append(f"rank {r} raised after {err['t'] - t0:.1f} s")
        if r not in exited:
            why.append(f"rank {r} still running {EXIT_LIMIT:.0f} s after its deadline")
        else:
            done.append(exited[r] - t0)
            if job.procs[r].returncode != 0:
                why.append(f"rank {r} exited {job.procs[r].returncode}")
    hung = [r for r in ranks if job.procs[r].poll() is None]
    if hung:
        job.dump_stacks(hung)
        why.append(f"stacks of ranks {hung} in their rank*.err")
    job.kill_all()
    left = _leftovers(job, jobid, ports)
    if left:
        why.append("left behind: " + ", ".join(left))
    res.update(detect=max(detect) if detect else None, exit=max(done) if done else None,
               ok=not why, why="; ".join(why))
    return res


def stuck_trial(transport: str, rng: random.Random, workdir: Path, extra: dict[str, str] | None = None) -> dict:
    n = rng.randint(2, 4)
    stuck = rng.randrange(n)
    after = rng.randint(1, 6)
    res = {"kind": "stuck", "transport": transport, "n": n, "victim": stuck, "moment": f"iter {after}",
           "ok": False, "why": "", "detect": None, "exit": None}
    job = Job.spawn(n, "fault_ranks:loop_until_error", {"HETCCL_TRANSPORTS": TRANSPORTS[transport],
                                                       "HETCCL_TIMEOUT": str(STUCK_TIMEOUT), **(extra or {})}, workdir,
                    count=COUNT, stuck_rank=stuck, stuck_after=after)
    try:
        started = _start(job, n, res)
        if started is None:
            return res
        jobid, ports = started
        others = [r for r in range(n) if r != stuck]
        if not job.wait_event([stuck], "stuck", 30):
            res["why"] = "the stuck rank never got stuck"
            return res
        t_stuck = job.event(stuck, "stuck")["t"]
        exited = job.wait_exit(others, STUCK_TIMEOUT + 10 + EXIT_LIMIT)
        why = []
        if job.procs[stuck].poll() is not None:
            why.append(f"the stuck rank exited by itself (rc={job.procs[stuck].returncode})")
        job.kill(stuck)
        return _judge(job, others, t_stuck, ("CollectiveTimeout", None), STUCK_TIMEOUT + STUCK_MARGIN, exited,
                      why, res, jobid, ports)
    finally:
        job.kill_all()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="dead-peer trials per transport")
    ap.add_argument("--stuck-trials", type=int, default=3, help="stuck-rank trials per transport")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--ranks", type=int, default=None, help="dead-peer trials: job size (default: 2-4, random)")
    ap.add_argument("--victim", type=int, default=None, help="dead-peer trials: the rank killed (default: random)")
    ap.add_argument("--per-host", type=int, default=0, help="dead-peer trials: hosts of this many ranks each "
                    "(HETCCL_HOST), the first of each its leader (default: one host)")
    ap.add_argument("--victim-kind", choices=("any", "leader", "member"), default="any",
                    help="with --per-host: kill a host's first rank, or another (default: any rank)")
    ap.add_argument("--connect", choices=("eager", "lazy"), default="eager",
                    help="HETCCL_CONNECT of the ranks (the jobs start with no other HETCCL_* of this environment)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write a markdown report here")
    ap.add_argument("--keep", action="store_true", help="keep every trial's rank output (failed ones always are)")
    args = ap.parse_args(argv)
    if args.ranks is not None and not 2 <= args.ranks <= 64:
        ap.error("--ranks must be 2-64")
    if args.victim_kind != "any" and (args.per_host < 2 or args.ranks is None):
        ap.error("--victim-kind needs --ranks and --per-host of 2 or more")
    if args.victim is not None and not 0 <= args.victim < (args.ranks or 2):
        ap.error("--victim must be a rank of the job: below --ranks (below 2 when the job size is random)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    transports = [t for t in args.transports.split(",") if t]
    base = Path(tempfile.mkdtemp(prefix="hetccl-faults-"))
    plan = []
    for t in transports:
        plan += [("dead", t)] * args.trials + [("stuck", t)] * args.stuck_trials
    lines = [f"# fault trials ({time.strftime('%Y-%m-%d %H:%M')}, seed {seed}, HETCCL_CONNECT={args.connect}, "
             f"{platform.node()}, "
             f"{os.cpu_count()} CPUs, python {platform.python_version()})", "",
             f"Dead peer: SIGKILL from the driver; pass = every survivor raises PeerLostError naming the dead rank "
             f"within {DETECT_LIMIT:.0f} s, exits 0 within {EXIT_LIMIT:.0f} s, nothing of the job left "
             f"(/dev/shm, listening TCP ports, Unix sockets). Stuck: pass = CollectiveTimeout within "
             f"HETCCL_TIMEOUT={STUCK_TIMEOUT:.0f} s + {STUCK_MARGIN:.0f} s. Times in seconds after the kill "
             f"(or after the stuck rank's last collective), the slowest survivor.", "",
             "| # | transport | fault | ranks | victim | moment | error after | exit after | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    results = []
    t0 = time.monotonic()
    for i, (kind, t) in enumerate(plan, 1):
        wd = base / f"{i:03d}-{kind}-{t}"
        extra = {"HETCCL_CONNECT": args.connect}
        res = (dead_peer_trial(t, rng, wd, args.ranks, args.victim, args.per_host, args.victim_kind, extra)
               if kind == "dead" else
               stuck_trial(t, rng, wd, extra))
        results.append(res)
        if res["ok"] and not args.keep:
            shutil.rmtree(wd, ignore_errors=True)
        row = (f"| {i} | {t} | {res['kind']} | {res['n']} | {res['victim']} | {res['moment']} | "
               f"{_fmt(res['detect'])} | {_fmt(res['exit'])} | "
               f"{'ok' if res['ok'] else 'FAIL: ' + res['why'].replace('|', '/')} |")
        lines.append(row)
        print(row, flush=True)
    summary = []
    for kind in ("kill -9", "stuck"):
        parts = []
        for t in transports:
            rs = [r for r in results if r["transport"] == t and r["kind"] == kind]
            if rs:
                parts.append(f"{t} {sum(r['ok'] for r in rs)}/{len(rs)}")
        if parts:
            summary.append(("" if kind == "kill -9" else "stuck: ") + ", ".join(parts))
    stats = []
    for kind in ("kill -9", "stuck"):
        d = [r["detect"] for r in results if r["kind"] == kind and r["detect"] is not None]
        e = [r["exit"] for r in results if r["kind"] == kind and r["exit"] is not None]
        if d:
            stats.append(f"{kind}: error after max {max(d):.2f} s (median {sorted(d)[len(d) // 2]:.2f} s), "
                         f"exit after max {max(e) if e else float('nan'):.2f} s")
    tail = ["", *summary, "", *stats, f"total {time.monotonic() - t0:.0f} s; rank output kept under {base}"
            if any(not r["ok"] for r in results) or args.keep else f"total {time.monotonic() - t0:.0f} s"]
    print("\n".join(tail), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines + tail) + "\n")
    if not any(os.scandir(base)):
        base.rmdir()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
