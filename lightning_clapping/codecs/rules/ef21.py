"""The error-feedback rules: ``ef21`` and ``clapping-fc`` (``C(x - B)``, one buffer ``B`` per micro-batch slot) and
``clapping-fu`` (the same on reused batches, a reset of the buffers on fresh ones).

The three share their buffers (:class:`~.memory.SlotBuffers`) and the lazy-message trigger, and differ only on
fresh steps, so Clapping-FU overrides exactly that and Clapping-FC is EF21's rule under another name (what makes
it Clapping-FC is lazy sampling, outside the rule). The sender and the receiver run the same code on the same
decoded payloads, which keeps their buffers bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_clapping.codecs.base import Codec
from lightning_clapping.codecs.rules.base import MessageRule, register_rule
from lightning_clapping.codecs.rules.context import StepContext
from lightning_clapping.comm.wire import CODEC, FULL, SKIP, Part, from_raw_bytes, raw_bytes

__all__ = ["ClappingFCRule", "ClappingFURule", "EF21Rule"]


@register_rule("ef21")
class EF21Rule(MessageRule):
    """``C(x - B)``, both ends adding the decoded difference to ``B``; FULL for a slot's first message (with
    ``warm_start``) or a new shape; SKIP while lazy messages hold; on fresh steps the difference goes by
    ``fresh_codec`` when there is one."""

    kind = "feedback"
    forms = (FULL, CODEC, SKIP)

    def codec_for(self, ctx: StepContext) -> Codec:
        return self.fresh_codec if ctx.fresh and self.fresh_codec is not None else self.codec

    def _fresh_form(self, ctx: StepContext) -> str:
        """How a compressed message of this step is named in :meth:`mode`: by the fresh codec, or not."""
        return "fresh" if ctx.fresh and self.fresh_codec is not None else "codec"

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        rows = self.key(slot, 0, ctx)[2]
        keys = sorted(k for k in self.buffers if k[0] == slot and k[2] == rows)
        if not keys:
            return ("full",)
        form = self._fresh_form(ctx)
        return tuple("skip" if self.slots.should_skip(k, ctx.fresh) else form for k in keys)

    def _send(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext, seed: int) -> Part:
        shape, key = tuple(t.shape), self.key(slot, k, ctx)
        ref = self.buffers.get(key)
        if ref is None or ref.shape != t.shape or ref.dtype != t.dtype:
            if self.warm_start:
                self.slots.set(key, t.clone())
                self.stats.full += 1
                return Part(FULL, t.dtype, shape, raw_bytes(t), flags)
            self.slots.set(key, torch.zeros_like(t))
            ref = self.buffers[key]
        if self.slots.should_skip(key, ctx.fresh):
            self.slots.count_skip(key)
            self.stats.skipped += 1
            return Part(SKIP, t.dtype, shape, t.new_empty(0, dtype=torch.uint8), flags)
        codec = self.codec_for(ctx)
        diff = t - ref
        payload = codec.encode(diff, seed=seed)
        self._count_compressed(diff, t)
        self.slots.apply(key, codec.decode_into(payload, diff, seed=seed))  # the difference is not needed any more
        return Part(CODEC, t.dtype, shape, payload, flags)

    def _receive(self, slot: int, k: int, p: Part, ctx: StepContext, seed: int) -> Tensor:
        key = self.key(slot, k, ctx)
        if p.codec == FULL:
            value = from_raw_bytes(p.payload, p.dtype, p.shape).clone()
            self.slots.set(key, value.clone())
            return value
        if p.codec == SKIP:
            self.slots.count_skip(key)
            return self.buffers[key].clone()
        decoded = self._decode_codec(p, ctx, seed)
        ref = self.buffers.get(key)
        if ref is None or ref.shape != decoded.shape or ref.dtype != decoded.dtype:
            self.slots.set(key, torch.zeros_like(decoded))  # the sender started from zeros too
        self.slots.apply(key, decoded)
        return self.buffers[key].clone()


@register_rule("clapping-fc")
class ClappingFCRule(EF21Rule):
    """Clapping-FC: EF21's rule, run under lazy sampling (reused batches drift little, so the differences are small);
    the baseline is the same rule with every batch fresh."""


@register_rule("clapping-fu")
class ClappingFURule(EF21Rule):
    """Clapping-FU: on a fresh step both ends reset the buffer to the value (FULL, or ``fresh_codec(x)`` decoded when
    there is a fresh codec, sent as CODEC); on reused steps as :class:`ClappingFCRule`."""

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        if ctx.fresh:
            return ("fresh",) if self.fresh_codec is not None else ("full",)
        return super().mode(slot, ctx)

    def _send(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext, seed: int) -> Part:
        if not ctx.fresh:
            return super()._send(slot, k, t, flags, ctx, seed)
        shape, key = tuple(t.shape), self.key(slot, k, ctx)
        if self.fresh_codec is not None:  # the reset, sent by the fresh codec
            payload = self.fresh_codec.encode(t, seed=seed)
            self.slots.set(key, self.fresh_codec.decode(payload, t.shape, t.dtype, seed=seed))
            self._count_compressed(t, t)
            return Part(CODEC, t.dtype, shape, payload, flags)
        self.slots.set(key, t.clone())
        self.stats.full += 1
        return Part(FULL, t.dtype, shape, raw_bytes(t), flags)

    def _receive(self, slot: int, k: int, p: Part, ctx: StepContext, seed: int) -> Tensor:
        if p.codec == CODEC and ctx.fresh:  # the reset, sent by the fresh codec
            decoded = self._decode_codec(p, ctx, seed)
            self.slots.set(self.key(slot, k, ctx), decoded)
            return decoded.clone()
        return super()._receive(slot, k, p, ctx, seed)
