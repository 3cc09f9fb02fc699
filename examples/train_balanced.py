"""Data-parallel training whose ranks take uneven shares of each global batch (hetccl.torch.balance).

A compute-bound MLP on synthetic regression data, DDP through hetccl on the CPU. `--slow-rank R --slow-factor F`
makes rank R F times slower per sample (its forward sleeps F - 1 times its forward and backward's measured
cost), so that islands of different speed can be shown on one machine.

    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --shares auto --slow-rank 1 --slow-factor 3
    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --shares equal --slow-rank 1 --slow-factor 3
    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --shares 24,8 --global-batch 32
    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --gpu-ranks 0   # a GPU and a CPU island
    python examples/train_balanced.py --reference        # one process over the same global batches

`--shares plain` is DDP as most scripts use it (DistributedSampler, equal batches, no hetccl.torch.balance).
`--json PATH` writes samples/s (after the first `--skip` steps, 25), each step's time, the shares over time and
the final loss (rank 0). `--drift-at K` slows `--slow-rank` only from step K (a rank that slows down mid-run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hetccl.torch import balance


class Synthetic(Dataset):
    """Regression data held as two tensors; `__getitems__` hands the DataLoader a whole batch at once (a
    per-sample collate of thousands of samples would cost more than the step)."""

    def __init__(self, n: int, width: int):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, width, generator=g)
        self.y = self.x[:, :4].sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(idx, dtype=torch.int64)
        return self.x[t], self.y[t]


def as_is(batch: Any) -> Any:
    return batch


def mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class _Mark(torch.autograd.Function):
    """Identity. In backward, the mark on the output notes the time; the mark on the input, reached once the
    model's backward is done, sleeps (factor - 1) times that backward's duration."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: dict, start: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.box, ctx.start = box, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        box = ctx.box
        if ctx.start:
            box["t"] = time.perf_counter()
        elif box["factor"] > 1:
            time.sleep((box["factor"] - 1) * (time.perf_counter() - box["t"]))
        return g, None, None


class Slowed(nn.Module):
    """The model, `factor` times slower per sample: its forward, then its backward, each followed by a sleep
    of (factor - 1) times its own duration."""

    def __init__(self, inner: nn.Module, factor: float):
        super().__init__()
        self.inner, self.box = inner, {"factor": factor, "t": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.box["factor"]
        if f <= 1:
            return self.inner(x)
        t0 = time.perf_counter()
        y = self.inner(_Mark.apply(x.requires_grad_(), self.box, False))
        time.sleep((f - 1) * (time.perf_counter() - t0))
        return _Mark.apply(y, self.box, True)


def pin(cpus: str) -> None:
    """Run this process on `cpus` ("0-3,8"), with a thread per CPU."""
    chosen: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, chosen)
    torch.set_num_threads(len(chosen))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--shares", default="auto", help="auto | equal | plain | a comma-separated list, one per rank")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--drift-at", type=int, default=-1,
                    help="the step from which --slow-rank is slowed (default: from the start)")
    ap.add_argument("--cpus", default=None, help="CPUs per rank, '/'-separated lists, e.g. 0-11/12-15: rank i "
                    "runs on list i with as many threads (islands of CPUs pinned apart)")
    ap.add_argument("--gpu-ranks", default=None, help="ranks on the GPU (cuda:LOCAL_RANK %% count, island "
                    "nvidia-<rank>), e.g. 0; the others on the CPU (island cpu)")
    ap.add_argument("--backend", default="hetccl")
    ap.add_argument("--reference", action="store_true", help="one process over the same global batches")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", type=int, default=25, help="steps left out of samples/s (warm-up, calibration)")
    args = ap.parse_args()

    B = args.global_batch  # noqa: N806
    if args.cpus:
        pin(args.cpus.split("/")[int(os.environ.get("RANK", "0"))])
    ds = Synthetic(B * (args.steps + 2), args.width)
    device = torch.device("cpu")
    model: nn.Module = mlp(args.width, args.depth)
    if args.reference:
        rank, world, history = 0, 1, []
        loader = (ds.__getitems__(idx) for idx in balance.global_batches(len(ds), B, seed=0))
    else:
        rank = int(os.environ.get("RANK", "0"))
        if args.gpu_ranks is not None:  # a GPU island and CPU islands: each rank's device and island label
            on_gpu = rank in {int(r) for r in args.gpu_ranks.split(",")}
            if on_gpu and not torch.cuda.is_available():
                raise SystemExit(f"--gpu-ranks {args.gpu_ranks}: rank {rank} was to run on a GPU, and this "
                                 "machine has no CUDA GPU")
            if on_gpu:
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
                torch.cuda.set_device(device)
            os.environ.setdefault("HETCCL_ISLAND", f"nvidia-{rank}" if on_gpu else "cpu")
        import hetccl.torch  # noqa: F401  (registers the backend)

        dist.init_process_group(args.backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        slowed = Slowed(model, args.slow_factor if rank == args.slow_rank and args.drift_at < 0 else 1.0)
        model = DDP(slowed.to(device))
        if args.shares == "plain":
            sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
            loader = DataLoader(ds, batch_size=B // world, sampler=sampler, drop_last=True, collate_fn=as_is)
            bal = None
        else:
            shares = [int(s) for s in args.shares.split(",")] if "," in args.shares else args.shares
            bal = balance.Balancer(B, shares).attach(model)
            sampler = balance.BatchSampler(ds, bal, seed=0)
            loader = DataLoader(ds, batch_sampler=sampler, collate_fn=as_is)  # an empty share: empty tensors
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    t0, marks = 0.0, []
    for step, (x, y) in zip(range(args.steps), loader, strict=False):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's time is the device's, not the launch's
        marks.append(time.perf_counter())
        if step == args.skip:
            t0 = marks[-1]
        if not args.reference and step == args.drift_at and rank == args.slow_rank:
            slowed.box["factor"] = args.slow_factor
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    if not marks:
        raise SystemExit(f"no training step ran (--steps {args.steps}, {len(ds)} samples in batches of {B})")
    # the last step's global-batch loss: once, after the timed steps (each rank's loss is of its own share)
    if args.reference or bal is None:
        loss_v = float(loss.detach())
        if not args.reference:
            t = torch.tensor([loss_v])
            dist.all_reduce(t)
            loss_v = float(t) / world
    else:
        loss_v = float(bal.mean(loss.detach() if len(x) else 0.0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    marks.append(time.perf_counter())
    wall = marks[-1] - t0
    samples = B * (args.steps - args.skip)
    if not args.reference and bal is not None:
        history = [{"step": s, "shares": sh, "reason": why} for s, sh, why in bal.history]
    elif not args.reference:
        history = [{"step": 0, "shares": [B // world] * world, "reason": "DistributedSampler"}]
    checksum = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
    if rank == 0:
        out = {"samples_per_s": samples / wall, "final_loss": loss_v, "param_abs_sum": checksum,
               "shares": history, "world": world, "args": vars(args),
               "step_seconds": [b - a for a, b in zip(marks, marks[1:], strict=False)]}
        os.write(1, (f"{samples / wall:.0f} samples/s, final loss {loss_v:.6f}, shares "
                     f"{history[-1]['shares'] if history else [B]}\n").encode())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if not args.reference:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
