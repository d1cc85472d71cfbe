"""How a stage's data-parallel replicas stay together (``replica_sync=``): every-step averaging, LAG, or DiLoCo's
local updates; :mod:`.config` is the argument, :mod:`.base` the hooks the step driver calls."""

from __future__ import annotations

from typing import Any

from lightning_clapping.comm.replicas import GradientAverager
from lightning_clapping.sync.base import ReplicaSync
from lightning_clapping.sync.config import LAG, DiLoCo, EveryStep, resolve

__all__ = ["LAG", "DiLoCo", "EveryStep", "ReplicaSync", "make_sync", "resolve"]


def make_sync(mode: Any, placement: Any, comm_hook: Any = None, comm_state: Any = None) -> ReplicaSync | None:
    """The sync of this rank's stage over its replicas (``None`` with one replica)."""
    if placement.num_replicas == 1:
        return None
    group, replicas, device = placement.dp_group, placement.num_replicas, placement.device
    if isinstance(mode, LAG):
        from lightning_clapping.sync.lag import LazyAggregation

        return LazyAggregation(mode, group, replicas, device)
    if isinstance(mode, DiLoCo):
        from lightning_clapping.sync.local_updates import LocalUpdates

        return LocalUpdates(mode, group, replicas, placement.replica, device)
    from lightning_clapping.sync.every_step import EveryStepSync

    return EveryStepSync(GradientAverager(group, replicas, comm_hook=comm_hook, comm_state=comm_state))
