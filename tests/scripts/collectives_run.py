"""Count the collectives each rank enters during training steps (not the pipeline's own point-to-point messages).

python collectives_run.py OUT VARIANT [RUN ...]     RUN: sync | autotune | sync+autotune (default: plain)

Every rank wraps torch.distributed's collectives before the Trainer exists; then, for each RUN in turn (in the same
processes), runs 3 stages with Lightning's defaults (checkpointing, logger, progress bar) for one epoch of 8 steps,
with a module that logs with ``sync_dist=True`` (sync) and/or ``autotune=True``, and writes
OUT/collectives_{RUN}_rank{r}.json: per training step, the collectives it entered between ``on_train_batch_start``
and ``on_train_batch_end`` (``name(async)`` when nothing waited for it), the bytes they carried (tensor bytes; pickled
bytes for the object collectives), the loss and the callback metrics; and the epoch's ``samples`` (logged with
``reduce_fx="sum", sync_dist=True``).
"""

import json
import pickle
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data

COLLECTIVES = ("broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "all_reduce", "barrier",
               "reduce", "gather", "gather_object", "scatter", "all_to_all", "reduce_scatter")
counter = {"calls": 0, "bytes": 0, "depth": 0, "names": []}


def _nbytes(args) -> int:
    total = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, list) and a and all(isinstance(t, torch.Tensor) for t in a):
            total += sum(t.numel() * t.element_size() for t in a)
        elif isinstance(a, list):
            total += len(pickle.dumps(a))
    return total


def _wrap(name):
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        if counter["depth"] == 0:  # broadcast_object_list calls broadcast inside: count what the caller asked for
            counter["calls"] += 1
            counter["names"].append(name + ("(async)" if kwargs.get("async_op") else ""))
            counter["bytes"] += _nbytes(args)
        counter["depth"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            counter["depth"] -= 1

    setattr(dist, name, counted)


for _name in COLLECTIVES:
    if hasattr(dist, _name):
        _wrap(_name)


class SyncLogMLP(SequentialMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        self.log("samples", float(len(batch[0])), reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True)
        return loss


class Count(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = dict(counter, names=len(counter["names"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"calls": counter["calls"] - self.start["calls"],
                           "bytes": counter["bytes"] - self.start["bytes"],
                           "names": counter["names"][self.start["names"]:],
                           "loss": float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs),
                           "logged": {k: float(v) for k, v in trainer.callback_metrics.items()}})


def main(out: Path, variant: str, sync: bool, tune: bool = False, name: str = "plain") -> None:
    torch.manual_seed(0)
    model = (SyncLogMLP if sync else SequentialMLP)(optimizer="sgd", lr=0.05)
    x, y = classification_data(n=64, seed=1)
    count = Count()
    trainer = L.Trainer(
        accelerator="cpu", devices=3, max_epochs=1, default_root_dir=out,
        strategy=lightning_clapping.ClappingStrategy(split_points=["net.2", "net.4"], microbatches=2,
                                                     variant=variant, autotune=tune),
        callbacks=[count],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    rank = trainer.global_rank
    result = {"steps": count.steps, "samples": float(trainer.callback_metrics.get("samples", float("nan"))),
              "totals": trainer.strategy.byte_totals}
    (out / f"collectives_{name}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for run in sys.argv[3:] or ["plain"]:
        options = run.split("+")
        main(Path(sys.argv[1]), sys.argv[2], "sync" in options, "autotune" in options, name=run)
