"""Runs that must fail cleanly (a clear message, every process ends).

python failing_run.py CASE      CASE: unsplittable | microbatches | child_dies | rank0_dies | child_raises | sigterm
                                      | child_hangs | other_cuts

sigterm trains until stopped; every rank writes its pid to pid_rank{r}, rank 0 writes "started" after 3 steps.
"""

import os
import signal
import sys
from datetime import timedelta

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data


class SkipAcrossTheCut(L.LightningModule):
    """``h0`` is computed on stage 0 and, from the third step on only, used on stage 1 without passing through the
    cut module ``c``: the values crossing the cut change between steps."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 4)
        self.skip = False

    def forward(self, x):
        h0 = self.a(x)
        h = self.c(self.b(h0))
        return self.out(self.d(h + h0 if self.skip else h))

    def training_step(self, batch, i):
        self.skip = i >= 2
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RaisesAtStep(SequentialMLP):
    def training_step(self, batch, i):
        if i == 2 and self.trainer.global_rank == 1:
            raise ValueError("boom in the first stage")
        return super().training_step(batch, i)


class StopsAtStep(SequentialMLP):
    def training_step(self, batch, i):
        if i == 2 and self.trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # hung: neither dead nor answering
        return super().training_step(batch, i)


class Announce(L.Callback):
    def on_train_start(self, trainer, pl_module):
        with open(f"pid_rank{trainer.global_rank}", "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3 and trainer.global_rank == 0:
            open("started", "w").close()


class DiesAtStep(SequentialMLP):
    def __init__(self, rank_to_die):
        super().__init__()
        self.rank_to_die = rank_to_die

    def training_step(self, batch, i):
        if i == 2 and self.trainer.global_rank == self.rank_to_die:
            os._exit(3)
        return super().training_step(batch, i)


def main(case):
    torch.manual_seed(0)
    x, y = classification_data(n=64)
    batch_size, microbatches, split = 16, 4, ["net.4"]
    timeout = timedelta(minutes=10)
    if case == "unsplittable":
        model, split = SkipAcrossTheCut(), ["c"]
    elif case == "microbatches":
        model, batch_size, microbatches = SequentialMLP(), 4, 8
    elif case == "child_dies":
        model = DiesAtStep(rank_to_die=1)
    elif case == "child_raises":
        model = RaisesAtStep()
    elif case == "rank0_dies":
        model, timeout = DiesAtStep(rank_to_die=0), timedelta(seconds=15)
    elif case == "sigterm":
        model = SequentialMLP()
    elif case == "child_hangs":
        model = StopsAtStep()
    elif case == "other_cuts":  # the second process (as on another node started with other arguments) cuts elsewhere
        model, split = SequentialMLP(), ["net.2"] if os.environ.get("LOCAL_RANK", "0") == "1" else ["net.4"]
    else:
        raise SystemExit(f"unknown case {case}")
    strategy = lightning_clapping.ClappingStrategy(split_points=split, microbatches=microbatches, timeout=timeout,
                                                   liveness=timedelta(seconds=3))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=10**6 if case == "sigterm" else 1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Announce()] if case in ("sigterm", "child_hangs") else None)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch_size))


if __name__ == "__main__":
    main(sys.argv[1])
