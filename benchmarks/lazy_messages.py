"""What lazy messages save and what they cost.

    python benchmarks/lazy_messages.py [--quick | --tiny] [--out benchmarks/results]

The char-level transformer LM on Shakespeare through 4 stages with Clapping-FC (q4 forward / q8 backward, lazy
sampling p = 0.5), run with lazy messages off and at several thresholds, same seed and steps. Reported per run:
bytes sent, messages skipped, held-out validation loss at the end. Savings are byte ratios to the run without lazy
messages; the cost is the change in validation loss. All runs share one set of worker processes (Lightning's
launcher starts them once and every rank runs the same list of fits).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from char_lm import CharTransformer  # noqa: E402
from datasets import ShakespeareDataModule, missing_reason  # noqa: E402

import lightning_clapping  # noqa: E402
from _table import table  # noqa: E402

MODES = {  # stages, layers, d, block, batch, microbatches, steps, val batches, data limit
    "tiny": (2, 2, 32, 32, 8, 2, 6, 2, 2000),
    "quick": (4, 4, 128, 128, 32, 8, 150, 20, None),
    "full": (4, 4, 128, 128, 32, 8, 600, 40, None),
}
THRESHOLDS = [None, 0.01, 0.03, 0.1]


class Totals(L.Callback):
    def __init__(self) -> None:
        self.bytes = 0.0
        self.skipped = 0.0

    def on_train_end(self, trainer, pl_module) -> None:
        totals = trainer.strategy.byte_totals  # every step's numbers, the last one included
        self.bytes, self.skipped = totals["bytes"], totals["skipped_messages"]


def run(mode: str, threshold: float | None, seed: int = 0) -> dict:
    stages, layers, d, block, batch, micro, steps, val_batches, limit = MODES[mode]
    L.seed_everything(seed)
    dm = ShakespeareDataModule(batch_size=batch, seed=seed, block_size=block, limit=limit)
    dm.setup("fit")
    model = CharTransformer(dm.vocab_size, block_size=block, d=d, heads=4, layers=layers)
    totals = Totals()
    strategy = lightning_clapping.ClappingStrategy(
        split_points=[f"blocks.{i}" for i in range(1, stages)] if stages == layers else None,
        microbatches=micro, variant="clapping-fc", forward_codec="q4", backward_codec="q8",
        lazy_messages=threshold)
    trainer = L.Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=val_batches, num_sanity_val_steps=0, val_check_interval=None,
                        check_val_every_n_epoch=None, callbacks=[totals])
    data = lightning_clapping.LazySamplingDataModule(dm, p=0.5, seed=seed)
    trainer.fit(model, datamodule=data)
    val = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_loss"]
    return {"threshold": threshold, "bytes": totals.bytes, "skipped_messages": totals.skipped, "val_loss": val,
            "steps": steps, "rank": trainer.global_rank}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    reason = missing_reason("shakespeare")
    if reason:
        raise SystemExit(f"lazy_messages benchmark needs the Shakespeare data: {reason}")
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    rows = [run(mode, t) for t in THRESHOLDS]
    if rows[0]["rank"] != 0:
        return
    base = rows[0]
    for r in rows:
        r["bytes_saved_vs_off"] = 1 - r["bytes"] / base["bytes"]
        r["val_loss_change_vs_off"] = r["val_loss"] - base["val_loss"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"mode": mode, "setup": dict(zip(["stages", "layers", "d", "block", "batch", "microbatches", "steps",
                                                 "val_batches", "data_limit"], MODES[mode]))
               | {"variant": "clapping-fc", "codecs": "q4/q8", "p": 0.5, "max_skips": 2},
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "torch": torch.__version__},
               "runs": rows}
    (out / "lazy_messages.json").write_text(json.dumps(summary, indent=2))
    with open(out / "lazy_messages.csv", "w") as f:
        f.write("threshold,bytes,skipped_messages,val_loss,bytes_saved_vs_off,val_loss_change_vs_off\n")
        for r in rows:
            f.write(f"{r['threshold']},{r['bytes']:.0f},{r['skipped_messages']:.0f},{r['val_loss']:.4f},"
                    f"{r['bytes_saved_vs_off']:.4f},{r['val_loss_change_vs_off']:.4f}\n")
    print(f"\nlazy messages, {mode} mode: {summary['setup']}")
    print(table([("off" if r["threshold"] is None else f"{r['threshold']:g}", r["bytes"] / 1e6, r["skipped_messages"],
                  f"{r['bytes_saved_vs_off']:.1%}", r["val_loss"], f"{r['val_loss_change_vs_off']:+.4f}") for r in rows],
                ["threshold", "MB sent", "skipped", "saved", "val loss", "change"],
                floatfmt=(None, ".2f", ".0f", None, ".4f"), colalign=["right"] * 6))


if __name__ == "__main__":
    main()
