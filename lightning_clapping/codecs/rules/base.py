"""The base of the message rules (:class:`MessageRule`) and the factory that builds a variant's rule by its name.

One rule class per variant (:mod:`.simple`, :mod:`.ef21`, :mod:`.aqsgd`), over the memory of :mod:`.memory`: a
variant says which form a tensor takes (:meth:`MessageRule.mode`), how it is sent (``_send``) and received
(``_receive``), and which forms it can send (``forms``); the loops over a message's tensors, the check of a
received part, the seeds, the stats and the saved state are shared here. Adding a variant is a class and a
:func:`register_rule` call, where a variant string used to be tested in every method.
``MessageRule(variant, ...)`` stays the way to build one: it returns the registered class's instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_clapping.codecs.base import Codec, NonFiniteError
from lightning_clapping.codecs.registry import get_codec
from lightning_clapping.codecs.rules.context import RuleStats, StepContext, check_variant
from lightning_clapping.codecs.rules.memory import Key, SampleRows, SlotBuffers
from lightning_clapping.comm.wire import (
    CODEC, DECODE_ERRORS, FLAG_REQUIRES_GRAD, FORM_NAMES, FULL, RAW, SKIP, Part, check_codec_payload, from_raw_bytes,
    raw_bytes, raw_payload_nbytes,
)

__all__ = ["MessageRule", "STORE_MAX_SAMPLES", "register_rule", "rule_class"]

#: AQ-SGD's default bound on the rows kept per message tensor (see :mod:`lightning_clapping.codecs.feedback`)
STORE_MAX_SAMPLES = 1 << 16
#: variant name -> the class that serves it (see :func:`register_rule`)
_RULES: dict[str, type[MessageRule]] = {}


def register_rule(variant: str) -> Callable[[type[MessageRule]], type[MessageRule]]:
    """Class decorator: ``MessageRule(variant, ...)`` builds this class (or the one its ``for_direction`` names)."""

    def register(cls: type[MessageRule]) -> type[MessageRule]:
        _RULES[check_variant(variant)] = cls
        return cls

    return register


def rule_class(variant: str, direction: str) -> type[MessageRule] | None:
    """The class of ``variant``'s rule for ``direction`` ("fwd" or "bwd"); None for a name no class serves."""
    cls = _RULES.get(variant) if isinstance(variant, str) else None
    return None if cls is None else cls.for_direction(direction)


class MessageRule:
    """Encoder (sender side) and decoder (receiver side) for one boundary and direction.

    ``MessageRule(variant, codec, boundary, direction, ...)`` returns an instance of the variant's class (see
    :func:`rule_class`); the subclasses take the same arguments. ``store_device``: where AQ-SGD keeps its
    per-sample rows (``None``: on the device of the messages); ``store_max_samples``: at most this many rows per
    message tensor, evicted as :mod:`lightning_clapping.codecs.feedback` says.
    """

    #: how the executor and the tests tell rules apart: "raw", "direct", "per-sample" or "feedback"
    kind = ""
    #: the wire forms this rule sends a compressible tensor in (any other tensor is RAW)
    forms: tuple[int, ...] = (RAW,)

    def __new__(cls, *args: Any, **kwargs: Any) -> MessageRule:
        if cls is MessageRule:  # the factory: the variant's class (an unknown name fails in __init__, as it did)
            variant = args[0] if args else kwargs.get("variant")
            direction = args[3] if len(args) > 3 else kwargs.get("direction")
            cls = rule_class(variant, direction) or cls
        return super().__new__(cls)

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
        if store_max_samples is not None and (isinstance(store_max_samples, bool) or
                                              not isinstance(store_max_samples, int) or store_max_samples < 1):
            raise ValueError(f"store_max_samples must be a positive int or None, got {store_max_samples!r}")
        self.variant = check_variant(variant)
        if type(self) is not rule_class(variant, direction):
            raise TypeError(f"{type(self).__name__} does not serve variant={variant!r} ({direction}); build rules "
                            f"with MessageRule(variant, ...), and register a new variant's class (register_rule)")
        self.codec = get_codec(codec)
        #: codec of fresh-step messages for the feedback variants (see the feedback module); None: as before
        self.fresh_codec = None if fresh_codec is None else get_codec(fresh_codec)
        self.boundary = boundary
        self.direction = direction
        self.warm_start = warm_start
        self.slots = SlotBuffers(lazy_threshold, max_skips)
        self.samples = SampleRows(None if store_device is None else torch.device(store_device), store_dtype,
                                  store_max_samples, boundary, direction)
        self.stats = RuleStats()

    @classmethod
    def for_direction(cls, direction: str) -> type[MessageRule]:
        """The class that serves ``direction`` (a variant may treat its two directions differently)."""
        return cls

    # the settings, as the memory holds them
    buffers = property(lambda self: self.slots.buffers, doc="the feedback buffers, by :data:`Key`")
    store = property(lambda self: self.samples.store, doc="AQ-SGD: tensor index -> sample id -> row")
    lazy_threshold = property(lambda self: self.slots.lazy_threshold)
    max_skips = property(lambda self: self.slots.max_skips)
    store_device = property(lambda self: self.samples.device)
    store_dtype = property(lambda self: self.samples.dtype)
    store_max_samples = property(lambda self: self.samples.max_samples)

    # ------------------------------------------------------------------ shared decisions
    def compressible(self, t: Tensor, flags: int) -> bool:
        if not (t.dtype.is_floating_point and t.numel()):
            return False
        return self.direction == "bwd" or bool(flags & FLAG_REQUIRES_GRAD)

    @staticmethod
    def key(slot: int, k: int, ctx: StepContext) -> Key:
        """Buffers are kept per micro-batch slot, tensor and micro-batch size: a smaller last batch gets buffers
        of its own and leaves the full-size ones intact."""
        return (slot, k, ctx.sizes[slot] if ctx.sizes is not None else -1)

    def seed(self, ctx: StepContext, slot: int, k: int) -> int:
        mix = (ctx.step * 1_000_003 + self.boundary * 10_007 + slot * 101 + k * 7 + (self.direction == "bwd"))
        return (mix * 2_654_435_761) % (2**31 - 1)

    def mode(self, slot: int, ctx: StepContext) -> tuple:
        """The wire form the next message of ``slot`` will take, computed from state both ends share.

        It may depend only on state that no other slot's message changes: the receiver computes it for every slot
        when the step starts, the sender just before encoding. Forms: ``("raw",)``, ``("direct",)``,
        ``("per-sample", visited)``, ``("full",)``, ``("fresh",)`` (clapping-fu's reset by the fresh codec), or one
        of ``"codec"``, ``"fresh"`` (the fresh codec) and ``"skip"`` per buffer of the slot.
        """
        raise NotImplementedError

    def codec_for(self, ctx: StepContext) -> Codec:
        """The codec of this step's compressed messages."""
        return self.codec

    # ------------------------------------------------------------------ sender
    def encode(self, slot: int, tensors: list[Tensor], ctx: StepContext) -> list[Part]:
        parts = []
        for k, t in enumerate(tensors):
            flags = FLAG_REQUIRES_GRAD if t.requires_grad else 0
            t = t.detach()
            if not self.compressible(t, flags):
                parts.append(Part(RAW, t.dtype, tuple(t.shape), raw_bytes(t), flags))
                continue
            try:
                self.stats.messages += 1
                parts.append(self._send(slot, k, t, flags, ctx, self.seed(ctx, slot, k)))
            except NonFiniteError as err:
                raise NonFiniteError(
                    f"boundary {self.boundary} ({self.direction}), micro-batch {slot}, tensor {k}: {err}"
                ) from None
        return parts

    def _send(self, slot: int, k: int, t: Tensor, flags: int, ctx: StepContext, seed: int) -> Part:
        """The part of the compressible tensor ``t`` (tensor ``k`` of micro-batch ``slot``), memory updated."""
        raise NotImplementedError

    def _count_compressed(self, sent: Tensor, value: Tensor) -> None:
        """Stats of a compressed message: ``sent`` is what the codec compressed (the difference, or the value itself
        for clapping-fu's reset by the fresh codec), ``value`` what it stands for."""
        self.stats.compressed += 1
        self.stats.diff_sq += _sq_norm(sent)
        self.stats.value_sq += _sq_norm(value)

    # ------------------------------------------------------------------ receiver
    def check_part(self, slot: int, k: int, p: Part, ctx: StepContext) -> None:
        """Raise ValueError unless ``p`` (tensor ``k`` of micro-batch ``slot``) is one this rule's sender can have
        sent: its payload's length (the raw size for RAW and FULL, nothing for SKIP, the codec's for CODEC), the
        buffer a SKIP keeps, a form this variant uses for a tensor of that dtype and flags, and what the variant
        checks besides (:meth:`_check_more`). :func:`lightning_clapping.comm.wire.decode_message` calls it."""
        if p.codec in (RAW, FULL) and p.payload.numel() != raw_payload_nbytes(p.shape, p.dtype):
            raise ValueError(f"{p.payload.numel()} bytes for shape {p.shape} of {p.dtype} "
                             f"({raw_payload_nbytes(p.shape, p.dtype)})")
        if p.codec == SKIP:
            buf = self.buffers.get(self.key(slot, k, ctx))
            if p.payload.numel() or buf is None or tuple(buf.shape) != p.shape or buf.dtype != p.dtype:
                raise ValueError(
                    f"a skipped tensor has no payload and keeps a buffer of its shape and dtype (payload "
                    f"{p.payload.numel()} bytes, buffer {None if buf is None else (tuple(buf.shape), buf.dtype)}, "
                    f"sent {p.shape} {p.dtype})")
        if p.codec == CODEC:
            check_codec_payload(self.codec_for(ctx), p.payload, p.shape, p.dtype)
        try:
            compressible = self.compressible(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.flags)
        except DECODE_ERRORS as err:  # a shape whose bytes overflow
            raise ValueError(f"shape {p.shape} of {p.dtype} ({err})") from None
        forms = self.forms if compressible else (RAW,)
        if p.codec not in forms:
            raise ValueError(f"the {self.variant} rule sends this {p.dtype} tensor (flags {p.flags}) as "
                             f"{' or '.join(FORM_NAMES[f] for f in forms)}")
        self._check_more(slot, p, ctx)

    def _check_more(self, slot: int, p: Part, ctx: StepContext) -> None:
        """What a variant checks of a received part besides :meth:`check_part` (nothing by default)."""

    def decode(self, slot: int, parts: list[Part], ctx: StepContext) -> list[Tensor]:
        out = []
        for k, p in enumerate(parts):
            if p.codec == RAW:
                out.append(from_raw_bytes(p.payload, p.dtype, p.shape))
            elif p.codec in self.forms:
                out.append(self._receive(slot, k, p, ctx, self.seed(ctx, slot, k)))
            else:
                raise ValueError(f"unknown wire form {p.codec} on boundary {self.boundary} ({self.direction})")
        return out

    def _receive(self, slot: int, k: int, p: Part, ctx: StepContext, seed: int) -> Tensor:
        """The tensor the part ``p`` (one of :attr:`forms`) stands for, memory updated as the sender's was."""
        raise NotImplementedError

    def _decode_codec(self, p: Part, ctx: StepContext, seed: int) -> Tensor:
        """What the CODEC payload of ``p`` decodes to (a difference or a value, as the variant sends)."""
        return self.codec_for(ctx).decode(p.payload, torch.Size(p.shape), p.dtype, seed=seed)

    # ------------------------------------------------------------------ memory (identical on both ends)
    def state_bytes(self) -> int:
        return self.slots.nbytes() + self.samples.nbytes()

    def state(self) -> dict[str, Tensor]:
        """What both ends keep, as a flat ``str -> Tensor`` dict (for checkpoints and for checks that both ends agree).

        ``slot{s}.t{k}.rows{r}``: a buffer; ``t{k}.sample{i}``: an AQ-SGD row. With lazy messages on, each buffer's
        trigger too: ``<buffer>.last_rel`` (float64, NaN before the first compressed difference) and
        ``<buffer>.skips`` (int64), so a resumed run skips exactly as an uninterrupted one.
        """
        return {**self.slots.state(), **self.samples.state()}

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Restore what :meth:`state` saved (exact resume of a compressed run, lazy-message decisions included)."""
        self.slots.load_state({n: v for n, v in state.items() if SlotBuffers.owns(n)}, device)
        self.samples.load_state({n: v for n, v in state.items() if not SlotBuffers.owns(n)}, device)

    def take_stats(self) -> RuleStats:
        stats, self.stats = self.stats, RuleStats()
        return stats


def _sq_norm(t: Tensor) -> float:
    """Squared L2 norm, accumulated in float32 or wider (one pass, no temporary for float32 tensors)."""
    wide = t.dtype if t.dtype == torch.float64 else torch.float32
    return float(torch.linalg.vector_norm(t, dtype=wide)) ** 2
