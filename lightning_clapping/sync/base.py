"""The seam between a training step and the replicas of its stage: :class:`ReplicaSync`.

The step driver calls :meth:`ReplicaSync.on_train_start` before a fit's first step, :meth:`ReplicaSync.before_batch`
as each training batch starts, then these hooks, in this order, once per optimizer step:

* :meth:`ReplicaSync.after_backward` when the stage's last backward of the step is done (the pipeline may still be
  draining: a sync can start its collectives here and overlap them);
* :meth:`ReplicaSync.before_step` before clipping and the optimizer step (the gradients the optimizer sees are
  final after it); a mode that :attr:`~ReplicaSync.votes` is then asked to :meth:`~ReplicaSync.commit` the update;
* :meth:`ReplicaSync.after_step` after the optimizer step (a local-update mode syncs the parameters here);
* :meth:`ReplicaSync.finish` at the end of a fit.

Around them: :meth:`ReplicaSync.on_loader` for each dataloader the strategy processes and :meth:`ReplicaSync.close`
at teardown. Fault tolerance (:class:`lightning_clapping.fault_tolerance.TorchftSync`) is a mode that uses them all.

Every mode keeps the replicas' parameters identical wherever the mode says they agree (every-step and LAG: after
every optimizer step; DiLoCo: after every outer step), and counts what this rank hands to torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping.comm.replicas import ring_share


class ReplicaSync:
    """One mode of keeping a stage's replicas together (see the module docstring). The base does nothing: one
    replica."""

    #: the mode's ``replica_sync`` name (what a checkpoint records)
    name = "none"
    #: whether :meth:`take_bytes` sees every byte this mode sends (a DDP communication hook's are its own)
    counted = True
    #: whether the replicas vote on each optimizer step (:meth:`commit`); the step driver then runs Lightning's
    #: closure (training step, backward) first and the update only when the vote commits
    votes = False

    def __init__(self) -> None:
        self._sent = self._raw = 0.0

    def on_loader(self, dataloader: Any) -> Any:
        """Each dataloader as the strategy processes it (a rejoining replica group takes its position here)."""
        return dataloader

    def before_batch(self) -> None:
        """As each training batch starts (before its forward)."""

    def commit(self, step: int) -> bool:
        """With :attr:`votes`: whether this optimizer step's update runs (the same answer on every replica)."""
        return True

    def close(self) -> None:
        """At teardown."""

    def on_train_start(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        """Before the first training step of a fit (after a checkpoint was loaded, if one was)."""

    def after_backward(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        """The stage's trainable parameters (same order on every replica; ``.grad`` may be None) and the
        optimizers of the step."""

    def before_step(self) -> None:
        """Before clipping and the optimizer step: the gradients in ``.grad`` are the ones to step with."""

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        """After the optimizer step of this optimizer step's parameters."""

    def finish(self, params: list[torch.nn.Parameter]) -> None:
        """At the end of a fit (collective over the replicas): make the replicas agree if the mode left them apart."""

    def take_bytes(self) -> tuple[float, float]:
        """(bytes sent, the same uncompressed in fp32) since the last call."""
        out = (self._sent, self._raw)
        self._sent = self._raw = 0.0
        return out

    def count(self, sent: float, raw: float = 0.0) -> None:
        self._sent += sent
        self._raw += raw

    def count_every_step_equivalent(self, params: list[torch.nn.Parameter], replicas: int) -> None:
        """The raw bytes of one optimizer step: what every-step averaging sends for ``params`` in fp32 (their
        gradients and a presence flag each), so that a mode's ratio is against uncompressed every-step training."""
        self._raw += ring_share(replicas) * (sum(p.numel() for p in params) + len(params)) * 4

    def state_dict(self) -> dict[str, Tensor]:
        """What a resumed run needs to go on as this one would: flat names to CPU tensors (a checkpoint keeps it
        with this rank's error-feedback buffers)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to restore, got keys {sorted(state)}")

    def state_bytes(self) -> int:
        """Bytes this mode keeps per rank besides the model and optimizer (copies of gradients or parameters)."""
        return 0


def check_same_start(params: list[torch.nn.Parameter], group: Any, device: torch.device, stage: int) -> None:
    """Collective over the stage's replicas, at a fit's first step: the replicas must start from the same weights
    (nothing broadcasts one replica's, unlike DDP), or every mode would train them apart for good. Compares a
    fingerprint of the stage's parameters (two float64 sums: 16 bytes each way, not counted in the byte totals)."""
    with torch.no_grad():
        mine = torch.zeros(2, dtype=torch.float64, device=device)
        for p in params:
            x = p.detach().double()
            mine += torch.stack([x.sum(), (x * x).sum()])
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(high, low):
        raise RuntimeError(
            f"the replicas of stage {stage} start from different weights: each process built its model from its own "
            "random numbers, so the replicas would train apart. Seed the model's construction the same way on every "
            "process (lightning.seed_everything(seed) before building the LightningModule), or load the same "
            "checkpoint on every process."
        )


def stage_params(optimizers: list[Any]) -> list[torch.nn.Parameter]:
    """This stage's trainable parameters, with a gradient or not (replicas may differ in which got one), in the same
    order on every replica; the other stages' (on the meta device) are left out."""
    seen: set[int] = set()
    out = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and not p.is_meta and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out
