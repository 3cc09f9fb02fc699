"""Rank 0's loss per step for each variant of a `benchmarks/fsdp_step.py --json` run, in one PNG (needs matplotlib).

    python benchmarks/fsdp_step.py --only ddp --variants "hetccl hosts,hetccl hosts fp8,hetccl hosts fp8 ef" \\
        --steps 200 --json ddp.json
    python benchmarks/plot_losses.py ddp.json --part ddp --out ddp-losses.png

Beside the curves, each variant's last-50-step mean loss against the first variant's (relative), which is what
compression's error does to training.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="fsdp_step.py --json output")
    ap.add_argument("--part", default="ddp", help="fsdp or ddp")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--tail", type=int, default=50, help="steps averaged for the comparison")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(a.json).read_text())
    curves = {name: res[a.part]["losses"] for name, res in data["results"].items() if a.part in res}
    if not curves:
        raise SystemExit(f"no variant of {a.json} has a {a.part} part")
    first = next(iter(curves))
    ref = statistics.fmean(curves[first][-a.tail:])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in curves.items():
        tail = statistics.fmean(losses[-a.tail:])
        ax.plot(range(len(losses)), losses, label=f"{name}: last {a.tail} {tail:.5f} ({(tail - ref) / ref:+.3%})",
                linewidth=1)
        print(f"{name}: {len(losses)} steps, mean of the last {a.tail} {tail:.6f}, {(tail - ref) / ref:+.4%} "
              f"against {first}")
    ax.set_xlabel("step (warm-up included)")
    ax.set_ylabel("loss, rank 0")
    ax.set_title(f"{a.part}: rank 0's loss per step, {Path(a.json).name}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"plot: {a.out}")


if __name__ == "__main__":
    main()
