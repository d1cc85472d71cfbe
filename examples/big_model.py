"""A model larger than one process: its layers are built in ``configure_model()``, so no process ever holds it whole.

Under ClappingStrategy ``configure_model()`` runs on the meta device (shapes only), the model is cut on those shapes,
and each rank materializes and initialises only its own stage. ``state_dict_type="sharded"`` makes every stage
write its own part of a checkpoint, in parallel; Lightning's consolidation tool turns the folder into one file.

    python examples/big_model.py --devices 4 --width 4096 --layers 16     # 1.07 GB of fp32 weights on 4 stages
    python -m lightning.pytorch.utilities.consolidate_checkpoint big_model_ckpt/last.ckpt --output_file big.ckpt

``--eager`` builds the same layers in ``__init__`` instead (every process builds the whole model before it is cut),
which is what the memory benchmark (benchmarks/memory.py) compares against.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class WideMLP(L.LightningModule):
    """``layers`` blocks of Linear(width, width) + Tanh, then a classifier head."""

    def __init__(self, width: int = 1024, layers: int = 8, classes: int = 10, lr: float = 0.01,
                 momentum: float = 0.9, eager: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks: nn.ModuleList | None = None
        self.head: nn.Linear | None = None
        if eager:
            self.configure_model()

    def configure_model(self) -> None:
        if self.blocks is not None:  # Lightning calls this hook for every fit/validate/test/predict
            return
        w = self.hparams.width
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(self.hparams.layers))
        self.head = nn.Linear(w, self.hparams.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def synthetic_data(width: int, classes: int = 10, n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Inputs with labels from a fixed random projection: learnable, and built without any download."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    y = (x @ torch.randn(width, classes, generator=g)).argmax(-1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def main() -> None:
    import lightning_clapping

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="build the layers in __init__ (whole model per process)")
    p.add_argument("--state-dict-type", choices=["full", "sharded"], default="sharded")
    p.add_argument("--ckpt-dir", default="big_model_ckpt")
    args = p.parse_args()

    L.seed_everything(0)
    model = WideMLP(args.width, args.layers, eager=args.eager)
    strategy = lightning_clapping.ClappingStrategy(microbatches=2, state_dict_type=args.state_dict_type)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=[checkpoint], logger=False, enable_progress_bar=False)
    trainer.fit(model, synthetic_data(args.width))
    if trainer.global_rank == 0:
        print(f"trained {args.steps} steps; checkpoint: {checkpoint.last_model_path}")


if __name__ == "__main__":
    main()
