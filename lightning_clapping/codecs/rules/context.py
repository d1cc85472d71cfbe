"""What both ends of every boundary know about a step (:class:`StepContext`) and what a rule counts
(:class:`RuleStats`), with the names of the variants.

They sit apart from the rules because the memory (:mod:`.memory`), the rules (:mod:`.base` and one module per
variant family) and their callers (the executor, the step driver) all read them; none of them needs a rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["RuleStats", "StepContext", "VARIANTS", "check_variant"]

VARIANTS = ("uncompressed", "direct", "ef21", "aqsgd", "clapping-fc", "clapping-fu")


@dataclass
class StepContext:
    """What both ends of every boundary know about the current step."""

    step: int = 0
    fresh: bool = True
    #: per micro-batch, the ids of its samples (AQ-SGD), else None
    sample_ids: list[Tensor] | None = None
    #: per micro-batch, its number of samples (every stage splits the same batch, so both ends know it)
    sizes: list[int] | None = None


@dataclass
class RuleStats:
    messages: int = 0
    full: int = 0
    compressed: int = 0
    skipped: int = 0
    diff_sq: float = 0.0  # squared norm of the differences that were compressed
    value_sq: float = 0.0  # squared norm of the values they stand for
    extra: dict[str, Any] = field(default_factory=dict)


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return variant
