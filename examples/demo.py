"""The demo: what compression buys a 4-stage pipeline, on real data that installs with pip alone (sklearn digits).

    python examples/demo.py [--steps 300] [--stages 4]

Trains the same MLP three times for the same number of optimizer steps, through the same pipeline:
uncompressed, Clapping-FC and Clapping-FU (4-bit activations / 8-bit gradients, lazy sampling p = 0.5) and
Clapping-FC at 2/4 bits, and prints
held-out accuracy next to the bytes that crossed the stage boundaries.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import DigitsDataModule  # noqa: E402
from train_classifier import MLPClassifier  # noqa: E402

import lightning_clapping  # noqa: E402

RUNS = [
    ("uncompressed", dict(variant="uncompressed"), 1.0),
    ("clapping-fc q4/q8", dict(variant="clapping-fc", forward_codec="q4", backward_codec="q8"), 0.5),
    ("clapping-fu q4/q8", dict(variant="clapping-fu", forward_codec="q4", backward_codec="q8"), 0.5),
    ("clapping-fc q2/q4", dict(variant="clapping-fc", forward_codec="q2", backward_codec="q4"), 0.5),
]


class ByteCounter(L.Callback):
    """The bytes the strategy sent between stages and the samples the run drew from the data."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self.samples = 0

    def on_train_end(self, trainer, pl_module) -> None:
        self.bytes = trainer.strategy.byte_totals["bytes"]  # complete once training ends (logged values lag a step)
        self.samples = int(trainer.callback_metrics.get("clapping/distinct_samples", 0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rows = []
    for name, compression, p in RUNS:
        L.seed_everything(args.seed)
        dm = DigitsDataModule(batch_size=128, seed=args.seed)
        model = MLPClassifier(64, 10, hidden=256, depth=6)
        counter = ByteCounter()
        strategy = lightning_clapping.ClappingStrategy(microbatches=4, **compression)
        trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[counter], num_sanity_val_steps=0,
                            limit_val_batches=0)
        trainer.fit(model, datamodule=lightning_clapping.LazySamplingDataModule(dm, p=p, seed=args.seed))
        accuracy = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
        rows.append((name, p, accuracy, counter.bytes, counter.samples))

    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        base = rows[0][3]
        print(f"\n{args.stages}-stage pipeline, sklearn digits, {args.steps} optimizer steps each "
              f"(torch {torch.__version__}):\n")
        print(f"{'run':20s} {'p':>4s} {'test acc':>9s} {'MB sent':>9s} {'fewer bytes':>12s} {'samples seen':>13s}")
        for name, p, acc, sent, samples in rows:
            print(f"{name:20s} {p:4.1f} {acc:9.3f} {sent / 1e6:9.2f} {base / sent:11.1f}x {samples:13d}")
        print("\nBytes are what the strategy handed to torch.distributed between stages (headers included); p is the\n"
              "lazy-sampling probability of a fresh batch, so Clapping reads about p times as many samples.\n"
              "Wall-clock gains need a slow link: see BENCHMARKS.md.")


if __name__ == "__main__":
    main()
