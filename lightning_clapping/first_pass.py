"""The pass that finds which values cross cuts (once per kind of step) leaves nothing behind on the Lightning side.

:meth:`~lightning_clapping.pipeline.executor.PipelineExecutor.plan_crossings` runs the user's step once more on
micro-batch 0 before the first real step of each kind. The engine puts the module's buffers and torch's random streams
back itself; :func:`quiet` drops what the step logged and puts the states of the module's torchmetrics metrics back,
so the pass changes no logged value and no metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torchmetrics import Metric


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [v.clone() for v in value]
    return value.clone() if hasattr(value, "clone") else value


@contextmanager
def quiet(module: nn.Module, relay: Any) -> Iterator[None]:
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m, {k: _copy(getattr(m, k)) for k in m._defaults},
              (m._update_count, m._computed, m._forward_cache)) for m in metrics]
    try:
        yield
    finally:
        relay.clear()
        for m, states, (count, computed, cache) in saved:
            for k, v in states.items():
                setattr(m, k, v)
            m._update_count, m._computed, m._forward_cache = count, computed, cache
