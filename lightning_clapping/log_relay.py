"""``self.log`` inside a pipeline: record on the last stage, combine micro-batches, replay on every rank.

The user's ``training_step`` runs once per micro-batch, and only the last stage computes the loss and the metrics.
Logged values are therefore recorded instead of passed to Lightning, combined into one value per step (weighted by
each call's batch size, as Lightning itself weights values across steps), sent to every rank, and logged there
through the public ``LightningModule.log``. Every rank then has the same ``callback_metrics``, so
``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and ``sync_dist=True`` behave as in single-process training.

torchmetrics ``Metric`` objects keep their state on the last stage and are logged there as objects (Lightning
computes and resets them); other ranks log the metric's latest batch value under the same name.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

try:
    from torchmetrics import Metric
except ImportError:  # pragma: no cover
    Metric = ()  # type: ignore[assignment,misc]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_NOT_SENT = ("sync_dist_group", "metric_attribute")


@dataclass
class Record:
    name: str
    value: Any  # float, or a Metric object (last stage only)
    kwargs: dict[str, Any]
    weight: float


class LogRelay:
    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.records: list[Record] = []

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
                value = float(value.detach().float().mean()) if value.numel() == 1 else _bad_value(name, value)
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
            first = recs[-1] if isinstance(recs[-1].value, Metric) else recs[0]
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


def to_wire(records: list[Record]) -> list[tuple[str, float, dict[str, Any]]]:
    """A picklable copy: Metric objects become their latest value."""
    wire = []
    for r in records:
        value = r.value
        if isinstance(value, Metric):
            cache = getattr(value, "_forward_cache", None)
            value = float(cache) if isinstance(cache, Tensor) and cache.numel() == 1 else float("nan")
        wire.append((r.name, value, {k: v for k, v in r.kwargs.items() if k not in _NOT_SENT}))
    return wire


def replay(module: pl.LightningModule, wire: list[tuple[str, float, dict[str, Any]]], local: list[Record] | None,
           device: torch.device) -> None:
    """Log the combined values through Lightning on this rank (``local`` holds the last stage's own records)."""
    own = {r.name: r for r in local or []}
    for name, value, kwargs in wire:
        mine = own.get(name)
        if mine is not None and isinstance(mine.value, Metric):
            pl.LightningModule.log(module, name, mine.value, **{**kwargs, "metric_attribute":
                                                               mine.kwargs.get("metric_attribute")})
        else:
            pl.LightningModule.log(module, name, torch.tensor(value, dtype=torch.float32, device=device), **kwargs)


def _bad_value(name: str, value: Tensor) -> float:
    raise ValueError(f"self.log({name!r}, ...) needs a scalar, got a tensor of shape {tuple(value.shape)}")
