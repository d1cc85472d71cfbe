"""The state both ends of a boundary keep, apart from the rules that decide what to send: the memory of the rules.

:class:`SlotBuffers` holds the feedback variants' buffers (one per micro-batch slot, tensor and micro-batch size)
with their lazy-message trigger; :class:`SampleRows` holds AQ-SGD's rows (one per training sample). They are split
from the rules as GRACE splits a compressor from its memory: a rule says which form a tensor takes and what both
ends do with a payload, the memory only stores, evicts and saves, identically on both ends, so that several rules
share one kind of memory and a checkpoint holds the memory alone (:meth:`MessageRule.state`'s names are made here).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import OrderedDict

import torch
from torch import Tensor

from lightning_clapping.codecs.rules.context import StepContext

__all__ = ["Key", "SampleRows", "SlotBuffers"]

#: (micro-batch slot, tensor index, micro-batch size or -1): see :meth:`MessageRule.key`
Key = tuple[int, int, int]
_BUFFER_NAME = re.compile(r"slot(\d+)\.t(\d+)\.rows(-?\d+)(?:\.(last_rel|skips))?")  # see SlotBuffers.state
_ORDER_NAME = re.compile(r"t(\d+)\.order")  # AQ-SGD: the store's rows, least recently stored first


class SlotBuffers:
    """The buffers of the feedback variants, keyed by :data:`Key`, and the lazy-message trigger of each.

    ``lazy_threshold`` (None: lazy messages off) and ``max_skips``: a reuse-step message is skipped while the last
    difference sent for its buffer was below ``lazy_threshold`` times the buffer's norm, at most ``max_skips`` times
    in a row (see :mod:`lightning_clapping.codecs.feedback`).
    """

    def __init__(self, lazy_threshold: float | None, max_skips: int) -> None:
        self.lazy_threshold = lazy_threshold
        self.max_skips = max_skips
        self.buffers: dict[Key, Tensor] = {}
        self._last_rel: dict[Key, float | None] = {}
        self._skips: dict[Key, int] = {}

    def set(self, key: Key, value: Tensor) -> None:
        """Reset the buffer of ``key`` to ``value`` (a FULL message, a reset, a first message)."""
        self.buffers[key] = value
        self._last_rel[key] = None
        self._skips[key] = 0

    def apply(self, key: Key, decoded: Tensor) -> None:
        """Add a decoded difference to the buffer of ``key`` (and remember its size for the lazy trigger)."""
        buf = self.buffers[key]
        buf.add_(decoded)
        if self.lazy_threshold is not None:
            self._last_rel[key] = float(decoded.float().norm()) / max(float(buf.float().norm()), 1e-30)
            self._skips[key] = 0

    def should_skip(self, key: Key, fresh: bool) -> bool:
        """Whether the next message of ``key`` is skipped: from state both ends share, never on a fresh step."""
        if self.lazy_threshold is None or fresh or key not in self.buffers:
            return False
        rel = self._last_rel.get(key)
        return rel is not None and rel < self.lazy_threshold and self._skips.get(key, 0) < self.max_skips

    def count_skip(self, key: Key) -> None:
        self._skips[key] = self._skips.get(key, 0) + 1

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @staticmethod
    def owns(name: str) -> bool:
        """Whether ``name`` (from :meth:`state`) is one of the buffers' entries."""
        return _BUFFER_NAME.fullmatch(name) is not None

    def state(self) -> dict[str, Tensor]:
        """``slot{s}.t{k}.rows{r}``: a buffer; with lazy messages on, its trigger too: ``<buffer>.last_rel``
        (float64, NaN before the first compressed difference) and ``<buffer>.skips`` (int64)."""
        out = {}
        for (s, k, r), b in self.buffers.items():
            out[f"slot{s}.t{k}.rows{r}"] = b
            if self.lazy_threshold is not None:
                rel = self._last_rel.get((s, k, r))
                out[f"slot{s}.t{k}.rows{r}.last_rel"] = torch.tensor(math.nan if rel is None else rel,
                                                                     dtype=torch.float64, device=b.device)
                out[f"slot{s}.t{k}.rows{r}.skips"] = torch.tensor(self._skips.get((s, k, r), 0), device=b.device)
        return out

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Restore what :meth:`state` saved (``state`` holds only names it :meth:`owns`)."""
        self.buffers.clear()
        triggers = []
        for name, value in state.items():
            match = _BUFFER_NAME.fullmatch(name)
            key = (int(match[1]), int(match[2]), int(match[3]))
            if match[4] is None:
                self.set(key, value.to(device).clone())
            else:
                triggers.append((key, match[4], value.item()))
        for key, what, value in triggers:  # after the buffers: set() resets them
            if what == "skips":
                self._skips[key] = int(value)
            else:
                self._last_rel[key] = None if math.isnan(value) else value


class SampleRows:
    """AQ-SGD's rows: per tensor index of the message, sample id -> row, least recently stored first.

    Rows live on ``device`` (None: the messages' device) in ``dtype`` (None: the messages' dtype), at most
    ``max_samples`` per tensor (None: no bound); eviction as :mod:`lightning_clapping.codecs.feedback` says.
    ``boundary`` and ``direction`` name the rule in errors and warnings.
    """

    def __init__(self, device: torch.device | None, dtype: torch.dtype | None, max_samples: int | None,
                 boundary: int, direction: str) -> None:
        self.device, self.dtype, self.max_samples = device, dtype, max_samples
        self.boundary, self.direction = boundary, direction
        self.store: dict[int, OrderedDict[int, Tensor]] = {}
        self._warned_eviction = False

    def rows(self, k: int) -> OrderedDict[int, Tensor]:
        """The rows of tensor ``k`` (created empty on first use)."""
        return self.store.setdefault(k, OrderedDict())

    def gather(self, rows: OrderedDict[int, Tensor], ids: Tensor, like: Tensor) -> Tensor:
        """The rows of ``ids`` as one tensor on ``like``'s device and dtype (one copy from the store)."""
        return torch.stack([rows[int(i)] for i in ids.tolist()]).to(device=like.device, dtype=like.dtype)

    def put(self, rows: OrderedDict[int, Tensor], ids: Tensor, values: Tensor, ctx: StepContext) -> None:
        """Keep ``values`` as the rows of ``ids`` (on the store's device, in its dtype), newest last; then evict,
        sparing the samples of the step ``ctx`` (of any of its micro-batches)."""
        host = values.detach().to(device=self.device or values.device, dtype=self.dtype or values.dtype)
        for i, row in zip(ids.tolist(), host):
            rows[int(i)] = row.clone()  # its own storage: an evicted row frees its memory
            rows.move_to_end(int(i))
        limit = self.max_samples
        if limit is None or len(rows) <= limit:
            return
        in_step = {int(i) for other in ctx.sample_ids or () if other is not None for i in other.tolist()}
        excess = len(rows) - limit
        victims = [sid for sid in rows if sid not in in_step][:excess]
        if len(victims) < excess:
            raise ValueError(
                f"variant='aqsgd' on boundary {self.boundary}: step {ctx.step} holds {len(in_step)} distinct samples, "
                f"more than the store keeps (store_max_samples={limit}); raise the bound above the samples of one "
                "step (batch size, or more with sampling with replacement) or use fewer samples per step")
        if not self._warned_eviction:
            self._warned_eviction = True
            warnings.warn(
                f"variant='aqsgd' on boundary {self.boundary} ({self.direction}): the per-sample store is full "
                f"({limit} samples); the least recently seen samples' rows are dropped and those samples are sent "
                "in full precision at their next visit", stacklevel=2)
        for sid in victims:
            del rows[sid]

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for rows in self.store.values() for r in rows.values())

    def state(self) -> dict[str, Tensor]:
        """``t{k}.sample{i}``: a row; ``t{k}.order``: the sample ids of tensor ``k``'s rows, least recent first."""
        out = {}
        for k, rows in self.store.items():
            out.update({f"t{k}.sample{i}": r for i, r in rows.items()})
            out[f"t{k}.order"] = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        return out

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Restore what :meth:`state` saved, rows in their saved order (checkpoints may sort the names)."""
        self.store.clear()
        orders = {}
        for name, value in state.items():
            order = _ORDER_NAME.fullmatch(name)
            if order is not None:
                orders[int(order[1])] = value.tolist()
            else:
                k, sample = name[1:].split(".sample")
                self.rows(int(k))[int(sample)] = value.to(self.device or device).clone()
        for k, order in orders.items():
            rows = self.store.get(k, OrderedDict())
            for sid in order:
                if sid in rows:
                    rows.move_to_end(sid)
