"""The torch path on GPUs, hetccl against NCCL, side by side in one run (2 GPUs, torchrun, every GPU visible).

    python benchmarks/torch_gpu_bench.py --out results.md [--quick]

Each variant is one `torchrun --standalone --nproc-per-node 2` job (one process for "single GPU") running, through
torch.distributed alone:
- all_reduce busbw, nccl-tests style: a barrier and a device synchronise, k all_reduces back to back, one
  synchronise; time of one = elapsed / k, the slowest rank's; median of --reps repetitions; the first result of
  each size checked;
- DDP step time of a ~100M-parameter transformer (8 encoder layers, d_model 1024) with bf16 autocast: median
  of the timed steps, each bracketed by synchronise; scaling efficiency = 2-GPU throughput / (2 x single-GPU
  throughput), the source article's metric.

Variants: NCCL (default, P2P off, sockets only) and hetccl (one island; two and three islands over the zero-copy
link, host staging over shm, TCP between islands, and islands acting as other hosts with HETCCL_HOST). With fewer
GPUs than ranks, ranks share the GPUs round-robin (hetccl's islands of one rank each can; NCCL's ranks cannot)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TWO = {"TEST_ISLANDS": "nvidia-0,nvidia-1"}
THREE = {"TEST_ISLANDS": "nvidia-0,nvidia-1,nvidia-2"}
FOUR = {"TEST_ISLANDS": "nvidia-0,nvidia-1,nvidia-2,nvidia-3"}
VARIANTS: dict[str, tuple[str, int, dict[str, str]]] = {
    "single GPU": ("none", 1, {}),
    "nccl": ("nccl", 2, {}),
    "nccl P2P off": ("nccl", 2, {"NCCL_P2P_DISABLE": "1"}),
    "nccl socket": ("nccl", 2, {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
    "hetccl one island": ("hetccl", 2, {}),
    "hetccl 2 islands, link": ("hetccl", 2, TWO),
    "hetccl 2 islands, shm": ("hetccl", 2, {**TWO, "HETCCL_PAIRLINK": "0"}),
    "hetccl 2 islands, tcp": ("hetccl", 2, {**TWO, "HETCCL_PAIRLINK": "0", "HETCCL_TRANSPORTS": "tcp"}),
    "hetccl 2 islands, shm, gather": ("hetccl", 2, {**TWO, "HETCCL_PAIRLINK": "0", "HETCCL_STAGED_RING": "0"}),
    "hetccl 2 islands, tcp, gather": ("hetccl", 2, {**TWO, "HETCCL_PAIRLINK": "0", "HETCCL_TRANSPORTS": "tcp",
                                                    "HETCCL_STAGED_RING": "0"}),
    "hetccl 2 islands, other hosts": ("hetccl", 2, {**TWO, "HETCCL_HOST": "h0,h1"}),
    "hetccl 2 islands, other hosts, gather": ("hetccl", 2, {**TWO, "HETCCL_HOST": "h0,h1", "HETCCL_STAGED_RING": "0"}),
    "hetccl 3 islands, link": ("hetccl", 3, THREE),
    "hetccl 3 islands, shm": ("hetccl", 3, {**THREE, "HETCCL_PAIRLINK": "0"}),
    "hetccl 3 islands, tcp": ("hetccl", 3, {**THREE, "HETCCL_PAIRLINK": "0", "HETCCL_TRANSPORTS": "tcp"}),
    "hetccl 3 islands, other hosts": ("hetccl", 3, {**THREE, "HETCCL_HOST": "h0,h1,h2"}),
    "hetccl 3 islands, other hosts, gather": ("hetccl", 3, {**THREE, "HETCCL_HOST": "h0,h1,h2",
                                                             "HETCCL_STAGED_RING": "0"}),
    "hetccl 4 islands, other hosts": ("hetccl", 4, {**FOUR, "HETCCL_HOST": "h0,h1,h2,h3"}),
    "hetccl 4 islands, other hosts, gather": ("hetccl", 4, {**FOUR, "HETCCL_HOST": "h0,h1,h2,h3",
                                                             "HETCCL_STAGED_RING": "0"}),
}


# ------------------------------------------------------------------------------------------------ worker
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # ranks share the GPUs round-robin when there are more ranks than GPUs (islands of one rank each may share one
    # GPU; NCCL cannot, so the NCCL variants need a GPU per rank)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("TEST_ISLANDS"):
        os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[rank]
    out: dict = {"sweep": [], "ddp_ms": []}
    if a.backend != "none":
        if a.backend == "hetccl":
            import hetccl.torch  # noqa: F401
        dist.init_process_group(a.backend)
        for size in a.sizes:
            out["sweep"].append(sweep_point(torch, dist, dev, size, world, a.reps))
    if a.steps > 0:
        out["ddp_ms"] = ddp_steps(torch, dist if a.backend != "none" else None, dev, a.steps)
    if rank == 0:
        Path(a.json).write_text(json.dumps(out))
    if a.backend != "none":
        dist.barrier()
        dist.destroy_process_group()


def sweep_point(torch, dist, dev, size: int, world: int, reps: int) -> dict:
    n = size // 4
    t = torch.ones(n, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if t[0].item() != world or t[-1].item() != world:
        raise SystemExit(f"all_reduce of {size} bytes gave {t[0].item()}, want {world}")
    t0 = time.perf_counter()
    dist.all_reduce(t)
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    k = torch.tensor([max(5, min(200, int(0.25 / max(one, 1e-6))))], device=dev)
    dist.broadcast(k, 0)  # every rank runs the same count
    k = int(k.item())
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        el = torch.tensor([(time.perf_counter() - t0) / k], device=dev, dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        times.append(el.item())
    med = statistics.median(times)
    return {"bytes": size, "us": med * 1e6, "busbw": size / med / 1e9 * 2 * (world - 1) / world, "iters": k}


def ddp_steps(torch, dist, dev, steps: int) -> list[float]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 8), torch.nn.Linear(1024, 1024)).to(dev)
    if dist is not None:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, 256, 1024, device=dev)
    y = torch.randn(8, 256, 1024, device=dev)
    out = []
    for i in range(steps + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 5:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# ------------------------------------------------------------------------------------------------ driver
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--backend", default="hetccl")
    p.add_argument("--json", default="")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ;")
    p.add_argument("--out", default="")
    p.add_argument("--timeout", type=float, default=240)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants.split(";"):
            backend, n, extra = VARIANTS[name]
            js = Path(tmp) / "r.json"
            js.unlink(missing_ok=True)
            env = dict(os.environ, **SAFE, **extra)
            env.setdefault("HETCCL_TIMEOUT", "60")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   __file__, "--worker", "--backend", backend, "--json", str(js), "--reps", str(a.reps),
                   "--steps", str(a.steps), "--sizes", ",".join(map(str, a.sizes))]
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            print(f"== {name}: rc {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
            if proc.returncode != 0 or not js.exists():
                print(proc.stdout[-1500:], proc.stderr[-3000:], flush=True)
                continue
            results[name] = json.loads(js.read_text())
            for row in results[name]["sweep"]:
                print(f"   {row['bytes']:>10} B  {row['us']:10.1f} us  {row['busbw']:7.2f} GB/s", flush=True)
            if results[name]["ddp_ms"]:
                print(f"   DDP step {statistics.median(results[name]['ddp_ms']):.2f} ms", flush=True)
    report = table(results, a.sizes)
    print(report)
    if a.out:
        Path(a.out).write_text(report + "\n\n```json\n" + json.dumps(results) + "\n```\n")


def table(results: dict[str, dict], sizes: list[int]) -> str:
    from hetccl.bench import size_label

    lines = ["| all_reduce via torch.distributed | " + " | ".join(size_label(s) for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name, res in results.items():
        if not res["sweep"]:
            continue
        cells = [f"{r['us']:.1f} us" if r["bytes"] <= 64 << 10 else f"{r['busbw']:.1f} GB/s" for r in res["sweep"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    results = {k: v for k, v in results.items() if v["ddp_ms"]}  # --steps 0: all_reduce alone
    if not results:
        return "\n".join(lines)
    single = statistics.median(results["single GPU"]["ddp_ms"]) if "single GPU" in results else None
    nccl = statistics.median(results["nccl"]["ddp_ms"]) if "nccl" in results else None
    lines += ["", "| DDP step, 100M transformer, bf16 autocast | median ms | scaling efficiency | step vs NCCL |",
              "|---|---|---|---|"]
    for name, res in results.items():
        ms = statistics.median(res["ddp_ms"])
        eff = f"{single / ms * 100:.0f} %" if single and name != "single GPU" else "-"
        vs = f"{ms / nccl:.3f}x" if nccl and name != "single GPU" else "-"
        lines.append(f"| {name} | {ms:.2f} | {eff} | {vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
