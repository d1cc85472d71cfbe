"""FitBottlenecks at the start of training, in one process or on the pipeline's stages.

python fit_bottlenecks_run.py OUT MODE    MODE: single | noisy | plain | pipe | replicas | resume | mask | differ

A per-token MLP on [batch, 5, 16] inputs with two bottlenecks, ``Bottleneck(32, 4)`` at ``net.2`` and
``Bottleneck(32, 6)`` at ``net.5``; each batch is (x, mask, y) and only the masked positions count, in the loss and in
the fit (``positions=lambda b: b[1]``). Modes:

- ``single``: one process; ``noisy``: the same drawing input noise in each step; ``plain``: ``noisy`` without the
  callback;
- ``pipe``: 3 stages cut at both bottlenecks; ``replicas``: 2 stages (cut at ``net.2``) x 2 replicas, each with half
  of four batches;
- ``resume``: one process, resumed from ``single``'s checkpoint (after its 3 steps) for 2 more;
- ``mask``: 3 stages, with a mask that fits no bottleneck's input; ``differ``: 3 stages, with batches that differ
  between the processes.

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


def data():
    x, mask, y = (torch.cat(t) for t in zip(*batches(seed=2, n=4)))
    return DataLoader(TensorDataset(x, mask, y), batch_size=8)


class Record(L.Callback):
    """Right after FitBottlenecks (the next callback in the list): what this rank holds, and torch's RNG."""

    def __init__(self, out, fit):
        self.out, self.fit = out, fit

    def on_train_start(self, trainer, pl_module):
        held = {k: v.tolist() for k, v in pl_module.state_dict().items()
                if (".down." in k or ".up." in k) and not v.is_meta}
        self.out.update(held=held, kept=None if self.fit is None else self.fit.kept,
                        rng=torch.get_rng_state().double().sum().item())


def main(out: Path, mode: str) -> None:
    L.seed_everything(0, verbose=False)
    model = FitMLP(noise=0.01 if mode in ("noisy", "plain") else 0.0)
    fit_batches = batches()
    positions = (lambda b: b[1]) if mode != "mask" else (lambda b: b[1][:, :-1])
    if mode == "replicas":  # replica r (ranks 2r, 2r + 1) fits on batches 2r and 2r + 1 of four
        replica = int(os.environ.get("LOCAL_RANK", 0)) // 2
        fit_batches = batches(n=4)[2 * replica:2 * replica + 2]
    if mode == "differ":
        fit_batches = batches(seed=1 + int(os.environ.get("LOCAL_RANK", 0)))
    fit = None if mode == "plain" else FitBottlenecks(fit_batches, positions=positions)
    record = {}
    callbacks = [c for c in (fit, Record(record, fit)) if c is not None]
    strategy, devices = "auto", 1
    if mode in ("pipe", "mask", "differ"):
        strategy, devices = ClappingStrategy(split_points=["net.2", "net.5"], microbatches=2), 3
    elif mode == "replicas":
        strategy, devices = ClappingStrategy(split_points=["net.2"], microbatches=2), 4
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3 + 2 * (mode == "resume"),
                        logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    ckpt = out / "fit_single.ckpt"
    trainer.fit(model, data(), ckpt_path=ckpt if mode == "resume" else None)
    if mode == "single":
        trainer.save_checkpoint(ckpt)
    record["losses"] = model.losses
    (out / f"fit_{mode}_{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
