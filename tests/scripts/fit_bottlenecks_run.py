"""FitBottlenecks at the start of training, in one process or on the pipeline's stages.

python fit_bottlenecks_run.py OUT MODE

A per-token MLP on [batch, 5, 16] inputs with two bottlenecks, ``Bottleneck(32, 4)`` at ``net.2`` and
``Bottleneck(32, 6)`` at ``net.5``; each batch is (x, mask, y) and only the masked positions count, in the loss and in
the fit (``positions=lambda b: b[1]``). Modes:

- ``single``: one process; ``noisy``: the same drawing input noise in each step; ``plain``: ``noisy`` without the
  callback (it saves a checkpoint);
- ``pipe``: 3 stages cut at both bottlenecks; ``replicas``: 2 stages (cut at ``net.2``) x 2 replicas, each with half
  of four batches (``lopsided``: replica 1 with none); ``late``: 3 stages cut at ``net.1`` and ``net.5``, so stage 1 holds all of ``net.2`` and the
  ``down`` half of ``net.5``, and stage 0 none;
- ``resume``: one process, resumed from ``single``'s checkpoint (after its 3 steps) for 2 more; ``resume_plain``:
  the same from ``plain``'s checkpoint, saved without the callback;
- ``tuner``: one process with Lightning's ``LearningRateFinder`` (3 steps, from a checkpoint it restores);
- ``bf16``: 3 stages as ``pipe`` in ``bf16-true``; ``bf16single``: one process in ``bf16-true``;
- ``mask``: 3 stages, with a mask that fits no bottleneck's input; ``differ``: 3 stages, with batches that differ
  between the processes; ``nopos``: 3 stages, with a mask that counts no position; ``small``: 3 stages, training
  batches of one sample for 2 micro-batches.

Each rank writes OUT/fit_MODE_RANK.json: the bottleneck halves this rank holds right after the fit (before the first
step), the callback's kept fractions, a digest of torch's random state at that point, and the training losses.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from lightning.pytorch.callbacks import LearningRateFinder
from torch.utils.data import DataLoader, TensorDataset

from lightning_clapping import Bottleneck, ClappingStrategy, FitBottlenecks

SEQ = 5


class FitMLP(L.LightningModule):
    def __init__(self, noise: float = 0.0):
        super().__init__()
        self.noise = noise  # input noise drawn in every step (augmentation): the fit draws it too
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Bottleneck(32, 4), nn.Linear(32, 32), nn.Tanh(),
                                 Bottleneck(32, 6), nn.Linear(32, 4))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        x = x + self.noise * torch.randn_like(x)
        # the mean over samples of each one's mean over its counted positions (as micro-batches
        per_token = F.cross_entropy(self.net(x).transpose(1, 2), y, reduction="none")  # are weighted: by samples)
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def batches(seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(8, SEQ, 16, generator=g) * torch.linspace(0.2, 2.0, 16)
        mask = torch.rand(8, SEQ, generator=g) < 0.7
        out.append((x, mask, (x[..., 0] > 0).long() + 2 * (x[..., 1] > 0).long()))
    return out


def data(batch_size=8):
    x, mask, y = (torch.cat(t) for t in zip(*batches(seed=2, n=4)))
    return DataLoader(TensorDataset(x, mask, y), batch_size=batch_size)


class Record(L.Callback):
    """Right after FitBottlenecks (the next callback in the list): what this rank holds, and torch's RNG."""

    def __init__(self, out, fit):
        self.out, self.fit = out, fit

    def on_train_start(self, trainer, pl_module):
        held = {k: v.float().tolist() for k, v in pl_module.state_dict().items()
                if (".down." in k or ".up." in k) and not v.is_meta}
        self.out.update(held=held, kept=None if self.fit is None else self.fit.kept,
                        rng=torch.get_rng_state().double().sum().item())


def main(out: Path, mode: str) -> None:
    L.seed_everything(0, verbose=False)
    model = FitMLP(noise=0.01 if mode in ("noisy", "plain") else 0.0)
    fit_batches = batches()
    positions = {"mask": lambda b: b[1][:, :-1], "nopos": lambda b: torch.zeros_like(b[1])}.get(mode, lambda b: b[1])
    if mode in ("replicas", "lopsided"):  # replica r (ranks 2r, 2r + 1) fits on batches 2r and 2r + 1 of four
        replica = int(os.environ.get("LOCAL_RANK", 0)) // 2
        fit_batches = batches(n=4)[2 * replica:2 * replica + 2] if mode == "replicas" or replica == 0 else []
    if mode == "differ":
        fit_batches = batches(seed=1 + int(os.environ.get("LOCAL_RANK", 0)))
    fit = None if mode == "plain" else FitBottlenecks(fit_batches, positions=positions)
    record = {}
    resume = {"resume": "fit_single.ckpt", "resume_plain": "fit_plain.ckpt"}.get(mode)
    tuner = [LearningRateFinder(num_training_steps=3, early_stop_threshold=None, update_attr=False)] * (mode == "tuner")
    callbacks = [c for c in (*tuner, fit, Record(record, fit)) if c is not None]
    strategy, devices = "auto", 1
    if mode in ("pipe", "mask", "differ", "nopos", "bf16", "small"):
        strategy, devices = ClappingStrategy(split_points=["net.2", "net.5"], microbatches=2), 3
    elif mode == "late":
        strategy, devices = ClappingStrategy(split_points=["net.1", "net.5"], microbatches=2), 3
    elif mode in ("replicas", "lopsided"):
        strategy, devices = ClappingStrategy(split_points=["net.2"], microbatches=2), 4
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3 + 2 * bool(resume),
                        precision="bf16-true" if mode.startswith("bf16") else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(model, data(1 if mode == "small" else 8), ckpt_path=out / resume if resume else None)
    if mode in ("single", "plain"):
        trainer.save_checkpoint(out / f"fit_{mode}.ckpt")
    record["losses"] = model.losses
    (out / f"fit_{mode}_{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
