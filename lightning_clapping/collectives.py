"""Lightning's collectives on a pipeline: over the data-parallel replicas, never over the stages.

Every stage of a replica already holds that replica's last-stage values (relayed with each step, see
:mod:`lightning_clapping.log_relay`), so what Lightning reduces or gathers (``sync_dist=True``, ``all_gather``,
the distributed sampler) goes over the ranks that run the same stage: the strategy's ``world_size`` is the number
of replicas, as under DDP. Decisions (early stopping, checkpointing) are rank 0's, where the last stage of replica 0
runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

from lightning_clapping import _compat
from lightning_clapping.comm import safe_objects


class ReplicaCollectives:
    """The collective hooks of :class:`~lightning_clapping.ClappingStrategy` (a mixin: it reads the strategy's
    ``num_replicas``, ``replica``, ``placement`` and ``root_device``)."""

    num_replicas: int
    replica: int
    placement: Any
    root_device: torch.device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a replica sees the same batch; replicas shard the data as DDP's ranks do (with one replica,
        # setup() stops Lightning from injecting a sampler at all: the data must come in the user's own order)
        return {"num_replicas": self.num_replicas, "rank": self.replica}

    def barrier(self, name: str | None = None) -> None:
        """Every rank waits for every other. Under NCCL the barrier runs on this rank's device (as DDP's does):
        NCCL would otherwise guess a device from the rank, which need not be the one this rank drives."""
        if not _compat.distributed_is_initialized():
            return
        if self.root_device.type == "cuda" and "nccl" in str(dist.get_backend()).lower():
            index = self.root_device.index
            dist.barrier(device_ids=[torch.cuda.current_device() if index is None else index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank, as JSON and raw tensor bytes: nothing a peer sends is unpickled.
        Lightning broadcasts paths, strings and numbers; any tree of plain data, paths and tensors works. Another
        object is refused on every rank with a ``TypeError`` naming its type (broadcast its fields instead)."""
        if not _compat.distributed_is_initialized():
            return obj
        try:
            return safe_objects.broadcast(obj, src, device=self.root_device)
        except TypeError as err:
            raise TypeError(f"ClappingStrategy.broadcast sends plain data (dict, list, tuple, str, numbers, None, "
                            f"paths, tensors) and never pickles: {err}. Broadcast the object's fields "
                            "instead.") from None

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``sync_dist=True`` reduces over data-parallel replicas, never over stages: every stage already holds its
        replica's last-stage values (relayed), so the ranks of one stage reduce with each other (a ``"sum"`` is not
        multiplied by the number of stages). With one replica the value is returned as it is, without a
        collective."""
        if self.num_replicas == 1 or not isinstance(tensor, Tensor):
            return tensor
        return _compat.sync_if_available(tensor, group if group is not None else self.placement.dp_group, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gathers over the replicas (the ranks of this rank's stage), as DDP gathers over its ranks, also for
        ``group=WORLD`` (the strategy's world is its replicas); with one replica the tensor is returned as it is (a
        single device adds no dimension either)."""
        if group is None or group is dist.group.WORLD:  # LightningModule.all_gather's default: the whole world
            if self.num_replicas == 1:
                return tensor
            group = self.placement.dp_group
        return _compat.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The last stage (rank 0) holds the authoritative metrics, so its decision is everyone's."""
        if not _compat.distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())
