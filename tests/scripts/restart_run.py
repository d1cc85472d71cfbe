"""A small run that torchrun restarts as a whole after one of its processes is SIGKILLed.

torchrun --nproc-per-node 3 --max-restarts 2 restart_run.py OUT [--strategy clapping|ddp] [--kill-at STEP]
        [--kill-rank R] [--epochs E] [--late-rank R --late-s S] [--timeout S]

3 processes (3 pipeline stages, or 3 DDP replicas with ``--strategy ddp``) train a small MLP for ``--epochs``
epochs of 6 steps; ``ModelCheckpoint(save_last=True)`` saves at the end of every epoch and ``fit(ckpt_path="last")``
resumes from it. In the first round (``TORCHELASTIC_RESTART_COUNT=0``) rank ``--kill-rank`` SIGKILLs itself as the
step ``--kill-at`` starts; torchrun then restarts every process and the run resumes from the last epoch's checkpoint.

``--late-rank``: in a restarted round, that rank connects ``--late-s`` seconds after it starts (a process slow to
start on a loaded machine). Every other rank of the round then looks for its address in the store before it is there.

Written under OUT: ``final.pt`` (rank 0's state dict after ``fit``), ``events.jsonl`` (one line per optimizer step of
rank 0 and per kill: round, step, wall-clock time), ``ckpt/`` (the checkpoints).
"""

import time

STARTED = time.time()  # before torch and Lightning are imported

import argparse
import atexit
import gc
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data

SAMPLES, BATCH = 48, 8  # 6 steps per epoch


def _round() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _log(out: Path, **row) -> None:
    with open(out / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"round": _round(), "time": time.time(), **row}) + "\n")


class Events(L.Callback):
    """Rank 0 logs each optimizer step; rank ``kill_rank`` SIGKILLs itself as step ``kill_at`` starts (first round)."""

    def __init__(self, out: Path, kill_at: int | None, kill_rank: int) -> None:
        self.out, self.kill_at, self.kill_rank = out, kill_at, kill_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_at is not None and _round() == 0 and trainer.global_step == self.kill_at \
                and trainer.global_rank == self.kill_rank:
            _log(self.out, kill=trainer.global_step, epoch=trainer.current_epoch)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_start(self, trainer, pl_module) -> None:
        _log(self.out, fit_start=trainer.global_rank)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            _log(self.out, step=trainer.global_step, epoch=trainer.current_epoch)


def main(args: argparse.Namespace) -> None:
    out = args.out
    _log(out, start=int(os.environ.get("RANK", "0")), started=args.started, package=lightning_clapping.__file__)
    if _round() > 0 and int(os.environ.get("RANK", "0")) == args.late_rank:
        time.sleep(args.late_s)
    torch.manual_seed(0)
    model = SequentialMLP(lr=0.05, optimizer="adam")
    x, y = classification_data(n=SAMPLES, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    if args.strategy == "clapping":
        strategy = lightning_clapping.ClappingStrategy(split_points=["net.2", "net.4"], microbatches=2,
                                                       timeout=timedelta(seconds=args.timeout))
    else:
        strategy = L.pytorch.strategies.DDPStrategy(timeout=timedelta(seconds=args.timeout))
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_epochs=args.epochs, logger=False,
                        callbacks=[checkpoint, Events(out, args.kill_at, args.kill_rank)], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    rank = int(os.environ.get("RANK", "0"))
    atexit.register(lambda: _log(out, exiting=rank))  # runs after the threads are joined, before the final collection
    try:
        trainer.fit(model, loader, ckpt_path="last")
    except BaseException:
        _log(out, failed=rank)
        raise
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")
        _log(out, done=trainer.global_step)


def run(*argv: str) -> None:
    """``restart_run.py`` with these arguments (also the entry point of workers forked by torchrun's agent)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--strategy", choices=["clapping", "ddp"], default="clapping")
    ap.add_argument("--kill-at", type=int, default=None, help="the global step whose start rank --kill-rank dies at")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--late-rank", type=int, default=None, help="the rank that connects late in a restarted round")
    ap.add_argument("--late-s", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="the process group's timeout, in seconds")
    args = ap.parse_args(argv)
    args.started = STARTED if __name__ == "__main__" else time.time()  # a forked worker imported nothing
    main(args)


if __name__ == "__main__":
    run(*sys.argv[1:])
    gc.freeze()  # the interpreter's final collections over torch's objects are slow on a loaded machine
    sys.stdout.flush()
