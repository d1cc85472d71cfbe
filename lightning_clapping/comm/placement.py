"""Who runs which stage of which replica, over which process groups.

``P`` stages × ``D`` replicas run on ``P * D`` processes. Replica ``r`` holds the consecutive global ranks
``r * P .. r * P + P - 1`` (so a replica's stages share a node whenever a node has room for them), and within a
replica the last stage comes first: global rank 0 runs the last stage of replica 0, where Lightning's loggers and
progress bar see the metrics first-hand. The ranks form a 2-D :class:`torch.distributed.device_mesh.DeviceMesh`
with dimensions ``("dp", "pp")``: the ``"pp"`` group of a rank is its replica's pipeline, the ``"dp"`` group the
replicas of its stage.

:class:`Topology` is the arithmetic (no process group needed); :class:`Placement` is one rank's view of it, with
its device and groups: the one object the engine (executor, byte statistics, autotune, watchdog) is handed instead
of the strategy or loose values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


@dataclass(frozen=True)
class Placement:
    """This rank in the run: its stage of its replica, its device, and the groups it talks over.

    ``pp_group`` is this rank's replica (its pipeline), ``dp_group`` the replicas of its stage; both are ``None`` in
    a one-process run.
    """

    topology: Topology
    global_rank: int
    device: torch.device
    pp_group: Any = None
    dp_group: Any = None

    @property
    def num_stages(self) -> int:
        return self.topology.stages

    @property
    def num_replicas(self) -> int:
        return self.topology.replicas

    @property
    def num_ranks(self) -> int:
        return self.topology.world_size

    @property
    def stage(self) -> int:
        return self.topology.stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self.topology.replica_of(self.global_rank)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of_stage(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's replica."""
        return self.topology.rank(self.replica, stage)

    def stage_of_rank(self, rank: int) -> int:
        return self.topology.stage_of(rank)

    @property
    def last_rank(self) -> int:
        """The global rank of this replica's last stage (where the loss and the logged values are)."""
        return self.rank_of_stage(self.num_stages - 1)
