"""The plan of the values that cross cuts besides the cut modules' inputs: which value rides over which boundary.

:mod:`lightning_clapping.pipeline.crossings` finds, on every stage, the values its own code needs from earlier
stages (:class:`Need`); the stages exchange them once per kind of step (:func:`gather_needs`) and build the same
:class:`Plan` from them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


class CrossingError(RuntimeError):
    """A value crosses a cut in a way the pipeline cannot carry (the message says which and what to change)."""


def where(event: int) -> str:
    """How messages name an event: "module call 3" or "operation 2 after module call 3"."""
    module, offset = event >> 24, event & 0xFFFFFF
    return f"module call {module}" if offset == 0 else f"operation {offset} after module call {module}"


def op_code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Need:
    """One value a stage needs: made at ``event`` (its output ``leaf``) in region ``origin`` by operation ``op``."""

    event: int
    leaf: int
    origin: int
    consumer: int
    op: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.event, self.leaf)


class Plan:
    """Which values cross each boundary besides the cut module's inputs (the same on every stage)."""

    def __init__(self, needs: Iterable[Need], num_stages: int) -> None:
        self.needs = sorted(set(needs), key=lambda n: (n.event, n.leaf, n.consumer))
        self.num_stages = num_stages
        ops: dict[tuple[int, int], tuple[int, int]] = {}
        for n in self.needs:
            if ops.setdefault(n.key, (n.origin, n.op)) != (n.origin, n.op):
                raise CrossingError(
                    f"the stages disagree about the value made at {where(n.event)} of the step: their forwards run "
                    "different operations there. Every process must run the same code on the same batch.")
        self._ops = ops
        self._crossing: list[list[tuple[int, int]]] = []
        for b in range(max(0, num_stages - 1)):
            keys = {n.key for n in self.needs if n.origin <= b < n.consumer}
            self._crossing.append(sorted(keys))

    def crossing(self, boundary: int) -> list[tuple[int, int]]:
        """Keys sent over ``boundary`` (stage ``boundary`` to ``boundary + 1``), in message order."""
        return self._crossing[boundary] if 0 <= boundary < len(self._crossing) else []

    def origin(self, key: tuple[int, int]) -> int:
        return self._ops[key][0]

    def op(self, key: tuple[int, int]) -> int:
        return self._ops[key][1]

    def made_on(self, stage: int) -> dict[int, list[int]]:
        """Events whose outputs this stage makes and sends: event -> leaves."""
        out: dict[int, list[int]] = {}
        for key in self.crossing(stage):
            if self.origin(key) == stage:
                out.setdefault(key[0], []).append(key[1])
        return out

    def rows(self) -> list[tuple[int, ...]]:
        return [(n.event, n.leaf, n.origin, n.consumer, n.op) for n in self.needs]

    def describe(self) -> str:
        if not self.needs:
            return "no values cross a cut besides the cut modules' inputs"
        parts = [f"boundary {b}: {len(keys)}" for b, keys in enumerate(self._crossing) if keys]
        return f"{len(self._ops)} values cross cuts besides the cut modules' inputs ({', '.join(parts)})"


def gather_needs(needs: list[Need], exchange: Callable[[Tensor], list[Tensor]]) -> list[Need]:
    """Every stage's needs, from rows of integers: ``exchange(rows)`` all-gathers an int64 tensor of shape (n, 5)
    whose ``n`` may differ between stages and returns each stage's."""
    rows = torch.tensor([(n.event, n.leaf, n.origin, n.consumer, n.op) for n in needs], dtype=torch.int64)
    out = []
    for block in exchange(rows.reshape(-1, 5)):
        out.extend(Need(*map(int, r)) for r in block.tolist())
    return out


__all__ = ["CrossingError", "Need", "Plan", "gather_needs", "op_code", "where"]
