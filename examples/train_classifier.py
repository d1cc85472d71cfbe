"""Train an MLP classifier through a pipeline of stages with ClappingStrategy.

    python examples/train_classifier.py                      # digits (pip only), 4 stages, 1F1B
    python examples/train_classifier.py --data fashion_mnist --epochs 2   # needs apt-get install dataset-fashion-mnist

The model and the training step are ordinary Lightning code: the only pipeline-specific line is the strategy.
Run it as a script: Lightning's launcher starts one process per stage by re-running it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import DigitsDataModule, FashionMNISTDataModule  # noqa: E402

import lightning_clapping  # noqa: E402


class MLPClassifier(L.LightningModule):
    def __init__(self, inputs: int, classes: int, hidden: int = 256, depth: int = 6, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, classes))
        self.net = nn.Sequential(*layers)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro")
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def datamodule(name: str, batch_size: int, seed: int) -> L.LightningDataModule:
    if name == "digits":
        return DigitsDataModule(batch_size=batch_size, seed=seed)
    if name == "fashion_mnist":
        return FashionMNISTDataModule(batch_size=batch_size, seed=seed)
    raise SystemExit(f"unknown data {name!r}: choose digits or fashion_mnist")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="digits", choices=["digits", "fashion_mnist"])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/classifier")
    args = ap.parse_args(argv)

    L.seed_everything(args.seed)
    dm = datamodule(args.data, args.batch_size, args.seed)
    inputs, classes = (64, 10) if args.data == "digits" else (784, 10)
    model = MLPClassifier(inputs, classes)
    strategy = lightning_clapping.ClappingStrategy(microbatches=args.microbatches, schedule=args.schedule)
    trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_epochs=args.epochs,
                        logger=CSVLogger(args.out), log_every_n_steps=5, enable_checkpointing=False)
    trainer.fit(model, datamodule=dm)
    step_bytes = int(trainer.callback_metrics["clapping/bytes"])
    result = trainer.test(model, datamodule=dm, verbose=False)
    if trainer.is_global_zero:
        print(f"\n{args.stages}-stage pipeline on {args.data}: test accuracy {result[0]['test_acc']:.3f}, "
              f"{step_bytes} bytes sent between stages in the last training step")


if __name__ == "__main__":
    main()
