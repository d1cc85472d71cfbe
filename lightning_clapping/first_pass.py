"""The pass that finds which values cross cuts (once per kind of step) leaves nothing behind on the Lightning side.

:meth:`~lightning_clapping.pipeline.executor.PipelineExecutor.plan_crossings` runs the user's step once more on
micro-batch 0 before the first real step of each kind. The engine puts the module's buffers and torch's random streams
back itself; :func:`quiet` drops what the step logged, puts the states of the module's torchmetrics metrics back, and
undoes what the step did to the modules' own Python attributes (a list the step appends to, a counter, a new
attribute), so the pass changes no logged value, no metric and nothing an epoch-end hook reads.
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


class _Attributes:
    """The public attributes of a module (``self.outputs``, ``self.calls``) as they were: bindings, and the contents
    of lists, dicts and sets (a step appends to them in place)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bound = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        self.contents = {k: (v, type(v)(v)) for k, v in self.bound.items() if type(v) in (list, dict, set)}

    def restore(self) -> None:
        attrs = vars(self.module)
        for k in [k for k in attrs if not k.startswith("_") and k not in self.bound]:
            del attrs[k]
        attrs.update(self.bound)
        for container, saved in self.contents.values():
            container.clear()
            if isinstance(container, list):
                container.extend(saved)
            else:
                container.update(saved)


@contextmanager
def quiet(module: nn.Module, relay: Any) -> Iterator[None]:
    modules = list(module.modules())
    metrics = [m for m in modules if isinstance(m, Metric)]
    saved = [(m, {k: _copy(getattr(m, k)) for k in m._defaults},
              (m._update_count, m._computed, m._forward_cache)) for m in metrics]
    attributes = [_Attributes(m) for m in modules if not isinstance(m, Metric)]
    try:
        yield
    finally:
        relay.clear()
        for a in attributes:
            a.restore()
        for m, states, (count, computed, cache) in saved:
            for k, v in states.items():
                setattr(m, k, v)
            m._update_count, m._computed, m._forward_cache = count, computed, cache
