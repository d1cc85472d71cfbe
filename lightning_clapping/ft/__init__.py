"""Fault-tolerant replicas through torchft: each data-parallel replica of the pipeline is its own job (a *replica
group* of ``stages`` processes), and stage ``s`` of every live group averages its gradients with the others through
a torchft ``Manager``. A group that loses a process drops out of the quorum; the others keep training; restarted,
it fetches a live peer's state and rejoins (see ``docs/fault_tolerance.md``).

This sub-package is plain torch + torchft: :mod:`.config` (what the user sets), :mod:`.group` (the manager, the
gradient hook, the commit gate), :mod:`.wire` and :mod:`.transport` (the pickle-free state hand-over),
:mod:`.sampler` (each group's shard, resumed mid-epoch). ``lightning_clapping.fault_tolerance`` ties them to the
Trainer.
"""

from lightning_clapping.ft.config import FaultTolerance, resolve

__all__ = ["FaultTolerance", "resolve"]
