"""A Lightning trainer with uneven shares of each global batch (hetccl.torch.balance.lightning_callback):
`python tests/lightning_balanced.py SHARES OUT_PATH` (SHARES "12,52" or "auto"). Lightning's own launcher starts
the second rank on the CPU through hetccl; each rank checks its replica against one process over the same global
batches and writes the largest relative error and the shares to OUT_PATH.RANK."""

from __future__ import annotations

import json
import sys

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

import hetccl.torch  # noqa: F401  (registers "hetccl")
from hetccl.torch import balance

B, STEPS = 64, 6
X = torch.randn(1024, 32, generator=torch.Generator().manual_seed(0))
Y = X[:, :4].sum(1, keepdim=True).tanh()
DATA = torch.utils.data.TensorDataset(X, Y)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


class Regressor(pl.LightningModule):
    def __init__(self, cb: object) -> None:
        super().__init__()
        self.net, self.cb = net(), cb

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        s = balance.BatchSampler(DATA, self.cb.balancer, seed=0)
        return torch.utils.data.DataLoader(DATA, batch_sampler=s, collate_fn=s.collate())


def main(shares: str, out_path: str) -> None:
    cb = balance.lightning_callback(B, shares if shares == "auto" else [int(s) for s in shares.split(",")])
    model = Regressor(cb)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="hetccl"),
                         max_steps=STEPS, callbacks=[cb], use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _, idx in zip(range(STEPS), balance.global_batches(len(DATA), B, 0), strict=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(X[idx]), Y[idx]).backward()
        opt.step()
    err = max(((a - b).abs().max() / b.abs().max()).item()
              for a, b in zip(model.net.parameters(), ref.parameters(), strict=True))
    with open(f"{out_path}.{trainer.global_rank}", "w") as f:
        json.dump({"err": err, "shares": cb.balancer.shares,
                   "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
