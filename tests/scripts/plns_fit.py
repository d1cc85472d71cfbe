"""A ``pytorch_lightning`` project (``import pytorch_lightning as pl``, no ``lightning.pytorch`` in its code) trained
with ClappingStrategy, as a user writes it.

python plns_fit.py MODE OUT      MODE: "pipe": three 2-stage runs: strategy="clapping", then
                                       lightning_clapping.pytorch_lightning.ClappingStrategy(...), then
                                       lightning_clapping.ClappingStrategy(...); "single": one device
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _models import classification_data  # the same data as cli_fit.py / hydra_fit.py (a tensor helper only)


class MLP(pl.LightningModule):
    """tests/_models.py's SequentialMLP (same layers, names, optimizer), written against pytorch_lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
                                 nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def data(n, seed):
    return DataLoader(TensorDataset(*classification_data(n=n, seed=seed)), batch_size=16)


def run(name, strategy, devices, out):
    torch.manual_seed(0)
    model, rec = MLP(), Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, callbacks=[rec],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, data(48, 1), data(32, 2))
    if trainer.global_rank == 0:
        (out / f"{name}.json").write_text(json.dumps({
            "losses": rec.losses,
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "strategy": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__qualname__}",
            "stages": getattr(trainer.strategy, "num_stages", 1),  # processes; trainer.world_size counts replicas
            "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        }))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "single":
        run("single", "auto", 1, out)
    else:
        import lightning_clapping  # noqa: F401  registers strategy="clapping" with pytorch_lightning too

        run("string", "clapping", 2, out)
        from lightning_clapping.pytorch_lightning import ClappingStrategy  # the class for pytorch_lightning

        run("object", ClappingStrategy(split_points=["net.4"], microbatches=4), 2, out)
