"""GPU all_reduce, hetccl vs its anchors, side by side in one run on the GPU machine (2 GPUs).

(a) one island: hetccl (NCCL inside the island) vs torch.distributed "nccl";
(b) two islands (HETCCL_ISLAND=nvidia-a / nvidia-b): hetccl's cross-island path (host-staged over its own
    transports) vs NCCL with peer-to-peer disabled (its host shared-memory path, NCCL_P2P_DISABLE=1) and vs
    torch Gloo on CUDA tensors.
Writes a markdown table (busbw GB/s; time for the smallest size) to --out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run(name: str, backend: str, extra_env: dict[str, str], islands: str, args: argparse.Namespace,
        tmp: Path) -> list[dict]:
    out = tmp / f"{name}.json"
    env = dict(os.environ, **SAFE, **extra_env)
    env.setdefault("HETCCL_TIMEOUT", "60")
    cmd = [sys.executable, "-m", "hetccl", "run", "-n", str(args.nprocs), "--", sys.executable,
           str(HERE / "gpu_rank.py"), "--backend", backend, "--json", str(out), "--max-bytes", str(args.max_bytes),
           "--min-bytes", str(args.min_bytes),
           "--iters", str(args.iters)]
    if islands:
        cmd += ["--islands", islands]
    print(f"== {name}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
        return []
    rows = json.loads(out.read_text())
    for r in rows:
        print(f"  {r['size']:>11} B  {r['time_us']:10.1f} us  busbw {r['busbw']:8.2f} GB/s  wrong {r['wrong']}",
              flush=True)
    return rows


def table(title: str, cols: dict[str, list[dict]], ratio_of: tuple[str, str] | None) -> str:
    names = list(cols)
    sizes = sorted({r["size"] for rows in cols.values() for r in rows})
    lines = [f"### {title}", "", "| size | " + " | ".join(f"{n} busbw (GB/s)" for n in names)
             + (f" | {ratio_of[0]} / {ratio_of[1]} |" if ratio_of else " |"),
             "|---|" + "---|" * (len(names) + (1 if ratio_of else 0))]
    for s in sizes:
        vals = {n: next((r for r in cols[n] if r["size"] == s), None) for n in names}
        cells = []
        for n in names:
            r = vals[n]
            cells.append("—" if r is None else (f"{r['busbw']:.2f} ({r['time_us']:.0f} us)" if s <= 65536
                                                 else f"{r['busbw']:.2f}") + ("" if not r or not r["wrong"]
                                                                              else f" WRONG {r['wrong']}"))
        ratio = ""
        if ratio_of and vals[ratio_of[0]] and vals[ratio_of[1]]:
            ratio = f" | {vals[ratio_of[0]]['busbw'] / vals[ratio_of[1]]['busbw']:.2f}x"
        elif ratio_of:
            ratio = " | —"
        label = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
        lines.append(f"| {label} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=str(HERE / "results" / "gpu.md"))
    p.add_argument("--skip-gloo", action="store_true")
    p.add_argument("--only", choices=["one", "two"], default=None, help="run one part of the comparison")
    p.add_argument("--two-variant", action="append", default=[], metavar="LABEL:VAR=VAL[,VAR=VAL]",
                   help="an extra two-island hetccl column run with these environment settings (repeatable)")
    args = p.parse_args()
    n = args.nprocs
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one: dict[str, list[dict]] = {}
        two: dict[str, list[dict]] = {}
        if args.only != "two":
            one["hetccl (1 island)"] = run("hetccl-1island", "hetccl", {}, ",".join(["nvidia"] * n), args, tmp)
            one["torch nccl"] = run("torch-nccl", "torch-nccl", {}, "", args, tmp)
        if args.only != "one":
            two["hetccl (2 islands)"] = run("hetccl-2islands", "hetccl", {},
                                            ",".join(f"nvidia-{'ab'[i % 2]}" for i in range(n)), args, tmp)
            for spec in args.two_variant:
                label, _, settings = spec.partition(":")
                env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
                two[f"hetccl {label}"] = run(f"hetccl-2islands-{len(two)}", "hetccl", env,
                                             ",".join(f"nvidia-{'ab'[i % 2]}" for i in range(n)), args, tmp)
            two["nccl P2P off (shm)"] = run("nccl-nop2p", "torch-nccl", {"NCCL_P2P_DISABLE": "1"}, "", args, tmp)
        if not args.skip_gloo and args.only != "one":
            two["torch gloo (CUDA tensors)"] = run("torch-gloo", "torch-gloo", {}, "", args, tmp)
    import torch

    head = (f"GPU all_reduce float32, {n} ranks, {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
            f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}\n\n")
    text = head
    if one:
        text += table("(a) one island: hetccl vs NCCL", one, ("hetccl (1 island)", "torch nccl")) + "\n"
    if two:
        text += table("(b) two islands: hetccl's cross-island path vs NCCL without peer-to-peer, and Gloo", two,
                      ("hetccl (2 islands)", "nccl P2P off (shm)"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
