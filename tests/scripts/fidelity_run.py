"""Patterns of real Lightning projects, run with Lightning's defaults, on 2 stages (or one device).

python fidelity_run.py OUT CASE[,CASE...] MODE     CASE: rng | otherdata | batchnorm | hparams | epochend
                                                 MODE: pipe | single
Several cases run one after the other in the same processes (each from the same seed), as several scripts would.

rng:       lazy sampling over a DataLoader shuffling with torch's global RNG (no generator=) while the stages
           consume that RNG differently (dropout with freeze_rng=False, noise drawn in the loss on the last stage),
           3 epochs; each rank records the labels of every batch it trained on.
otherdata: each process builds different data (a bug in user code the strategy must catch).
batchnorm: a model with BatchNorm1d and 2 micro-batches (the strategy warns).
hparams:   ``__init__(self, net: nn.Module)`` with ``save_hyperparameters()`` and Lightning's default checkpointing.
epochend:  epoch-end hooks that compute from what the steps collected (``torch.cat(self.outs)``) and log with
           ``sync_dist=True``, ModelCheckpoint monitoring that value; then ``torch.cat(trainer.predict(...))`` on
           every rank.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import classification_data


class NoisyDropoutMLP(L.LightningModule):
    def __init__(self, norm: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32) if norm else nn.Dropout(0.3), nn.Tanh(),
                                 nn.Linear(32, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = 0.01 * torch.rand(())  # RNG drawn after the model: only the last stage gets here
        return F.cross_entropy(self(x), y) + noise

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NetHolder(L.LightningModule):
    """The most used template's shape: the network is a constructor argument, saved with the hyperparameters."""

    def __init__(self, net: nn.Module, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class EpochEnd(L.LightningModule):
    """The pattern Lightning 2's migration guide recommends for epoch-level values."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.train_outs, self.val_outs = [], []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_outs.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("train_epoch_loss", torch.stack(self.train_outs).mean(), sync_dist=True)
        self.train_outs.clear()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_outs.append((self(x).argmax(-1) == y).float())

    def on_validation_epoch_end(self):
        self.log("val_acc", torch.cat(self.val_outs).mean(), sync_dist=True, prog_bar=True)
        self.val_outs.clear()

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Labels(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(batch[1].tolist())


def main(out: Path, case: str, mode: str) -> None:
    torch.manual_seed(0)
    x, y = classification_data(n=64, seed=1)
    if case == "otherdata":
        x = x + int(os.environ.get("LOCAL_RANK", 0))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=case in ("rng", "otherdata"))
    labels = Labels()
    if case == "hparams":
        model = NetHolder(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
        split = ["net.2"]
    elif case == "epochend":
        model, split = EpochEnd(), ["net.2"]
    else:
        model = NoisyDropoutMLP(norm=case == "batchnorm")
        split = ["net.3"]
    if mode == "pipe":
        strategy, devices = lightning_clapping.ClappingStrategy(split_points=split, microbatches=2,
                                                                freeze_rng=False), 2
    else:
        strategy, devices = "auto", 1
    callbacks = [labels]
    if case == "epochend":
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(monitor="val_acc", mode="max"))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                        max_epochs={"rng": 3, "epochend": 2}.get(case, 1), default_root_dir=out / f"{case}_{mode}",
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    data = lightning_clapping.LazySamplingDataModule(loader, p=0.5, seed=1) if case == "rng" else None
    val = DataLoader(TensorDataset(*classification_data(n=24, seed=2)), batch_size=8) if case == "epochend" else None
    trainer.fit(model, loader if data is None else None, val, datamodule=data)
    row = {"labels": labels.rows, "checkpoint": trainer.checkpoint_callback.best_model_path,
           "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    if case == "epochend":
        row["predictions"] = torch.cat(trainer.predict(model, val)).tolist()  # on every rank, as users write it
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / f"{case}_{mode}_weights.pt")
    (out / f"{case}_{mode}_rank{trainer.global_rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    for name in sys.argv[2].split(","):
        main(Path(sys.argv[1]), name, sys.argv[3])
