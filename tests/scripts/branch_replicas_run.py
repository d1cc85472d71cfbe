"""Replicas whose steps use different parameters: a branch that only some samples take, on each stage.

python branch_replicas_run.py MODE OUT [HOOK[,HOOK...]]
    MODE "dp": 2 stages x 2 replicas (4 processes). Replica 0's samples take both branches now and then; replica 1's
    never do, so its stages hold no gradient for the branches' parameters.
    MODE "single": one process (no pipeline), each batch the union of the replicas' batches.
    HOOK: "ddp_fp16" averages through DDP's fp16 compression hook, "plain" (default) with the all-reduce; several
    run one after the other in the same processes.

Every rank writes OUT/branch_<mode>_<hook>_rank<r>.pt: the parameters its stage holds after training (and, at
start, the branches' initial values), and what an ``all_gather`` inside ``on_train_epoch_end`` returned.
"""

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping

PER_REPLICA = 8
STEPS = 4


def replica_data(replica: int) -> TensorDataset:
    """Replica 0: every other sample has x[:, 0] > 0 (takes the branches); replica 1: none has."""
    g = torch.Generator().manual_seed(11 + replica)
    x = torch.randn(PER_REPLICA * STEPS, 8, generator=g)
    sign = torch.tensor([1.0, -1.0]).repeat(len(x) // 2) if replica == 0 else -torch.ones(len(x))
    x[:, 0] = x[:, 0].abs() * sign + 0.1 * sign
    y = torch.randint(0, 4, (len(x),), generator=g)
    return TensorDataset(x, y)


class BranchNet(L.LightningModule):
    """Stage 0: ``body`` and ``branch0``; stage 1 (``split_points=["head"]``): ``head`` and ``branch1``. A branch
    runs only on the samples with x[:, 0] > 0, and not at all when a micro-batch has none."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.branch0 = nn.Linear(16, 16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.branch1 = nn.Linear(4, 4)
        self.gathered: list[float] = []

    def forward(self, x):
        mask = x[:, 0] > 0
        h = self.body(x)
        if mask.any():
            delta = torch.zeros_like(h)
            delta[mask] = self.branch0(h[mask])
            h = h + delta
        z = self.head(h)
        if mask.any():
            delta = torch.zeros_like(z)
            delta[mask] = self.branch1(z[mask])
            z = z + delta
        return z

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_epoch_end(self):
        # the hook runs on the last stage of every replica: a gather over the replicas has every participant
        self.gathered = self.all_gather(torch.tensor(float(self.global_rank))).reshape(-1).tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class Data(L.LightningDataModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def train_dataloader(self):
        if self.mode == "dp":
            return DataLoader(replica_data(self.trainer.strategy.replica), batch_size=PER_REPLICA)
        a, b = replica_data(0).tensors, replica_data(1).tensors
        # step s's batch: replica 0's batch s, then replica 1's
        order = torch.arange(2 * STEPS * PER_REPLICA).view(2, STEPS, PER_REPLICA).transpose(0, 1).reshape(-1)
        union = TensorDataset(*(torch.cat([a[i], b[i]])[order] for i in range(2)))
        return DataLoader(union, batch_size=2 * PER_REPLICA)


class Keep(L.Callback):
    """Each rank's own stage's parameters at the start and at the end of training."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    @staticmethod
    def _own(module):
        return {k: p.detach().clone() for k, p in module.named_parameters() if not p.is_meta}

    def on_train_start(self, trainer, pl_module):
        self.start = self._own(pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = self._own(pl_module)


def hook_kwargs(name: str) -> dict:
    if name == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        return {"ddp_comm_hook": fp16_compress_hook}
    return {}


def main(mode: str, out: Path, hook: str) -> None:
    torch.manual_seed(0)
    model = BranchNet()
    keep = Keep()
    if mode == "dp":
        strategy = lightning_clapping.ClappingStrategy(split_points=["head"], microbatches=2, log_bytes=False,
                                                       timeout=timedelta(seconds=60), **hook_kwargs(hook))
        devices = 4
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[keep],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, deterministic=True)
    trainer.fit(model, datamodule=Data(mode))
    torch.save({"start": keep.start, "end": keep.end, "gathered": model.gathered},
               out / f"branch_{mode}_{hook}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for name in (sys.argv[3] if len(sys.argv) > 3 else "plain").split(","):
        main(sys.argv[1], Path(sys.argv[2]), name)
