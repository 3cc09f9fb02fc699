"""Balanced data parallelism (hetccl.torch.balance) on this machine's CPUs, side by side in one run.

Runs examples/train_balanced.py under torchrun through hetccl, interleaving the variants repetition by
repetition, and prints a Markdown table of median samples/s:

- each island alone (one rank, the fast one and the slowed one), their sum, and both alone at the same time (two
  jobs that share the machine's memory bandwidth and caches as the two ranks of one job do: the ceiling that
  contention leaves, beside the sum of the solo runs);
- two ranks, one of them `--slow-factor` times slower per sample: DDP as most scripts run it (DistributedSampler,
  `plain`), the equal split through the balancer, and `auto`;
- two ranks of equal speed: plain against auto (what auto costs when there is nothing to balance);
- drift: the rank slows down at step `--drift-at`; the steps until a 5-step window is back to 0.9x the samples/s
  of auto with that rank slow from the start.

    python benchmarks/balance_cpu.py                       # 2 ranks, slow factor 3, 3 repetitions
    python benchmarks/balance_cpu.py --reps 5 --steps 80
    python benchmarks/balance_cpu.py --cpus 0-11/12-15 --slow-factor 1    # islands of 12 and 4 cores
    python benchmarks/balance_cpu.py --gpu --cpus 0-3/4-15    # a GPU island and a 12-core CPU island

With --cpus every two-rank job runs pinned, so its "equal speeds" rows are the islands' own speeds.
The table's last column is the global batch over the median timed step (a few slow steps weigh in samples/s,
the timed steps' mean, and not there); a line above it says at which step auto last changed its shares, which
should come before the timed steps (`--skip` of the example, 25): otherwise raise --steps. `--keep DIR` keeps
every job's JSON (each step's time, the shares over time and why).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_balanced.py"


def _command(n: int, extra: list[str], out: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), str(EXAMPLE),
           "--json", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return cmd, env


def run(n: int, extra: list[str], out: Path, timeout: float) -> dict:
    return run_together([(n, extra)], [out], timeout)[0]


def run_together(jobs: list[tuple[int, list[str]]], outs: list[Path], timeout: float) -> list[dict]:
    """The jobs at once (each its own torchrun), their JSONs; a failure or the timeout ends all of them."""
    procs = []
    try:
        for (n, extra), out in zip(jobs, outs, strict=True):
            cmd, env = _command(n, extra, out)
            procs.append((cmd, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)))
        for cmd, proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}")
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(out.read_text()) for out in outs]


def recovery(steps: list[float], batch: int, at: int, ideal: float, window: int = 5) -> int | None:
    """Steps after `at` until a window of `window` steps runs at >= 0.9x `ideal` samples/s."""
    for k in range(at, len(steps) - window + 1):
        if batch * window / sum(steps[k:k + window]) >= 0.9 * ideal:
            return k - at
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--drift-at", type=int, default=40)
    ap.add_argument("--drift-steps", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--cpus", default=None, help="two islands of CPUs pinned apart, e.g. 0-11/12-15 (the "
                    "slowed island is the second; alone, each runs on its own list)")
    ap.add_argument("--keep", default=None, help="a folder for every job's JSON (each step's time, the shares "
                    "over time and why), named <rep>-<run>.json")
    ap.add_argument("--gpu", action="store_true", help="rank 0 on the GPU, rank 1 on the CPU (the GPU machine): "
                    "the islands' own speeds, no slowed rank")
    ap.add_argument("--example-args", default="", help="more arguments for every job of the example, e.g. "
                    "'--width 1024 --global-batch 16384' (a model whose step is compute, not communication)")
    args = ap.parse_args()
    f = str(args.slow_factor)
    common = ["--steps", str(args.steps), *shlex.split(args.example_args)]
    pinned = ["--cpus", args.cpus] if args.cpus else []
    first, second = (["--cpus", c] for c in args.cpus.split("/")) if args.cpus else ([], [])
    gpu = ["--gpu-ranks", "0"]
    jobs = {
        "fast island alone": (1, [*common, *gpu, *first]),
        "slowed island alone": (1, [*common, *second]),
        "slowed: plain DDP": (2, [*common, *gpu, *pinned, "--shares", "plain"]),
        "slowed: equal split": (2, [*common, *gpu, *pinned, "--shares", "equal"]),
        "slowed: auto": (2, [*common, *gpu, *pinned, "--shares", "auto"]),
    } if args.gpu else {
        "fast island alone": (1, [*common, *first]),
        "slowed island alone": (1, [*common, *second, "--slow-rank", "0", "--slow-factor", f]),
        "slowed: plain DDP": (2, [*common, *pinned, "--shares", "plain", "--slow-rank", "1", "--slow-factor", f]),
        "slowed: equal split": (2, [*common, *pinned, "--shares", "equal", "--slow-rank", "1", "--slow-factor", f]),
        "slowed: auto": (2, [*common, *pinned, "--shares", "auto", "--slow-rank", "1", "--slow-factor", f]),
        "equal speeds: plain DDP": (2, [*common, *pinned, "--shares", "plain"]),
        "equal speeds: equal split": (2, [*common, *pinned, "--shares", "equal"]),
        "equal speeds: auto": (2, [*common, *pinned, "--shares", "auto"]),
        "drift": (2, [*pinned, *shlex.split(args.example_args), "--steps", str(args.drift_steps), "--shares",
                      "auto", "--slow-rank", "1",
                      "--slow-factor", f, "--drift-at", str(args.drift_at)]),
    }
    if args.drift_steps <= 0:  # --drift-steps 0: no drift job
        jobs.pop("drift", None)
    got: dict[str, list[dict]] = {k: [] for k in jobs}
    together: list[float] = []  # the two islands alone, run at once: what the machine gives them side by side
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, (n, extra) in jobs.items():
                res = run(n, extra, Path(tmp) / f"{rep}.json", args.timeout)
                got[name].append(res)
                if args.keep:
                    slug = "".join(c if c.isalnum() else "-" for c in name)
                    (Path(args.keep) / f"{rep}-{slug}.json").write_text(json.dumps(res, indent=1))
                print(f"# rep {rep} {name}: {res['samples_per_s']:.0f} samples/s, shares "
                      f"{res['shares'][-1]['shares']}", file=sys.stderr)
                if name == "slowed island alone":  # and both islands alone at the same time, sharing the machine
                    both = run_together([jobs["fast island alone"], jobs["slowed island alone"]],
                                        [Path(tmp) / f"{rep}-a.json", Path(tmp) / f"{rep}-b.json"], args.timeout)
                    rates = [r["samples_per_s"] for r in both]
                    together.append(sum(rates))
                    print(f"# rep {rep} both alone at once: {sum(rates):.0f} samples/s ({rates[0]:.0f} + "
                          f"{rates[1]:.0f})", file=sys.stderr)
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in got.items()}
    batch = got["slowed: auto"][0]["args"]["global_batch"]
    # the global batch over the median timed step: a few slow steps (a decision's collectives, a co-tenant)
    # weigh in samples/s (the timed steps' mean) and not here
    steady = {k: statistics.median(batch / statistics.median(r["step_seconds"][r["args"]["skip"]:]) for r in v)
              for k, v in got.items()}
    print(f"# {datetime.date.today()}, {os.cpu_count()} CPUs; python benchmarks/balance_cpu.py "
          f"{' '.join(sys.argv[1:])}".rstrip())
    print(f"# examples/train_balanced.py, global batch {batch}, medians of {args.reps} interleaved runs")
    settled = [r["shares"][-1]["step"] for r in got["slowed: auto"]]
    skip = got["slowed: auto"][0]["args"]["skip"]
    print(f"# slowed, auto: the last change of shares at step {settled}, timed from step {skip}"
          + (" (a change in the timed steps: raise --steps)" if max(settled) >= skip else "") + "\n")
    print("| run | samples/s | against | global batch / median step |")
    print("|---|---|---|---|")
    solo = med["fast island alone"] + med["slowed island alone"]
    print(f"| {'GPU island alone' if args.gpu else 'fast island alone'} | {med['fast island alone']:.0f} | | "
          f"{steady['fast island alone']:.0f} |")
    print(f"| {'CPU island alone' if args.gpu else f'slowed island alone (x{f})'} | "
          f"{med['slowed island alone']:.0f} | | {steady['slowed island alone']:.0f} |")
    print(f"| sum of the two | {solo:.0f} | | |")
    at_once = statistics.median(together)
    print(f"| both alone at once (two jobs sharing the machine) | {at_once:.0f} | {at_once / solo:.2f}x the sum | |")
    eq = med["slowed: equal split"]
    for k in ("slowed: plain DDP", "slowed: equal split", "slowed: auto"):
        shown = k.replace("slowed: ", "GPU + CPU: ") if args.gpu else k
        print(f"| {shown} | {med[k]:.0f} | {med[k] / eq:.2f}x the equal split, {med[k] / solo:.2f}x the sum, "
              f"{med[k] / at_once:.2f}x both at once | {steady[k]:.0f} |")
    if args.gpu:
        return
    pl = med["equal speeds: plain DDP"]
    for k in ("equal speeds: plain DDP", "equal speeds: equal split", "equal speeds: auto"):
        print(f"| {k} | {med[k]:.0f} | {med[k] / pl:.3f}x plain | {steady[k]:.0f} |")
    if "drift" not in got:
        return
    ideal = med["slowed: auto"]
    rec = [recovery(r["step_seconds"], batch, args.drift_at, ideal) for r in got["drift"]]
    shares = [r["shares"][-1]["shares"] for r in got["drift"]]
    print(f"\ndrift: rank 1 slowed x{f} from step {args.drift_at}; steps until 5 steps run at >= 0.9x the "
          f"slowed auto's {ideal:.0f} samples/s: {rec}; final shares {shares}")


if __name__ == "__main__":
    main()
