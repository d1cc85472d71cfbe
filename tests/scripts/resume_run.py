"""Compressed training with lazy sampling, uninterrupted or stopped and resumed; rank 0 saves the losses.

python resume_run.py OUT MODE[,MODE...] [VARIANT [STATE_DICT_TYPE]] [--accelerator cpu] [--devices 3]
    MODE: full (14 steps) | first (8 steps, then a checkpoint) | rest (resume to 14); several modes run one after
          the other in the same processes, each from the same seed
    VARIANT: clapping-fc (default; lazy sampling, p=0.5) | uncompressed (every batch fresh: p=1)
    STATE_DICT_TYPE: full (default) | sharded
    --devices: 3 stages (default) or 2
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data


class Losses(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """Rows [loss, fresh, bytes] per step; the strategy logs a step's numbers at the next step (the last step of a
        run keeps None for them)."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        m = trainer.callback_metrics
        if self.rows:
            self.rows[-1][1:] = [float(m["clapping/fresh"]), float(m["clapping/bytes"])]
        self.rows.append([float(loss), None, None])


SPLITS = {2: ["net.4"], 3: ["net.2", "net.4"]}


def main(out, mode, variant="clapping-fc", state_dict_type="full", accelerator="cpu", devices=3):
    torch.manual_seed(0)
    model = SequentialMLP(optimizer="adam", lr=0.01)
    x, y = classification_data(n=80, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    # the lazy-sampling wrapper also makes the loader resumable mid-epoch (a plain DataLoader is not, in Lightning)
    p = 1.0 if variant == "uncompressed" else 0.5
    data = lightning_clapping.LazySamplingDataModule(loader, p=p, seed=7)
    strategy = lightning_clapping.ClappingStrategy(split_points=SPLITS[devices], microbatches=4,
                                                   variant=variant, forward_codec="q4", backward_codec="q8",
                                                   state_dict_type=state_dict_type)
    losses = Losses()
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy,
                        max_steps=8 if mode == "first" else 14, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses])
    ckpt = out / f"mid_{variant}_{state_dict_type}.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if mode == "rest" else None)
    if mode == "first":
        trainer.save_checkpoint(ckpt)
    if trainer.global_rank == 0:
        (out / f"{mode}_{variant}_{state_dict_type}.json").write_text(json.dumps(losses.rows))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("mode", type=lambda modes: modes.split(","))
    ap.add_argument("variant", nargs="?", default="clapping-fc")
    ap.add_argument("state_dict_type", nargs="?", default="full")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=3, choices=sorted(SPLITS))
    args = ap.parse_args()
    for mode in args.mode:
        if mode not in ("full", "first", "rest"):
            ap.error(f"unknown mode {mode!r}: full, first or rest")
        main(args.out, mode, args.variant, args.state_dict_type, args.accelerator, args.devices)
