"""Data parallel × pipeline: which rank runs which stage of which replica, and averaging gradients over replicas.

``P`` stages × ``D`` replicas run on ``P * D`` processes. Replica ``r`` holds the consecutive global ranks
``r * P .. r * P + P - 1`` (so a replica's stages share a node whenever a node has room for them), and within a
replica the last stage comes first: global rank 0 runs the last stage of replica 0, where Lightning's loggers and
progress bar see the metrics first-hand. The ranks form a 2-D :class:`torch.distributed.device_mesh.DeviceMesh`
with dimensions ``("dp", "pp")``: the ``"pp"`` group of a rank is its replica's pipeline, the ``"dp"`` group the
replicas of its stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: gradients are all-reduced in buckets of about this many bytes (as DDP's default)
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Topology:
    """``stages`` × ``replicas`` processes; ``ranks_per_node`` processes on each node."""

    stages: int
    replicas: int
    ranks_per_node: int

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + self.stages - 1 - stage

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 - rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def layout(self) -> list[list[int]]:
        """Global ranks by (replica, stage): the DeviceMesh's ("dp", "pp") coordinates."""
        return [[self.rank(r, s) for s in range(self.stages)] for r in range(self.replicas)]

    def check(self) -> None:
        """A replica either fits in one node or fills whole nodes; anything else splits replicas unevenly."""
        per_node, p = self.ranks_per_node, self.stages
        if self.replicas > 1 and per_node % p and p % per_node:
            raise ValueError(
                f"{p} stages x {self.replicas} replicas on nodes of {per_node} processes: replica 1's stages would "
                f"straddle nodes at a different place than replica 0's, so the replicas' pipelines would differ in "
                f"which links cross nodes. Use a number of stages that divides the processes per node (or is a "
                f"multiple of it), e.g. stages={_divisor_hint(per_node, p)}, or devices={p} per node."
            )

    def crossings(self) -> list[int]:
        """Boundaries whose two stages sit on different nodes (in any replica)."""
        return [m for m in range(self.stages - 1)
                if any(self.node_of(self.rank(r, m)) != self.node_of(self.rank(r, m + 1)) for r in range(self.replicas))]

    def describe(self) -> str:
        """Where every stage runs, and which boundaries cross nodes (the links compression is for)."""
        lines = [f"{self.stages} stages x {self.replicas} replica{'s' if self.replicas > 1 else ''} on "
                 f"{-(-self.world_size // self.ranks_per_node)} node(s) of {self.ranks_per_node} processes"]
        for s in range(self.stages):
            where = ", ".join(f"rank {self.rank(r, s)} (node {self.node_of(self.rank(r, s))})"
                              for r in range(self.replicas))
            lines.append(f"  stage {s}: {where}")
        crossing = self.crossings()
        lines.append("  boundaries crossing nodes: " + (", ".join(str(m) for m in crossing) if crossing else "none"))
        return "\n".join(lines)


def _divisor_hint(per_node: int, stages: int) -> int:
    divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
    return min(divisors, key=lambda d: (abs(d - stages), d))


def build_mesh(topology: Topology, device_type: str) -> Any:
    """Collective (every rank, once): the ("dp", "pp") DeviceMesh and its process groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.tensor(topology.layout()), mesh_dim_names=("dp", "pp"))


class GradientAverager:
    """Average a stage's gradients over its replicas: bucketed, asynchronous all-reduces.

    :meth:`start` launches them (right after the stage's last backward of a step, so they overlap the rest of the
    pipeline's drain); :meth:`finish` waits and writes the averages back into ``.grad``. Every replica must have
    gradients for the same parameters, as under DDP without ``find_unused_parameters``.

    ``comm_hook`` (``hook(state, bucket) -> Future``, the signature of PyTorch's DDP communication hooks, such as
    ``default_hooks.fp16_compress_hook`` or ``powerSGD_hook.powerSGD_hook``) replaces the plain all-reduce: it gets
    each bucket (``buffer()``, ``gradients()``, ``parameters()``, ``index()``, ``is_last()``) and returns a future
    of the averaged buffer. ``comm_state`` is the hook's state; ``None`` gives it ``group`` (what the fp16/bf16
    hooks take), and a state whose ``process_group`` is ``None`` (PowerSGD's default) gets ``group`` there, so the
    hook reduces over this stage's replicas and not over every rank.
    """

    def __init__(self, group: Any, replicas: int, bucket_bytes: int = BUCKET_BYTES, comm_hook: Any = None,
                 comm_state: Any = None) -> None:
        self.group = group
        self.replicas = replicas
        self.bucket_bytes = bucket_bytes
        self.comm_hook = comm_hook
        if comm_hook is not None and comm_state is None:
            comm_state = group
        elif comm_state is not None and getattr(comm_state, "process_group", False) is None:
            comm_state.process_group = group
        self.comm_state = comm_state
        self._pending: list[tuple[Any, Tensor, list[Tensor]]] = []

    def start(self, params: list[torch.nn.Parameter]) -> None:
        if self._pending:
            raise RuntimeError("GradientAverager.start() called twice without finish()")
        params = [p for p in params if p.grad is not None]
        buckets = _buckets([p.grad for p in params], self.bucket_bytes)
        first = 0
        for index, grads in enumerate(buckets):
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.comm_hook is None:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            else:
                bucket = _Bucket(index, flat, grads, params[first:first + len(grads)], index == len(buckets) - 1)
                work = self.comm_hook(self.comm_state, bucket)
            first += len(grads)
            self._pending.append((work, flat, grads))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, flat, grads in pending:
            if self.comm_hook is None:
                work.wait()
                flat.div_(self.replicas)
            else:  # a hook's future holds the averaged buffer
                value = work.wait()
                flat = value[0] if isinstance(value, (list, tuple)) else value
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)


class _Bucket:
    """What a DDP communication hook reads of a bucket (the methods of ``torch.distributed.GradBucket``)."""

    def __init__(self, index: int, flat: Tensor, grads: list[Tensor], params: list[Tensor], last: bool) -> None:
        self._index, self._flat, self._params, self._last = index, flat, params, last
        views, offset = [], 0
        for g in grads:
            views.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self._views = views

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._flat

    def gradients(self) -> list[Tensor]:
        return self._views

    def parameters(self) -> list[Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: Tensor) -> None:
        self._flat.copy_(buffer)


def _buckets(grads: list[Tensor], limit: int) -> list[list[Tensor]]:
    """Consecutive runs of gradients with the same dtype and device, each up to ``limit`` bytes (at least one)."""
    out: list[list[Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != g.dtype or last[0].device != g.device or size + nbytes > limit:
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out
