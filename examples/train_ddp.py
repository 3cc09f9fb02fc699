"""Train a small CNN on scikit-learn's bundled handwritten digits with DistributedDataParallel.

The data set (`sklearn.datasets.load_digits`: 1797 8x8 grey images of the digits 0-9) ships inside
scikit-learn, so nothing is downloaded. The script is plain torch.distributed: the backend is a flag.

    hetccl run -n 2 -- python examples/train_ddp.py --backend hetccl
    hetccl run -n 2 -- python examples/train_ddp.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --backend hetccl
    hetccl run -n 2 -- python examples/train_ddp.py --backend hetccl --device cuda   # one GPU per rank

Every rank prints nothing but rank 0's progress lines; `--losses-out PATH` writes each rank's per-step
losses to PATH.RANK (JSON) for comparing backends (tests/test_example.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def say(msg: str) -> None:
    os.write(1, (msg + "\n").encode())  # one write per line: the ranks share stdout


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """load_digits split 80/20 with a fixed permutation; pixels scaled to [0, 1], shape (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="hetccl", help="hetccl, gloo or nccl (default hetccl)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run every epoch)")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hook", default="none", choices=["none", "allreduce", "fp16", "bf16"],
                    help="DDP comm hook from hetccl.torch.hooks (default: DDP's own all-reduce)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: cores / local ranks)")
    ap.add_argument("--losses-out", default="", help="write this rank's per-step losses to PATH.RANK")
    args = ap.parse_args()

    if args.backend == "hetccl" or args.hook != "none":
        import hetccl.torch  # noqa: F401  (registers the "hetccl" backend)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("HETCCL_LOCAL_RANK", "0")))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("HETCCL_LOCAL_WORLD_SIZE", "0")) or 0)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, local_size or 1)))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    train, test = digits(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DigitsNet().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.hook != "none":
        from hetccl.torch import hooks

        ddp.register_comm_hook(None, hooks.allreduce_hook if args.hook == "allreduce"
                               else getattr(hooks, f"{args.hook}_compress_hook"))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    losses: list[float] = []
    step, t0 = 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if rank == 0 and step % 10 == 0:
                say(f"epoch {epoch} step {step} loss {losses[-1]:.4f}")
            if args.steps and step >= args.steps:
                break
        if args.steps and step >= args.steps:
            break
    elapsed = time.perf_counter() - t0

    # test accuracy over the whole held-out split, each rank scoring a share
    model.eval()
    correct = torch.zeros(2, dtype=torch.float32, device=device)
    with torch.no_grad():
        idx = range(rank, len(test), world)
        x, y = test.tensors[0][list(idx)].to(device), test.tensors[1][list(idx)].to(device)
        correct[0] = (model(x).argmax(1) == y).sum()
        correct[1] = len(y)
    dist.all_reduce(correct)
    acc = (correct[0] / correct[1]).item()
    if rank == 0:
        say(f"backend {dist.get_backend()} ranks {world} steps {step} final loss {losses[-1]:.4f} "
            f"test accuracy {acc:.4f} ({elapsed:.1f} s)")
    if args.losses_out:
        with open(f"{args.losses_out}.{rank}", "w") as f:
            json.dump({"rank": rank, "backend": dist.get_backend(), "losses": losses, "accuracy": acc}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
