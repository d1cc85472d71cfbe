"""The rules without memory: ``uncompressed`` (every tensor RAW) and ``direct`` (every compressible tensor by the
codec, ``C(x)``; also AQ-SGD's backward direction).

They keep no buffer, so both ends agree on every message's form without looking at any state: each class is only
what it sends and how it reads it back. They share the base's memory objects all the same (empty), so every rule
answers ``buffers``, ``store`` and ``state()`` alike.
"""

from __future__ import annotations

from torch import Tensor

from lightning_clapping.codecs.rules.base import MessageRule, register_rule
from lightning_clapping.codecs.rules.context import StepContext
from lightning_clapping.comm.wire import CODEC, FLAG_REQUIRES_GRAD, RAW, Part, raw_bytes

__all__ = ["DirectRule", "UncompressedRule"]


@register_rule("uncompressed")
class UncompressedRule(MessageRule):
    """Every tensor as its own bytes (RAW), both directions."""

    kind = "raw"
    forms = (RAW,)

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        return ("raw",)

    def encode(self, slot: int, tensors: list[Tensor], ctx: StepContext) -> list[Part]:
        return [Part(RAW, t.dtype, tuple(t.shape), raw_bytes(t.detach()), FLAG_REQUIRES_GRAD if t.requires_grad else 0)
                for t in tensors]


@register_rule("direct")
class DirectRule(MessageRule):
    """``C(x)``: each compressible tensor compressed by the codec, no error feedback (the other tensors RAW)."""

    kind = "direct"
    forms = (CODEC,)

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        return ("direct",)

    def _send(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext, seed: int) -> Part:
        self.stats.compressed += 1
        return Part(CODEC, t.dtype, tuple(t.shape), self.codec.encode(t, seed=seed), flags)

    def _receive(self, slot: int, k: int, p: Part, ctx: StepContext, seed: int) -> Tensor:
        return self._decode_codec(p, ctx, seed)
