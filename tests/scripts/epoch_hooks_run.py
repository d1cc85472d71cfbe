"""The LightningModule's epoch-end hooks calling what needs every process, on 2 stages (2 processes).

python epoch_hooks_run.py CONFIG OUT
    "save": 2 epochs; on_train_epoch_end calls trainer.save_checkpoint(OUT/hook-epoch=E.ckpt) and logs with
        sync_dist=True, next to a ModelCheckpoint saving OUT/mc/mc-epoch=E.ckpt at every epoch's end; then a run of
        up to 3 epochs whose on_train_epoch_end sets trainer.should_stop at the first. Every rank writes
        OUT/save_rank<r>.json (the logged value and the epochs the second run trained).
    "barrier": on_validation_epoch_end calls trainer.strategy.barrier() (the timeout is short, so a hang fails fast).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data


class SavingMLP(SequentialMLP):
    def __init__(self, out: str, **kw) -> None:
        super().__init__(**kw)
        self.out = out

    def on_train_epoch_end(self):
        self.trainer.save_checkpoint(Path(self.out) / f"hook-epoch={self.current_epoch}.ckpt")
        self.log("hook_value", 10.0 + self.current_epoch, sync_dist=True)


class StoppingMLP(SequentialMLP):
    def on_train_epoch_end(self):
        self.trainer.should_stop = True


class BarrierMLP(SequentialMLP):
    def on_validation_epoch_end(self):
        self.trainer.strategy.barrier()


def trainer(out: Path, **kw) -> L.Trainer:
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.4"], microbatches=2, log_bytes=False,
                                                   timeout=timedelta(seconds=30))
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=out, **kw)


def main(config: str, out: Path) -> None:
    x, y = classification_data(n=32, seed=1)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    torch.manual_seed(0)
    if config == "barrier":
        trainer(out, max_epochs=1, num_sanity_val_steps=0, limit_val_batches=1).fit(BarrierMLP(), data, data)
        return
    ckpt = ModelCheckpoint(dirpath=out / "mc", filename="mc-{epoch}", save_top_k=-1, every_n_epochs=1,
                           save_on_train_epoch_end=True)
    saving = trainer(out, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True)
    saving.fit(SavingMLP(str(out)), data)
    stopping = trainer(out, max_epochs=3)
    stopping.fit(StoppingMLP(), data)
    result = {"hook_value": float(saving.callback_metrics["hook_value"]), "stopped_after": stopping.current_epoch}
    (out / f"save_rank{saving.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
