"""DDP step time, hetccl vs Gloo (and NCCL on GPUs), side by side in one run.

    .venv/bin/python benchmarks/ddp_compare.py                      # CPU: hetccl and gloo, 2 ranks
    .venv/bin/python benchmarks/ddp_compare.py --quick              # smoke test (~1 min)
    .venv/bin/python benchmarks/ddp_compare.py --device cuda        # GPUs: hetccl, nccl and gloo, one GPU per rank

Each run launches `hetccl run -n N -- python benchmarks/ddp_compare.py --worker ...` (so the same launcher
and environment for every backend) and trains an MLP whose gradients are large enough for communication to
matter (default 6 x Linear(2048, 2048): 96 MiB of fp32 gradients, in DDP buckets of --bucket-mb MiB) on fixed
random data. Per step: zero_grad, forward, backward (DDP all-reduces the buckets while backward runs and waits
for them at its end), SGD step; on CUDA bracketed by synchronize. A step's time is the slowest rank's; the
table gives the median over every timed step of every repetition, the per-repetition medians, and the ratio
to Gloo. A "compute only" row runs the same steps under `ddp.no_sync()` (no gradient communication at all),
so step - compute is what communication costs after overlap. Backends alternate within a repetition and the
order flips every repetition; a contention guard (cpuguard.py) waits for foreign load to clear before each
run, runs a contended run again (--guard-redo times, keeping the quietest) and reports the foreign load seen.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# ---------------------------------------------------------------------------------------------- worker
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    if a.backend == "hetccl" or a.hook != "none":
        import hetccl.torch  # noqa: F401
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=a.bucket_mb)
    if a.hook != "none":
        from hetccl.torch import hooks

        ddp.register_comm_hook(None, hooks.allreduce_hook if a.hook == "allreduce"
                               else getattr(hooks, f"{a.hook}_compress_hook"))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(a.batch, a.width, generator=gen).to(dev)
    y = torch.randn(a.batch, a.width, generator=gen).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()

    times = []
    for i in range(a.warmup + a.steps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        if a.no_sync:
            with ddp.no_sync():
                step()
        else:
            step()
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    mine = torch.tensor(times, dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    slowest = torch.stack(every).max(0).values.tolist()
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with open(a.json_out, "w") as f:
            json.dump({"backend": a.backend, "hook": a.hook, "no_sync": a.no_sync, "step_s": slowest,
                       "grad_bytes": grad_bytes, "world": world, "torch": torch.__version__}, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver
def run_one(a: argparse.Namespace, backend: str, hook: str, no_sync: bool, guard) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        out = tf.name
    cmd = [a.python, "-m", "hetccl", "run", "-n", str(a.nprocs), "--", a.python, str(Path(__file__).resolve()),
           "--worker", "--backend", backend, "--hook", hook, "--device", a.device, "--width", str(a.width),
           "--layers", str(a.layers), "--batch", str(a.batch), "--bucket-mb", str(a.bucket_mb),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads), "--json-out", out]
    if no_sync:
        cmd.append("--no-sync")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HETCCL_TIMEOUT", "120")
    if a.device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if guard is not None:
        guard.wait_quiet(a.guard_thresh, a.guard_wait, log=lambda m: print("  guard: " + m, flush=True))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.run_timeout)
    t1 = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{backend} (hook {hook}) failed with exit code {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    res["foreign_pct"], res["foreign_top"] = guard.foreign_over(t0, t1) if guard is not None else (0.0, "")
    return res


def label(backend: str, hook: str, no_sync: bool) -> str:
    if no_sync:
        return "compute only (`no_sync`)"
    return backend if hook == "none" else f"{backend}, {hook} hook"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="hetccl", help=argparse.SUPPRESS)
    ap.add_argument("--hook", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--no-sync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backends", default="", help="comma list (default: hetccl,gloo on cpu; hetccl,nccl,gloo on cuda)")
    ap.add_argument("--hooks", default="none", help="comma list of DDP comm hooks: none, allreduce, fp16, bf16")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (DDP's default 25)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / nprocs, at least 1)")
    ap.add_argument("--quick", action="store_true", help="1 rep, 8 steps, 3 layers (not for citing)")
    ap.add_argument("--no-compute-row", action="store_true", help="skip the no_sync (compute only) run")
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--guard-thresh", type=float, default=25.0, help="foreign CPU %% of one core counted as quiet")
    ap.add_argument("--guard-wait", type=float, default=60.0, help="seconds to wait for quiet before a run")
    ap.add_argument("--guard-redo", type=int, default=2, help="reruns of a run that saw more foreign CPU than that")
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", default="", help="markdown report (default benchmarks/results/ddp-<device>-<date>.md)")
    a = ap.parse_args()
    if not a.threads:
        a.threads = max(1, (os.cpu_count() or 1) // a.nprocs)
    if a.worker:
        worker(a)
        return

    if a.quick:
        a.reps, a.steps, a.layers = 1, 8, 3
    default_backends = "hetccl,nccl,gloo" if a.device == "cuda" else "hetccl,gloo"
    backends = [b for b in (a.backends or default_backends).split(",") if b]
    hooks = [h for h in a.hooks.split(",") if h]
    guard = None
    if not a.no_guard and a.device == "cpu":
        sys.path.insert(0, str(HERE))
        from cpuguard import CpuGuard

        guard = CpuGuard(interval=1.0)
        guard.start()

    configs = [(b, h, False) for h in hooks for b in backends]
    if not a.no_compute_row:
        configs.append(("gloo" if "gloo" in backends else backends[0], "none", True))
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for rep in range(a.reps):
        order = configs if rep % 2 == 0 else configs[::-1]
        for c in order:
            r = run_one(a, *c, guard)
            for _ in range(a.guard_redo if guard is not None else 0):  # contended: run it again, keep the quietest
                if r["foreign_pct"] <= a.guard_thresh:
                    break
                print(f"  guard: {label(*c)} ran beside {r['foreign_pct']:.0f}% foreign CPU ({r['foreign_top']}); "
                      "running it again", flush=True)
                again = run_one(a, *c, guard)
                r = min(r, again, key=lambda x: x["foreign_pct"])
            runs[c].append(r)
            med = statistics.median(r["step_s"]) * 1e3
            print(f"rep {rep + 1}/{a.reps} {label(*c):28s} median step {med:8.1f} ms  "
                  f"(foreign CPU {r['foreign_pct']:.0f}% of a core)", flush=True)

    first = next(iter(runs.values()))[0]
    gib = first["grad_bytes"] / 2**20
    ref_key = ("gloo", "none", False)
    rows, meds = [], {}
    for c, rs in runs.items():
        allsteps = [t for r in rs for t in r["step_s"]]
        meds[c] = statistics.median(allsteps)
    compute = next((meds[c] for c in runs if c[2]), None)
    for c, rs in runs.items():
        med = meds[c]
        per = ", ".join(f"{statistics.median(r['step_s']) * 1e3:.0f}" for r in rs)
        ref = meds.get(ref_key) if not c[2] else None
        ratio = f"{ref / med:.2f}x" if ref else ""
        comm = f"{(med - compute) * 1e3:.0f}" if compute is not None and not c[2] else ""
        foreign = max(r["foreign_pct"] for r in rs)
        rows.append(f"| {label(*c)} | {med * 1e3:.1f} | {per} | {ratio} | {comm} | {foreign:.0f}% |")

    date = datetime.date.today().isoformat()
    machine = f"{os.cpu_count()} cores {platform.machine()}" if a.device == "cpu" else "CUDA"
    head = (f"### DDP step time ({date}, {machine}, {a.device}, {a.nprocs} ranks, torch {first['torch']}, "
            "`benchmarks/ddp_compare.py`)\n\n"
            f"MLP {a.layers} x Linear({a.width}, {a.width}), batch {a.batch} per rank, {gib:.0f} MiB of fp32 "
            f"gradients in DDP buckets of {a.bucket_mb:g} MiB, {a.threads} torch thread(s) per rank; "
            f"{a.reps} repetition(s) x {a.steps} timed steps (+{a.warmup} warm-up). Step = slowest rank's "
            "zero_grad + forward + backward (with DDP's all-reduce) + SGD step. Speed-up vs Gloo = Gloo's median "
            "/ this median (> 1: faster than Gloo); communication = median - compute-only median, what the "
            "all-reduce adds after overlapping with backward.\n\n"
            "| backend | median step (ms) | per-repetition medians (ms) | speed-up vs Gloo | communication (ms) "
            "| foreign CPU (max) |\n|---|---|---|---|---|---|\n")
    report = head + "\n".join(rows) + "\n"
    print("\n" + report)
    out = Path(a.out) if a.out else HERE / "results" / ("raw" if a.quick else "") / f"ddp-{a.device}-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
