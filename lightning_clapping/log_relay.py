"""``self.log`` inside a pipeline: record on the last stage, combine micro-batches, replay on every rank.

The user's ``training_step`` runs once per micro-batch, and only the last stage computes the loss and the metrics.
Logged values are therefore recorded instead of passed to Lightning, combined into one value per step (weighted by
each call's batch size, as Lightning itself weights values across steps), sent to every rank, and logged there
through the public ``LightningModule.log``. Every rank then has the same ``callback_metrics``, so
``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and ``sync_dist=True`` behave as in single-process training.

torchmetrics ``Metric`` objects keep their state on the last stage, which logs them as objects (Lightning computes
and resets them). Each step the last stage also sends the metric's running ``compute()`` value; the other ranks log
a small mirror Metric holding it, so their epoch value is exactly the last stage's.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_clapping._compat import set_metric_step_value

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_NOT_SENT = ("sync_dist_group", "metric_attribute")
_DEFAULTS = {k: p.default for k, p in _LOG_SIGNATURE.parameters.items() if p.default is not inspect.Parameter.empty}


@dataclass
class Record:
    name: str
    value: Any  # float, or a Metric object (last stage only)
    kwargs: dict[str, Any]
    weight: float


def _is_default(name: str, value: Any) -> bool:
    default = _DEFAULTS.get(name, inspect.Parameter.empty)
    return value is default or (type(value) is type(default) and isinstance(value, (bool, str)) and value == default)


class _MirrorMetric(Metric):
    """Stands in for a Metric of the last stage on the other ranks: holds the value it last received."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(sync_on_compute=False)
        self.add_state("value", torch.tensor(float("nan")), dist_reduce_fx=None)

    def update(self, value: Tensor) -> None:  # type: ignore[override]
        self.value = value

    def compute(self) -> Tensor:
        return self.value


class LogRelay:
    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.records: list[Record] = []
        self._mirrors: dict[str, _MirrorMetric] = {}

    @contextmanager
    def capture(self, batch_size: int):
        """Record the ``self.log`` calls made inside this block; ``batch_size`` is the micro-batch's size."""
        module = self.module

        def log(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(module, *args, **kwargs)
            bound.apply_defaults()
            kw = dict(bound.arguments)
            kw.pop("self")
            name, value = kw.pop("name"), kw.pop("value")
            weight = kw.get("batch_size") or batch_size
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    raise ValueError(f"self.log({name!r}, ...) needs a scalar, got a tensor of shape "
                                     f"{tuple(value.shape)}")
                value = float(value.detach().float().reshape(()))
            elif not isinstance(value, Metric):
                value = float(value)
            self.records.append(Record(name, value, kw, float(weight)))

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            module.__dict__.pop("log", None)

    def clear(self) -> None:
        self.records.clear()

    def combined(self) -> list[Record]:
        """One record per name, in first-logged order, micro-batches combined by the name's reduce_fx."""
        groups: dict[str, list[Record]] = {}
        for r in self.records:
            groups.setdefault(r.name, []).append(r)
        out = []
        for name, recs in groups.items():
            first = recs[0]
            total = sum(r.weight for r in recs)
            if isinstance(first.value, Metric):
                value: Any = first.value
            else:
                fx = first.kwargs.get("reduce_fx", "mean")
                vals = [r.value for r in recs]
                if fx in ("sum", torch.sum):
                    value = sum(vals)
                elif fx in ("max", torch.max):
                    value = max(vals)
                elif fx in ("min", torch.min):
                    value = min(vals)
                else:
                    value = sum(r.value * r.weight for r in recs) / total
            kwargs = dict(first.kwargs)
            kwargs["batch_size"] = int(round(total))
            out.append(Record(name, value, kwargs, total))
        return out

    def to_wire(self, records: list[Record]) -> list[tuple[str, float, dict[str, Any], Any]]:
        """A picklable copy. A Metric becomes (its running value, (attribute name, latest batch value))."""
        attributes = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
        wire = []
        for r in records:
            kwargs = {k: v for k, v in r.kwargs.items()  # defaults are left out: replay applies them again
                      if k not in _NOT_SENT and not _is_default(k, v)}
            if isinstance(r.value, Metric):
                cache = getattr(r.value, "_forward_cache", None)
                step = float(cache) if isinstance(cache, Tensor) and cache.numel() == 1 else float("nan")
                attribute = r.kwargs.get("metric_attribute") or attributes.get(id(r.value), r.name)
                wire.append((r.name, float(r.value.compute()), kwargs, (attribute, step)))
            else:
                wire.append((r.name, r.value, kwargs, None))
        return wire

    def replay(self, wire: list[tuple[str, float, dict[str, Any], Any]], local: list[Record] | None,
               device: torch.device) -> None:
        """Log the combined values through Lightning on this rank (``local``: the last stage's own records)."""
        own = {r.name: r for r in local or []}
        module = self.module
        for name, value, kwargs, metric in wire:
            mine = own.get(name)
            if metric is None:
                pl.LightningModule.log(module, name, torch.tensor(value, dtype=torch.float32, device=device), **kwargs)
            elif mine is not None:
                pl.LightningModule.log(module, name, mine.value, metric_attribute=metric[0], **kwargs)
            else:
                mirror = self._mirrors.get(name)
                if mirror is None:
                    mirror = self._mirrors[name] = _MirrorMetric().to(device)
                mirror.update(torch.tensor(value, device=device))
                set_metric_step_value(mirror, torch.tensor(metric[1], device=device))
                pl.LightningModule.log(module, name, mirror, metric_attribute=metric[0], **kwargs)
