#!/usr/bin/env python3
"""Soak: a real multi-rank job runs mixed, checked collectives for --minutes while the driver samples every
rank's RSS (/proc/PID/status VmRSS) and open file descriptors (/proc/PID/fd) every --interval seconds.

Each round (the same on every rank, from one seed): every collective x one dtype (rotating through all 8)
x every reduce op at a size drawn from 0..300,000 elements (tests/workers.py:matrix, results checked
against numpy), a split sub-communicator created, used and closed, point-to-point exchanges, and 8
collectives in flight at once. Rank 0 decides when to stop (a broadcast), so every rank runs the same rounds.

Fails (exit 1) when, after the warm-up (the first --warmup fraction of the run), a rank's RSS between rounds
(reported by the rank itself after each round, its buffers freed) grows by more than --rss-growth (10 %) over
its warm-up peak, or its open fds between rounds rise above their warm-up peak at all, or a rank fails or a
result is wrong. The driver's own samples (RSS and fds at random moments, a round's transient buffers and
sockets included) are reported too; they are not the verdict, because a short run under load may not meet its
largest in-flight working set in the warm-up, and a round in flight holds an fd more at times.

    nice -n 10 python benchmarks/soak.py --minutes 10 --ranks 3 --out benchmarks/results/soak.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from rankproc import Job, fd_count, finish_report, rss_kib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--transports", default="shm,tcp", help="HETCCL_TRANSPORTS for the job")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of the run that is warm-up")
    ap.add_argument("--rss-growth", type=float, default=0.10, help="allowed RSS growth after warm-up")
    ap.add_argument("--nice", type=int, default=0, help="run the ranks under nice -n N")
    ap.add_argument("--out", type=Path, default=None, help="also write a markdown report here")
    args = ap.parse_args(argv)
    duration = args.minutes * 60
    wd = Path(tempfile.mkdtemp(prefix="hetccl-soak-"))
    job = Job.spawn(args.ranks, "fault_ranks:soak", {"HETCCL_TRANSPORTS": args.transports}, wd, nice=args.nice,
                    duration_s=duration)
    ranks = list(range(args.ranks))
    samples: list[tuple[float, list[int | None], list[int | None]]] = []
    why: list[str] = []
    try:
        if not job.wait_event(ranks, "ready", 90):
            why.append("ranks did not start: " + " | ".join(job.stderr_tail(r, 500) for r in ranks))
        else:
            t0 = time.monotonic()
            while any(p.poll() is None for p in job.procs):
                samples.append((time.monotonic() - t0, [rss_kib(p) for p in job.pids],
                                [fd_count(p) for p in job.pids]))
                if time.monotonic() - t0 > duration + 120:
                    why.append("the job did not finish within 2 minutes of its end")
                    break
                end = time.monotonic() + args.interval
                while time.monotonic() < end and any(p.poll() is None for p in job.procs):
                    time.sleep(0.1)
            job.wait_exit(ranks, 30)
    finally:
        job.kill_all()
    rounds = []
    for r in ranks:
        done = job.event(r, "done")
        rounds.append(done["rounds"] if done else None)
        if job.procs[r].returncode != 0 or done is None:
            why.append(f"rank {r} exited {job.procs[r].returncode} without finishing: {job.stderr_tail(r, 1500)}")
    # growth after warm-up, per rank, from samples taken while every rank ran the loop
    full = [s for s in samples if all(v is not None for v in s[1] + s[2])]
    split = args.warmup * duration
    warm = [s for s in full if s[0] <= split]
    after = [s for s in full if s[0] > split]
    table = []
    if not warm or not after:
        why.append(f"too few samples ({len(warm)} in warm-up, {len(after)} after)")
    else:
        for r in ranks:
            rss_w, rss_a = max(s[1][r] for s in warm), max(s[1][r] for s in after)
            rounds_seen = [e for e in job.events(r) if e["kind"] == "round" and e.get("rss")]
            between = [(e["t"] - t0, e["rss"]) for e in rounds_seen]
            q_w = [v for t, v in between if t <= split]
            q_a = [v for t, v in between if t > split]
            fds = [(e["t"] - t0, e["fds"]) for e in rounds_seen if e.get("fds")]
            fd_w = max((v for t, v in fds if t <= split), default=0)
            fd_a = max((v for t, v in fds if t > split), default=0)
            if not q_w or not q_a:
                why.append(f"rank {r}: too few rounds to judge ({len(q_w)} in warm-up, {len(q_a)} after)")
                continue
            growth = max(q_a) / max(q_w) - 1
            table.append((r, max(q_w), max(q_a), growth, rss_w, rss_a, fd_w, fd_a, after[-1][1][r], after[-1][2][r]))
            if growth > args.rss_growth:
                why.append(f"rank {r}: RSS between rounds grew {100 * growth:.1f} % after warm-up "
                           f"({max(q_w)} -> {max(q_a)} KiB)")
            if fd_a > fd_w:
                why.append(f"rank {r}: open fds grew after warm-up ({fd_w} -> {fd_a})")
    lines = [f"# soak ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, "
             f"python {platform.python_version()})", "",
             f"{args.ranks} ranks, HETCCL_TRANSPORTS={args.transports}, {args.minutes:g} min, nice {args.nice}, "
             f"sampled every {args.interval:g} s ({len(samples)} samples), warm-up = first "
             f"{100 * args.warmup:.0f} %. Limits after warm-up: RSS between rounds +{100 * args.rss_growth:.0f} % "
             f"over its warm-up peak, fds +0.", "",
             f"Rounds completed per rank: {rounds}", "",
             "| rank | RSS between rounds, warm-up peak (KiB) | after (KiB) | growth | sampled RSS, warm-up peak "
             "| after | fds between rounds, warm-up peak | after | RSS last | fds last |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r, q_w, q_a, g, rss_w, rss_a, fd_w, fd_a, rss_l, fd_l in table:
        sampled = f"{rss_a} ({100 * (rss_a / rss_w - 1):+.1f} %)"
        lines.append(f"| {r} | {q_w} | {q_a} | {100 * g:+.1f} % | {rss_w} | {sampled} | {fd_w} | {fd_a} | {rss_l} "
                     f"| {fd_l} |")
    lines += ["", "Samples (seconds: RSS KiB per rank / fds per rank), every 6th:", "", "```"]
    for s in samples[::6] + samples[-1:]:
        lines.append(f"{s[0]:7.1f}: {s[1]} / {s[2]}")
    lines.append("```")
    return finish_report(lines, why, args.out, wd)


if __name__ == "__main__":
    sys.exit(main())
