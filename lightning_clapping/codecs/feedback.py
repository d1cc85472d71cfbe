"""Error-feedback rules: what crosses a boundary in compressed form, and the buffers both ends keep in step.

One :class:`MessageRule` serves one boundary and direction on one side (the sender's ``encode`` and the receiver's
``decode`` are the same class with the same settings). Each tensor of a message is sent in one of four wire forms,
named by the part's codec id (the ids and the byte layout are :mod:`lightning_clapping.comm.wire`'s):

``RAW``    the tensor's own bytes (a bool tensor's one bit per value), no state (uncompressed runs; masks and other
           tensors that carry no gradient)
``FULL``   the tensor's own bytes, and both ends reset their buffer to it (a fresh batch under Clapping-FU, the first
           message of a slot, the first visit of a sample under AQ-SGD)
``CODEC``  a codec payload: of the difference to the buffer (feedback variants: both ends add the decoded
           difference to their buffer and use the buffer) or of the value itself (``direct``; and clapping-fu's
           fresh steps under a ``fresh_codec``, where both ends reset their buffer to the decoded value)
``SKIP``   nothing: both ends keep the buffer (lazy messages)

Both ends apply the *decoded* payload, so their buffers stay bit-identical. The variants (``variant=`` of the
strategy) are:

================  ==================================================  ================================================
variant           forward (activations)                                backward (gradients)
================  ==================================================  ================================================
uncompressed      RAW                                                  RAW
direct            C_f(a)                                               C_b(g)
ef21              C_f(a - A), one buffer per micro-batch slot          C_b(g - G)
clapping-fc       as ef21 (made to work by lazy sampling)              as ef21
clapping-fu       fresh batch: FULL; reused batch: as clapping-fc      fresh: FULL; reused: as clapping-fc
aqsgd             first visit of every sample: FULL; later            C_b(g)
                  C_f(a - m(sample)), one buffer per training sample
================  ==================================================  ================================================

AQ-SGD sends a micro-batch FULL when one of its samples is visited for the first time, else compressed. A sample
counts as visited when it has a buffer row or appears in an earlier micro-batch of the same step (sampling with
replacement repeats ids): the receiver decides every slot's form when the step starts, before the earlier slots'
messages have stored their rows, and this rule gives it the sender's answer. A repeat is compressed against the row
its earlier occurrence left; a sample repeated within one micro-batch keeps the row of its last occurrence.

AQ-SGD's rows live off the accelerator by default (``store_device="cpu"``: a row per training sample outgrows a
GPU's memory long before the host's), and there are at most ``store_max_samples`` of them per tensor of the
message (default :data:`STORE_MAX_SAMPLES`; ``None``: no bound). When a micro-batch's rows take the store past the
bound, the least recently stored rows go first, except those of samples in any micro-batch of the current step
(both ends know them, and a row the receiver counted on when the step began must still be there when its slot's
message is encoded); an evicted sample's next visit is a first visit again, sent FULL. Both ends store and evict
alike, so their stores stay identical. A step with more distinct samples than the bound cannot keep them all and
raises, saying so. The order of the rows is part of :meth:`MessageRule.state`, so a resumed run evicts as an
uninterrupted one.

``ef21`` and ``clapping-fc`` share one rule; the baseline is the rule run without lazy sampling (every batch
fresh).

A separate codec for fresh steps (``fresh_codec``, off by default) applies to the feedback variants (ef21,
clapping-fc, clapping-fu): on a fresh step clapping-fu sends ``fresh_codec(a)`` instead of ``a`` in full precision
(still a reset: both ends set the buffer to the decoded value), and ef21 / clapping-fc compress the difference with
``fresh_codec`` instead of ``codec``; reuse steps keep ``codec``. Such a message is a ``CODEC`` part: the receiver
knows which codec and which rule apply from the fresh flag, which both ends share, and :meth:`MessageRule.mode`
names it ``"fresh"`` so that both ends predict its size. direct and aqsgd have no fresh-step form and ignore it.

The first message of each slot (and any change of shape, e.g. a smaller last batch) is sent FULL when
``warm_start`` is on, since an empty buffer makes the first difference as large as the activation (under
clapping-fu with a fresh codec, step 0 is a fresh step like any other: its reset is sent by the fresh codec).

Lazy messages (off by default) skip a reuse-step message while the last difference sent on that slot was small
relative to the buffer (``lazy_threshold``), at most ``max_skips`` times in a row. The trigger uses only what both
ends already know (the last decoded difference and the buffer), so the receiver knows in advance that nothing will
come and the wire stays predictable; the skipped change is not lost, it is part of the next difference.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_clapping.codecs import Codec, NonFiniteError, get_codec
from lightning_clapping.comm.wire import CODEC, FLAG_REQUIRES_GRAD, FULL, RAW, SKIP, Part, from_raw_bytes, raw_bytes

_BUFFER_NAME = re.compile(r"slot(\d+)\.t(\d+)\.rows(-?\d+)(?:\.(last_rel|skips))?")  # see MessageRule.state
_ORDER_NAME = re.compile(r"t(\d+)\.order")  # AQ-SGD: the store's rows, least recently stored first
VARIANTS = ("uncompressed", "direct", "ef21", "aqsgd", "clapping-fc", "clapping-fu")
#: AQ-SGD's default bound on the rows kept per message tensor (see the module docstring)
STORE_MAX_SAMPLES = 1 << 16


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


class MessageRule:
    """Encoder (sender side) and decoder (receiver side) for one boundary and direction."""

    def __init__(
        self,
        variant: str,
        codec: str | Codec,
        boundary: int,
        direction: str,
        *,
        warm_start: bool = True,
        store_dtype: torch.dtype | None = torch.float16,
        lazy_threshold: float | None = None,
        max_skips: int = 2,
        fresh_codec: str | Codec | None = None,
        store_device: torch.device | str | None = "cpu",
        store_max_samples: int | None = STORE_MAX_SAMPLES,
    ) -> None:
        """``store_device``: where AQ-SGD keeps its per-sample rows (``None``: on the device of the messages);
        ``store_max_samples``: at most this many rows per message tensor, evicted as the module docstring says."""
        if store_max_samples is not None and (isinstance(store_max_samples, bool) or
                                              not isinstance(store_max_samples, int) or store_max_samples < 1):
            raise ValueError(f"store_max_samples must be a positive int or None, got {store_max_samples!r}")
        self.store_device = None if store_device is None else torch.device(store_device)
        self.store_max_samples = store_max_samples
        self.variant = check_variant(variant)
        self.codec = get_codec(codec)
        #: codec of fresh-step messages for the feedback variants (module docstring); None: as before
        self.fresh_codec = None if fresh_codec is None else get_codec(fresh_codec)
        self.boundary = boundary
        self.direction = direction
        self.warm_start = warm_start
        self.store_dtype = store_dtype
        self.lazy_threshold = lazy_threshold
        self.max_skips = max_skips
        # which rule applies to this direction
        if variant == "uncompressed":
            self.kind = "raw"
        elif variant == "direct" or (variant == "aqsgd" and direction == "bwd"):
            self.kind = "direct"
        elif variant == "aqsgd":
            self.kind = "per-sample"
        else:
            self.kind = "feedback"
        self.reset_on_fresh = variant == "clapping-fu"
        self.buffers: dict[tuple[int, int, int], Tensor] = {}
        #: AQ-SGD: tensor index -> sample id -> row, least recently stored first (module docstring)
        self.store: dict[int, OrderedDict[int, Tensor]] = {}
        self._warned_eviction = False
        self._last_rel: dict[tuple[int, int, int], float | None] = {}
        self._skips: dict[tuple[int, int, int], int] = {}
        self.stats = RuleStats()

    # ------------------------------------------------------------------ shared decisions
    def compressible(self, t: Tensor, flags: int) -> bool:
        if not (t.dtype.is_floating_point and t.numel()):
            return False
        return self.direction == "bwd" or bool(flags & FLAG_REQUIRES_GRAD)

    @staticmethod
    def key(slot: int, k: int, ctx: StepContext) -> tuple[int, int, int]:
        """Buffers are kept per micro-batch slot, tensor and micro-batch size: a smaller last batch gets buffers
        of its own and leaves the full-size ones intact."""
        return (slot, k, ctx.sizes[slot] if ctx.sizes is not None else -1)

    def seed(self, ctx: StepContext, slot: int, k: int) -> int:
        mix = (ctx.step * 1_000_003 + self.boundary * 10_007 + slot * 101 + k * 7 + (self.direction == "bwd"))
        return (mix * 2_654_435_761) % (2**31 - 1)

    @staticmethod
    def _visited(slot: int, ctx: StepContext, rows: dict[int, Tensor]) -> bool:
        """AQ-SGD: every sample of ``slot`` has one of ``rows``, or an earlier slot of this step gives it one (module
        docstring). The sender asks after the earlier slots were sent, the receiver when the step starts: same answer."""
        ids = ctx.sample_ids[slot] if ctx.sample_ids is not None else None
        if ids is None:
            return False
        earlier = {int(i) for other in ctx.sample_ids[:slot] if other is not None for i in other.tolist()}
        return all(int(i) in rows or int(i) in earlier for i in ids.tolist())

    def _should_skip(self, key: tuple[int, int, int], ctx: StepContext) -> bool:
        if self.lazy_threshold is None or ctx.fresh or key not in self.buffers:
            return False
        rel = self._last_rel.get(key)
        return rel is not None and rel < self.lazy_threshold and self._skips.get(key, 0) < self.max_skips

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        """The wire form the next message of ``slot`` will take, computed from state both ends share.

        It may depend only on state that no other slot's message changes: the receiver computes it for every slot
        when the step starts, the sender just before encoding. Forms: ``("raw",)``, ``("direct",)``,
        ``("per-sample", visited)``, ``("full",)``, ``("fresh",)`` (clapping-fu's reset by the fresh codec), or one
        of ``"codec"``, ``"fresh"`` (the fresh codec) and ``"skip"`` per buffer of the slot.
        """
        if self.kind in ("raw", "direct"):
            return (self.kind,)
        if self.kind == "per-sample":
            return ("per-sample", self._visited(slot, ctx, self.store[min(self.store)] if self.store else {}))
        fresh = self._fresh_codec(ctx) is not None
        if self.reset_on_fresh and ctx.fresh:
            return ("fresh",) if fresh else ("full",)
        rows = self.key(slot, 0, ctx)[2]
        keys = sorted(k for k in self.buffers if k[0] == slot and k[2] == rows)
        if not keys:
            return ("full",)
        return tuple("skip" if self._should_skip(k, ctx) else "fresh" if fresh else "codec" for k in keys)

    def _fresh_codec(self, ctx: StepContext) -> Codec | None:
        """The codec of this step's fresh-step messages, or None when the step is not fresh or there is none."""
        return self.fresh_codec if ctx.fresh and self.kind == "feedback" else None

    def _codec(self, ctx: StepContext) -> Codec:
        """The codec of this step's compressed messages."""
        return self._fresh_codec(ctx) or self.codec

    # ------------------------------------------------------------------ sender
    def encode(self, slot: int, tensors: list[Tensor], ctx: StepContext) -> list[Part]:
        parts = []
        for k, t in enumerate(tensors):
            flags = FLAG_REQUIRES_GRAD if t.requires_grad else 0
            t = t.detach()
            if self.kind == "raw" or not self.compressible(t, flags):
                parts.append(Part(RAW, t.dtype, tuple(t.shape), raw_bytes(t), flags))
                continue
            try:
                parts.append(self._encode_one(slot, k, t, flags, ctx))
            except NonFiniteError as err:
                raise NonFiniteError(
                    f"boundary {self.boundary} ({self.direction}), micro-batch {slot}, tensor {k}: {err}"
                ) from None
        return parts

    def _encode_one(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext) -> Part:
        shape, seed = tuple(t.shape), self.seed(ctx, slot, k)
        self.stats.messages += 1
        if self.kind == "direct":
            self.stats.compressed += 1
            return Part(CODEC, t.dtype, shape, self.codec.encode(t, seed=seed), flags)
        if self.kind == "per-sample":
            return self._encode_per_sample(slot, k, t, flags, ctx, seed)
        key = self.key(slot, k, ctx)
        ref = self.buffers.get(key)
        fresh_reset = self.reset_on_fresh and ctx.fresh
        codec = self._codec(ctx)
        if fresh_reset and self.fresh_codec is not None:  # clapping-fu's reset, sent by fresh_codec
            payload = codec.encode(t, seed=seed)
            self._set(key, codec.decode(payload, t.shape, t.dtype, seed=seed))
            self._count_compressed(t, t)
            return Part(CODEC, t.dtype, shape, payload, flags)
        if ref is None or ref.shape != t.shape or ref.dtype != t.dtype or fresh_reset:
            if self.warm_start or fresh_reset:
                self._set(key, t.clone())
                self.stats.full += 1
                return Part(FULL, t.dtype, shape, raw_bytes(t), flags)
            self._set(key, torch.zeros_like(t))
            ref = self.buffers[key]
        if self._should_skip(key, ctx):
            self._skips[key] = self._skips.get(key, 0) + 1
            self.stats.skipped += 1
            return Part(SKIP, t.dtype, shape, t.new_empty(0, dtype=torch.uint8), flags)
        diff = t - ref
        payload = codec.encode(diff, seed=seed)
        self._count_compressed(diff, t)
        self._apply(key, codec.decode_into(payload, diff, seed=seed))  # the difference is not needed any more
        return Part(CODEC, t.dtype, shape, payload, flags)

    def _count_compressed(self, sent: Tensor, value: Tensor) -> None:
        """Stats of a compressed message: ``sent`` is what the codec compressed (the difference, or the value itself
        for clapping-fu's reset by the fresh codec), ``value`` what it stands for."""
        self.stats.compressed += 1
        self.stats.diff_sq += _sq_norm(sent)
        self.stats.value_sq += _sq_norm(value)

    def _encode_per_sample(self, slot, k, t, flags, ctx, seed) -> Part:
        ids = _ids(ctx, slot, t)
        rows = self.store.setdefault(k, OrderedDict())
        if not self._visited(slot, ctx, rows) or any(rows[int(i)].shape != t.shape[1:] for i in ids.tolist()):
            self._store_rows(rows, ids, t, ctx)
            self.stats.full += 1
            return Part(FULL, t.dtype, tuple(t.shape), raw_bytes(t), flags)
        ref = _gather_rows(rows, ids, t)
        diff = t - ref
        payload = self.codec.encode(diff, seed=seed)
        self._store_rows(rows, ids, ref + self.codec.decode(payload, t.shape, t.dtype, seed=seed), ctx)
        self._count_compressed(diff, t)
        return Part(CODEC, t.dtype, tuple(t.shape), payload, flags)

    # ------------------------------------------------------------------ receiver
    def decode(self, slot: int, parts: list[Part], ctx: StepContext) -> list[Tensor]:
        out = []
        for k, p in enumerate(parts):
            seed = self.seed(ctx, slot, k)
            key = self.key(slot, k, ctx)
            if p.codec == RAW:
                out.append(from_raw_bytes(p.payload, p.dtype, p.shape))
            elif p.codec == FULL:
                value = from_raw_bytes(p.payload, p.dtype, p.shape).clone()
                if self.kind == "per-sample":
                    self._store_rows(self.store.setdefault(k, OrderedDict()), _ids(ctx, slot, value), value, ctx)
                else:
                    self._set(key, value.clone())
                out.append(value)
            elif p.codec == CODEC:
                decoded = self._codec(ctx).decode(p.payload, torch.Size(p.shape), p.dtype, seed=seed)
                if self.kind == "direct":
                    out.append(decoded)
                elif self.kind == "per-sample":
                    rows = self.store[k]
                    ids = _ids(ctx, slot, decoded)
                    value = _gather_rows(rows, ids, decoded) + decoded
                    self._store_rows(rows, ids, value, ctx)
                    out.append(value)
                elif self.reset_on_fresh and ctx.fresh:  # clapping-fu's reset, sent by fresh_codec
                    self._set(key, decoded)
                    out.append(decoded.clone())
                else:
                    ref = self.buffers.get(key)
                    if ref is None or ref.shape != decoded.shape or ref.dtype != decoded.dtype:
                        self._set(key, torch.zeros_like(decoded))  # the sender started from zeros too
                    self._apply(key, decoded)
                    out.append(self.buffers[key].clone())
            elif p.codec == SKIP:
                self._skips[key] = self._skips.get(key, 0) + 1
                out.append(self.buffers[key].clone())
            else:
                raise ValueError(f"unknown wire form {p.codec} on boundary {self.boundary} ({self.direction})")
        return out

    # ------------------------------------------------------------------ buffers (identical on both ends)
    def _set(self, key: tuple[int, int, int], value: Tensor) -> None:
        self.buffers[key] = value
        self._last_rel[key] = None
        self._skips[key] = 0

    def _apply(self, key: tuple[int, int, int], decoded: Tensor) -> None:
        buf = self.buffers[key]
        buf.add_(decoded)
        if self.lazy_threshold is not None:
            self._last_rel[key] = float(decoded.float().norm()) / max(float(buf.float().norm()), 1e-30)
            self._skips[key] = 0

    def _store_rows(self, rows: OrderedDict[int, Tensor], ids: Tensor, values: Tensor, ctx: StepContext) -> None:
        """Keep ``values`` as the rows of ``ids`` (on the store's device, in its dtype), newest last; then evict."""
        host = values.detach().to(device=self.store_device or values.device, dtype=self.store_dtype or values.dtype)
        for i, row in zip(ids.tolist(), host):
            rows[int(i)] = row.clone()  # its own storage: an evicted row frees its memory
            rows.move_to_end(int(i))
        limit = self.store_max_samples
        if limit is None or len(rows) <= limit:
            return
        step = {int(i) for other in ctx.sample_ids or () if other is not None for i in other.tolist()}
        excess = len(rows) - limit
        victims = [sid for sid in rows if sid not in step][:excess]
        if len(victims) < excess:
            raise ValueError(
                f"variant='aqsgd' on boundary {self.boundary}: step {ctx.step} holds {len(step)} distinct samples, "
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

    def state_bytes(self) -> int:
        total = sum(b.numel() * b.element_size() for b in self.buffers.values())
        for rows in self.store.values():
            total += sum(r.numel() * r.element_size() for r in rows.values())
        return total

    def state(self) -> dict[str, Tensor]:
        """What both ends keep, as a flat ``str -> Tensor`` dict (for checkpoints and for checks that both ends agree).

        ``slot{s}.t{k}.rows{r}``: a buffer; ``t{k}.sample{i}``: an AQ-SGD row. With lazy messages on, each buffer's
        trigger too: ``<buffer>.last_rel`` (float64, NaN before the first compressed difference) and
        ``<buffer>.skips`` (int64), so a resumed run skips exactly as an uninterrupted one.
        """
        out = {}
        for (s, k, r), b in self.buffers.items():
            out[f"slot{s}.t{k}.rows{r}"] = b
            if self.lazy_threshold is not None:
                rel = self._last_rel.get((s, k, r))
                out[f"slot{s}.t{k}.rows{r}.last_rel"] = torch.tensor(math.nan if rel is None else rel,
                                                                     dtype=torch.float64, device=b.device)
                out[f"slot{s}.t{k}.rows{r}.skips"] = torch.tensor(self._skips.get((s, k, r), 0), device=b.device)
        for k, rows in self.store.items():
            out.update({f"t{k}.sample{i}": r for i, r in rows.items()})
            out[f"t{k}.order"] = torch.tensor(list(rows), dtype=torch.int64, device=self.store_device)
        return out

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Restore what :meth:`state` saved (exact resume of a compressed run, lazy-message decisions included)."""
        self.buffers.clear()
        self.store.clear()
        triggers, orders = [], {}
        for name, value in state.items():
            match = _BUFFER_NAME.fullmatch(name)
            order = _ORDER_NAME.fullmatch(name)
            if order is not None:
                orders[int(order[1])] = value.tolist()
            elif match is None:
                k, sample = name[1:].split(".sample")
                rows = self.store.setdefault(int(k), OrderedDict())
                rows[int(sample)] = value.to(self.store_device or device).clone()
            elif match[4] is None:
                self._set((int(match[1]), int(match[2]), int(match[3])), value.to(device).clone())
            else:
                triggers.append(((int(match[1]), int(match[2]), int(match[3])), match[4], value.item()))
        for k, order in orders.items():  # the rows in the order they were stored (checkpoints may sort names)
            rows = self.store.get(k, OrderedDict())
            for sid in order:
                if sid in rows:
                    rows.move_to_end(sid)
        for key, what, value in triggers:  # after the buffers: _set resets them
            if what == "skips":
                self._skips[key] = int(value)
            else:
                self._last_rel[key] = None if math.isnan(value) else value

    def take_stats(self) -> RuleStats:
        stats, self.stats = self.stats, RuleStats()
        return stats


def _sq_norm(t: Tensor) -> float:
    """Squared L2 norm, accumulated in float32 or wider (one pass, no temporary for float32 tensors)."""
    wide = t.dtype if t.dtype == torch.float64 else torch.float32
    return float(torch.linalg.vector_norm(t, dtype=wide)) ** 2


def _gather_rows(rows: OrderedDict[int, Tensor], ids: Tensor, like: Tensor) -> Tensor:
    """The rows of ``ids`` as one tensor on ``like``'s device and dtype (one copy from the store)."""
    return torch.stack([rows[int(i)] for i in ids.tolist()]).to(device=like.device, dtype=like.dtype)


def _ids(ctx: StepContext, slot: int, t: Tensor) -> Tensor:
    if ctx.sample_ids is None or ctx.sample_ids[slot] is None:
        raise ValueError(
            "variant='aqsgd' keeps one buffer per training sample and needs sample ids: wrap the data in "
            "lightning_clapping.LazySamplingDataModule(dm, p=1.0), which reports them"
        )
    ids = ctx.sample_ids[slot]
    if len(ids) != t.shape[0]:
        raise ValueError(f"micro-batch {slot} has {t.shape[0]} rows but {len(ids)} sample ids")
    return ids
