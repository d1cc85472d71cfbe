"""The pass that finds which values cross cuts (once per kind of step) leaves nothing behind on the Lightning side.

:meth:`~lightning_clapping.pipeline.executor.PipelineExecutor.plan_crossings` runs the user's step once more on
micro-batch 0 before the first real step of each kind. The engine puts the module's buffers and torch's random streams
back itself; :func:`quiet` drops what the step logged, puts the states of the module's torchmetrics metrics back,
undoes what the step did to the modules' own Python attributes (a list the step appends to, a counter, a new
attribute, a tensor attribute changed in place such as ``self.total += loss``), and puts back every other random
stream the step may draw from (Python's ``random``, numpy's global one, and generators held as attributes:
``torch.Generator``, numpy ``Generator``/``RandomState``, ``random.Random``), so the pass changes no logged value, no
metric, nothing an epoch-end hook reads, and no later random draw.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torchmetrics import Metric


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [v.clone() for v in value]
    return value.clone() if hasattr(value, "clone") else value


#: how to read and put back the state of each kind of random generator a module may hold
_GENERATORS: list[tuple[type, Any, Any]] = [
    (torch.Generator, lambda g: g.get_state(), lambda g, s: g.set_state(s)),
    (np.random.Generator, lambda g: g.bit_generator.state, lambda g, s: setattr(g.bit_generator, "state", s)),
    (np.random.RandomState, lambda g: g.get_state(), lambda g, s: g.set_state(s)),
    (random.Random, lambda g: g.getstate(), lambda g, s: g.setstate(s)),
]


class _Streams:
    """Python's and numpy's global random streams and the generators held in ``holders``' attributes, as they were."""

    def __init__(self, holders: list[Any]) -> None:
        self.python, self.numpy = random.getstate(), np.random.get_state()
        self.held = []
        for holder in holders:
            for value in vars(holder).values():
                for kind, get, put in _GENERATORS:
                    if isinstance(value, kind):
                        self.held.append((value, put, get(value)))
                        break

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        for generator, put, state in self.held:
            put(generator, state)


class _Attributes:
    """The attributes of a module as they were: public bindings (``self.outputs``, ``self.calls``), the contents of
    lists, dicts and sets (a step appends to them in place), and the values of plain tensor attributes, public or not
    (``self.total += loss.detach()`` changes the tensor in place)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bound = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        self.contents = {k: (v, type(v)(v)) for k, v in self.bound.items() if type(v) in (list, dict, set)}
        self.tensors = [(v, v.detach().clone()) for v in vars(module).values()
                        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.device.type != "meta"
                        and not v.is_inference()]

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
        with torch.no_grad():
            for tensor, saved in self.tensors:
                if tensor.shape == saved.shape:
                    tensor.copy_(saved)


@contextmanager
def quiet(module: nn.Module, relay: Any) -> Iterator[None]:
    modules = list(module.modules())
    metrics = [m for m in modules if isinstance(m, Metric)]
    saved = [(m, {k: _copy(getattr(m, k)) for k in m._defaults},
              (m._update_count, m._computed, m._forward_cache)) for m in metrics]
    attributes = [_Attributes(m) for m in modules if not isinstance(m, Metric)]
    streams = _Streams(modules)
    try:
        yield
    finally:
        relay.clear()
        streams.restore()
        for a in attributes:
            a.restore()
        for m, states, (count, computed, cache) in saved:
            for k, v in states.items():
                setattr(m, k, v)
            m._update_count, m._computed, m._forward_cache = count, computed, cache
