"""What autotune may choose from: each boundary's ladder of settings, and what its fresh steps send.

**Ladders.** Candidates are settings ordered from least to most lossy: ``"uncompressed"`` or a codec string of
:func:`lightning_clapping.codecs.get_codec`. The default ladders (:data:`DEFAULT_CANDIDATES`) are

====================  =========================================  ==================================================
direction             ladder                                      why
====================  =========================================  ==================================================
forward (activations) uncompressed, bf16, q8, q4                  AQ-SGD's runs sent 4-bit activations
backward (gradients)  uncompressed, bf16, q8                      gradients tolerate less (8-bit in the same runs)
====================  =========================================  ==================================================

and :func:`ladder` builds one whose last rung is the codec the user configured (``forward_codec=`` /
``backward_codec=``): the user's codec is the most lossy setting autotune may pick, so it only ever sends *less*
lossy messages than asked, where the link carries them. :func:`boundary_ladders` applies this per boundary to a
per-boundary codec map: a boundary mapped to ``None`` (or left out) has the single rung ``"uncompressed"``.

**Fresh steps.** In a share ``full_fraction`` of the steps each direction sends its *fresh form* instead of the
setting (:func:`fresh_steps` gives both from the variant, as the rules of
:mod:`lightning_clapping.codecs.feedback` send them; :func:`first_visit_fraction` AQ-SGD's share):

=================  =========================================  =====================================================
variant            full_fraction                              fresh form
=================  =========================================  =====================================================
direct             0                                          (none)
ef21, clapping-fc  p, the lazy sampler's (1 without it)       the difference compressed by ``fresh_codec``; without
                                                              one, none
clapping-fu        p                                          full precision, or ``fresh_codec``
aqsgd              the share of the rest of the run's steps   forward: full precision; backward: none
                   that visit never-seen samples
=================  =========================================  =====================================================

Where autotune relaxes a direction (picks a setting that sends more bytes than the codec the user gave there), its
fresh steps are not left more lossy than the setting taken: a ``fresh_codec`` that sends fewer bytes than it is
replaced by that setting (bf16 on a fast link with ``forward_codec="q4"``, ``fresh_codec="q8"``: fresh steps go by
bf16 too; :func:`fresh_form`). At the user's own codec the fresh codec stays as given. The Choice records each
direction's fresh form (:meth:`~lightning_clapping.autotune.choose.Choice.fresh_codec`), so the rule the strategy
builds sends what was priced. A message's expected transfer is ``(1 - f) x compressed + f x fresh form`` (bytes over
bandwidth, ``f = full_fraction``); a fresh step sends every micro-batch in the fresh form, so the step rule prices
``(1 - f) x step(settings) + f x step(fresh forms)``, codec work included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_clapping.autotune.messages import DIRECTIONS, UNCOMPRESSED, message_bytes
from lightning_clapping.codecs import get_codec

DEFAULT_CANDIDATES: dict[str, tuple[str, ...]] = {
    "fwd": (UNCOMPRESSED, "bf16", "q8", "q4"),
    "bwd": (UNCOMPRESSED, "bf16", "q8"),
}


def ladder(direction: str, user_codec: Any = None) -> tuple[str, ...]:
    """The candidate settings of one direction, least lossy first.

    Without ``user_codec``: :data:`DEFAULT_CANDIDATES`. With it (the codec the user configured for this direction,
    a string or a :class:`~lightning_clapping.codecs.Codec` with a registry ``name``): the default rungs that send
    more bytes per value than it, then the user's codec as the most lossy rung (bytes per value are compared on a
    64 x 1024 float32 tensor).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")
    default = DEFAULT_CANDIDATES[direction]
    if user_codec is None:
        return default
    codec = get_codec(user_codec)
    name = user_codec if isinstance(user_codec, str) else codec.name
    get_codec(name)  # the ladder holds strings: the codec must be reachable from its name
    ref = [((64, 1024), torch.float32)]
    limit = message_bytes(ref, name)
    if limit >= message_bytes(ref, UNCOMPRESSED):  # it saves nothing: stay uncompressed
        return (UNCOMPRESSED,)
    return tuple(s for s in default if message_bytes(ref, s) > limit) + (name,)


def boundary_ladders(num_boundaries: int, user_codecs: Mapping[str, Any]) -> dict[int, dict[str, tuple[str, ...]]]:
    """``{boundary: {direction: ladder}}`` from what the user configured per direction (``{"fwd": ..., "bwd": ...}``):
    one codec (every boundary's ladder ends at it), ``{boundary: codec or None}`` (a boundary mapped to None, or left
    out, stays uncompressed: its ladder is ``("uncompressed",)``), or None (the default ladder)."""
    out: dict[int, dict[str, tuple[str, ...]]] = {b: {} for b in range(num_boundaries)}
    for d in DIRECTIONS:
        codec = user_codecs.get(d)
        for b in range(num_boundaries):
            if isinstance(codec, Mapping):
                out[b][d] = (UNCOMPRESSED,) if codec.get(b) is None else ladder(d, codec[b])
            else:
                out[b][d] = ladder(d, codec)
    return out


def fresh_steps(variant: str, fresh_codec: Any = None, p: float = 1.0,
                first_visits: float = 0.0) -> tuple[float, dict[str, str | None]]:
    """``(full_fraction, fresh)`` for :func:`~lightning_clapping.autotune.choose.choose` (the module docstring's
    table): the share of steps whose messages take their fresh form, and that form per direction
    (``"uncompressed"``: full precision, a codec string, None: none). ``p``: the lazy sampler's (1.0 without one);
    ``first_visits``: AQ-SGD's share of steps that visit never-seen samples (:func:`first_visit_fraction`)."""
    name = fresh_codec if fresh_codec is None or isinstance(fresh_codec, str) else get_codec(fresh_codec).name
    if variant == "clapping-fu":
        form = UNCOMPRESSED if name is None else name
        return float(p), {"fwd": form, "bwd": form}
    if variant in ("ef21", "clapping-fc"):  # every fresh step, even when it has no form of its own
        return float(p), {"fwd": name, "bwd": name}
    if variant == "aqsgd":
        return float(first_visits), {"fwd": UNCOMPRESSED, "bwd": None}
    return 0.0, {"fwd": None, "bwd": None}


def first_visit_fraction(p: float, steps_done: int, steps_per_epoch: float, total_steps: float) -> float:
    """AQ-SGD's share of the run's remaining steps that send activations in full: the fresh steps (a share ``p``)
    of the first epoch, where every sample is new (later epochs revisit them). Infinite ``steps_per_epoch``: every
    fresh step; infinite ``total_steps`` (a run without end): none, in the long run."""
    if not math.isfinite(steps_per_epoch):
        return float(p)
    remaining = total_steps - steps_done
    if not math.isfinite(remaining):
        return 0.0
    if remaining <= 0:
        return 0.0
    return float(p) * min(max(steps_per_epoch - steps_done, 0.0), remaining) / remaining


def fresh_form(specs: Sequence, setting: str, fresh: str | None, asked: str | None = None) -> str:
    """The fresh form of ``setting`` for a message of ``specs`` (module docstring): ``fresh``, or the setting itself
    when autotune relaxed the user's codec ``asked`` (the ladder's last rung) to it and it sends more bytes than
    ``fresh``."""
    if setting == UNCOMPRESSED or fresh is None:
        return setting
    size = message_bytes(specs, setting)
    relaxed = asked is not None and size > message_bytes(specs, asked)
    if fresh != UNCOMPRESSED and relaxed and size > message_bytes(specs, fresh):
        return setting
    return fresh
