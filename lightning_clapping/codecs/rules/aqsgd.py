"""AQ-SGD's rule: forward messages compressed against one row per training sample (``C(x - m(sample))``, FULL at a
sample's first visit), backward messages as ``direct``.

Its memory is keyed by sample id, not by micro-batch slot (:class:`~.memory.SampleRows`), so its form depends on
which samples both ends have seen; "visited" is defined here once, from what both ends know when a step starts, so
that the receiver's prediction and the sender's decision cannot differ.
"""

from __future__ import annotations

from torch import Tensor

from lightning_clapping.codecs.rules.base import MessageRule, register_rule
from lightning_clapping.codecs.rules.context import StepContext
from lightning_clapping.codecs.rules.simple import DirectRule
from lightning_clapping.comm.wire import CODEC, FULL, RAW, Part, from_raw_bytes, raw_bytes

__all__ = ["AQSGDRule"]


@register_rule("aqsgd")
class AQSGDRule(MessageRule):
    """AQ-SGD, forward direction (the backward one is :class:`~.simple.DirectRule`): see
    :mod:`lightning_clapping.codecs.feedback` for the first visits, repeats and eviction."""

    kind = "per-sample"
    forms = (FULL, CODEC)

    @classmethod
    def for_direction(cls, direction: str) -> type[MessageRule]:
        return DirectRule if direction == "bwd" else cls

    @staticmethod
    def _visited(slot: int, ctx: StepContext, rows: dict[int, Tensor]) -> bool:
        """Every sample of ``slot`` has one of ``rows``, or an earlier slot of this step gives it one (see the
        feedback module). The sender asks after the earlier slots were sent, the receiver when the step starts:
        same answer."""
        ids = ctx.sample_ids[slot] if ctx.sample_ids is not None else None
        if ids is None:
            return False
        earlier = {int(i) for other in ctx.sample_ids[:slot] if other is not None for i in other.tolist()}
        return all(int(i) in rows or int(i) in earlier for i in ids.tolist())

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        return ("per-sample", self._visited(slot, ctx, self.store[min(self.store)] if self.store else {}))

    def _send(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext, seed: int) -> Part:
        ids = _ids(ctx, slot, t)
        rows = self.samples.rows(k)
        if not self._visited(slot, ctx, rows) or any(rows[int(i)].shape != t.shape[1:] for i in ids.tolist()):
            self.samples.put(rows, ids, t, ctx)
            self.stats.full += 1
            return Part(FULL, t.dtype, tuple(t.shape), raw_bytes(t), flags)
        ref = self.samples.gather(rows, ids, t)
        diff = t - ref
        payload = self.codec.encode(diff, seed=seed)
        self.samples.put(rows, ids, ref + self.codec.decode(payload, t.shape, t.dtype, seed=seed), ctx)
        self._count_compressed(diff, t)
        return Part(CODEC, t.dtype, tuple(t.shape), payload, flags)

    def _receive(self, slot: int, k: int, p: Part, ctx: StepContext, seed: int) -> Tensor:
        if p.codec == FULL:
            value = from_raw_bytes(p.payload, p.dtype, p.shape).clone()
            self.samples.put(self.samples.rows(k), _ids(ctx, slot, value), value, ctx)
            return value
        decoded = self._decode_codec(p, ctx, seed)
        rows = self.store[k]
        ids = _ids(ctx, slot, decoded)
        value = self.samples.gather(rows, ids, decoded) + decoded
        self.samples.put(rows, ids, value, ctx)
        return value

    def _check_more(self, slot: int, p: Part, ctx: StepContext) -> None:
        """One row per sample id: a FULL or CODEC part's first dimension is the micro-batch's number of ids."""
        ids = ctx.sample_ids[slot] if ctx.sample_ids is not None else None
        if ids is not None and p.codec != RAW and (not p.shape or p.shape[0] != len(ids)):
            raise ValueError(f"shape {p.shape} for a micro-batch of {len(ids)} sample ids")


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
