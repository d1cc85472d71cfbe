"""A model with a trainable boundary bottleneck, trained on 2 stages cut at it, or in one process.

python bottleneck_run.py OUT MODE      MODE: single | pipe | pipe_after | single_grow | pipe_grow | pipe_narrow

The model is an MLP with ``Bottleneck(32, 4)`` between two hidden layers; the pipeline's split point names the
Bottleneck. ``*_grow``: a ``RankScheduler`` codes 2 values per position for 2 steps, then all 4 (``GROW``);
``pipe_narrow``: 2 values throughout. 4 steps of SGD; rank 0 writes OUT/bottleneck_MODE.json (losses, byte totals), OUT/bottleneck_MODE.pt
(final weights) and OUT/bottleneck_MODE.ckpt (the Trainer's checkpoint).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_clapping import Bottleneck, ClappingStrategy, RankScheduler

BATCH, RANK = 8, 4
GROW = {0: 2, 2: RANK}  # the code's width by step in the *_grow runs


class BottleneckMLP(L.LightningModule):
    def __init__(self, rank: int = RANK):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Bottleneck(32, rank), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 4))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=BATCH)


def main(out: Path, mode: str) -> None:
    L.seed_everything(0, verbose=False)
    model = BottleneckMLP()
    if mode.startswith("pipe"):
        cut = "net.3" if mode == "pipe_after" else "net.2"
        strategy, devices = ClappingStrategy(split_points=[cut], microbatches=2), 2
    else:
        strategy, devices = "auto", 1
    schedule = {"grow": [RankScheduler(GROW)], "narrow": [RankScheduler({0: 2})]}.get(mode.rpartition("_")[2], [])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=schedule)
    trainer.fit(model, data())
    trainer.save_checkpoint(out / f"bottleneck_{mode}.ckpt")
    totals = trainer.strategy.byte_totals if mode.startswith("pipe") else {}
    if trainer.global_rank == 0:
        (out / f"bottleneck_{mode}.json").write_text(json.dumps({"losses": model.losses, "totals": totals}))
        torch.save(model.state_dict(), out / f"bottleneck_{mode}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
