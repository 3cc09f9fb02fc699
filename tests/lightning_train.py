"""A PyTorch Lightning trainer, unchanged but for its process group backend: `python tests/lightning_train.py
BACKEND OUT_PATH`. Lightning's own launcher starts the second rank (it re-runs this file with LOCAL_RANK=1),
DDPStrategy calls init_process_group(BACKEND, device_id=cuda:i), and each rank writes its per-step training
losses to OUT_PATH.RANK. TEST_ISLANDS ("nvidia-0,nvidia-1") gives each rank its own island, as in
tests/torch_workers.py. tests/test_torch_gpu.py compares hetccl's losses with NCCL's."""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TEST_ISLANDS"):  # before hetccl starts: rank i (Lightning's LOCAL_RANK, one node) is island i
    os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[int(os.environ.get("LOCAL_RANK", "0"))]

import torch  # noqa: E402

try:
    import lightning.pytorch as pl  # noqa: E402
    from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # noqa: E402
    from pytorch_lightning.strategies import DDPStrategy  # noqa: E402

import hetccl.torch  # noqa: E402,F401  (registers "hetccl")


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                       torch.nn.GELU(), torch.nn.Linear(256, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(backend: str, out_path: str) -> None:
    pl.seed_everything(0, workers=True)
    x = torch.randn(2048, 32)
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:8].prod(1, keepdim=True)).tanh()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    model = Regressor()
    trainer = pl.Trainer(accelerator="gpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                         max_epochs=2, deterministic=True, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    pg = torch.distributed.group.WORLD
    got = torch.distributed.get_backend(pg) if torch.distributed.is_initialized() else "none"
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"backend": got, "losses": model.losses}, f)
    print(f"rank {rank}: {len(model.losses)} steps on {got}, last loss {model.losses[-1]:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
