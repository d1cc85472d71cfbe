"""Choosing: give every boundary the least lossy codecs its measured link can carry (pure and deterministic).

:func:`choose` prices the message of one micro-batch, for each boundary and direction, with every candidate setting:
its exact size on the wire (:func:`~lightning_clapping.autotune.messages.message_bytes`: the codec's
``payload_nbytes`` plus the message header) divided by the measured bandwidth of that direction. Two rules use
these prices.

**The step rule** (what the strategy uses): the timing model :func:`lightning_clapping.pipeline.timing.step_time`
plays one training step of the running schedule with every stage's measured compute (a third forward, two thirds
backward), every boundary's delay, transfers that queue on their link, and the codec work timed on the real messages
(:func:`~lightning_clapping.autotune.probe.codec_times`: the sender encodes and decodes, the receiver decodes). It
finds the fastest settings, then moves towards less lossy ones, one rung at a time and the cheapest move first,
while the predicted step stays within ``1 + tolerance`` (default :data:`DEFAULT_TOLERANCE` = 5 %) of the fastest.
Delay matters here: under 1F1B with more micro-batches than stages, stage 0 waits for gradients to come back
through the delayed links more than once per step, and each transfer lengthens every such wait; a message that
"hides" behind compute in the steady state can still cost a tenth of the step (the per-message rule chose bf16 on
100 Mbit/s links with 25 ms of delay, and that run was 12 % slower than q4/q8). With several schedules
(:func:`choose_pipeline`, ``ClappingStrategy(schedule="auto")``), the first is kept unless another's predicted step
is more than the tolerance shorter.

**The per-message rule** (``schedule=None``): the least lossy setting whose transfer hides behind compute::

    transfer seconds per micro-batch  <=  headroom x compute seconds per micro-batch

where the compute is the pipeline's cycle, the largest forward+backward time per micro-batch of any stage.
``headroom`` (default :data:`DEFAULT_HEADROOM` = 0.8) leaves 20 % for what the measurement misses. When no candidate
hides, the one with the smallest transfer time is taken (on a tie, the less lossy one). It ignores delay and codec
work; the ``hides`` flags of every Choice report this test.

Both rules treat links as full duplex: forward and backward messages cross in opposite directions at the same time,
each on its own queue.

Candidates are settings ordered from least to most lossy: ``"uncompressed"`` or a codec string of
:func:`lightning_clapping.codecs.get_codec`. The default ladders (:data:`DEFAULT_CANDIDATES`) are

====================  =========================================  ==================================================
direction             ladder                                      why
====================  =========================================  ==================================================
forward (activations) uncompressed, bf16, q8, q4                  AQ-SGD's runs sent 4-bit activations
backward (gradients)  uncompressed, bf16, q8                      gradients tolerate less (8-bit in the same runs)
====================  =========================================  ==================================================

and :func:`ladder` builds one whose last rung is the codec the user configured (``forward_codec=`` /
``backward_codec=``): autotune then never compresses more than the user asked for.

A :class:`Choice` says, per boundary, the variant (``"uncompressed"`` when both directions stay uncompressed, else
the compressed variant the user chose) and the setting of each direction, with the numbers that justified it;
:meth:`Choice.rule` gives the ``(variant, codec)`` pair to build each direction's
:class:`~lightning_clapping.codecs.feedback.MessageRule` with (a direction that stays uncompressed gets the
``"uncompressed"`` rule even when the other one is compressed). :func:`describe` makes the log table and
:func:`log_values` the numbers for a logger.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_clapping.autotune.messages import DIRECTIONS, UNCOMPRESSED, CodecTimes, MessageShapes, message_bytes
from lightning_clapping.autotune.probe import LinkMeasure
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import VARIANTS
from lightning_clapping.pipeline.schedule import get_schedule
from lightning_clapping.pipeline.timing import Link, step_time

DEFAULT_CANDIDATES: dict[str, tuple[str, ...]] = {
    "fwd": (UNCOMPRESSED, "bf16", "q8", "q4"),
    "bwd": (UNCOMPRESSED, "bf16", "q8"),
}
DEFAULT_HEADROOM = 0.8
DEFAULT_TOLERANCE = 0.05


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


@dataclass(frozen=True)
class Choice:
    """What autotune chose for one boundary, and why (times and bytes per micro-batch message)."""

    boundary: int
    variant: str  #: "uncompressed" when both directions are, else the compressed variant the user chose
    forward: str  #: setting of the forward direction: "uncompressed" or a codec string
    backward: str
    forward_bytes: int
    backward_bytes: int
    forward_s: float  #: predicted transfer time of one forward message (uncompressed share included)
    backward_s: float
    compute_s: float  #: the compute per micro-batch the transfers must hide behind (the pipeline's cycle)
    budget_s: float  #: headroom x compute_s
    forward_hides: bool
    backward_hides: bool
    #: the step the timing model predicts with every boundary's choice (None: chosen by the per-message rule)
    step_s: float | None = None
    #: the schedule the step was predicted for ("" with the per-message rule)
    schedule: str = ""
    #: every candidate priced: (direction, setting, bytes, seconds)
    options: tuple[tuple[str, str, int, float], ...] = ()

    def setting(self, direction: str) -> str:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")
        return self.forward if direction == "fwd" else self.backward

    def rule(self, direction: str) -> tuple[str, str]:
        """``(variant, codec)`` for this direction's MessageRule: an uncompressed direction gets the
        ``"uncompressed"`` rule (its codec, ``"identity"``, is then not used)."""
        setting = self.setting(direction)
        return (UNCOMPRESSED, "identity") if setting == UNCOMPRESSED else (self.variant, setting)

    @property
    def compressed(self) -> bool:
        return self.variant != UNCOMPRESSED

    def to_wire(self) -> tuple:
        """Plain Python values (for a broadcast, a log, JSON); :meth:`from_wire` rebuilds the Choice."""
        return (self.boundary, self.variant, self.forward, self.backward, self.forward_bytes, self.backward_bytes,
                self.forward_s, self.backward_s, self.compute_s, self.budget_s, self.forward_hides,
                self.backward_hides, self.step_s, self.schedule, tuple(tuple(o) for o in self.options))

    @classmethod
    def from_wire(cls, values: Sequence[Any]) -> Choice:
        *head, options = values
        return cls(*head, options=tuple(tuple(o) for o in options))


def _stage_compute(compute: float | Sequence[float] | Mapping[int, float]) -> list[float]:
    values = [compute] if isinstance(compute, (int, float)) else list(
        compute.values() if isinstance(compute, Mapping) else compute)
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"compute seconds per micro-batch must be finite numbers >= 0, got {compute!r}")
    return [float(v) for v in values]


Priced = tuple[str, int, float]  # (setting, bytes of one message, mean transfer seconds of one message)


def _price(measures: Mapping[int, LinkMeasure], message_shapes: MessageShapes, ladders: Mapping[str, tuple[str, ...]],
           fractions: Mapping[str, float]) -> dict[tuple[int, str], list[Priced]]:
    """Every candidate of every boundary and direction, with its bytes and its transfer time on the measured link."""
    out = {}
    for boundary in sorted(message_shapes):
        if boundary not in measures:
            raise ValueError(f"boundary {boundary} has message shapes but no link measurement")
        for d in DIRECTIONS:
            specs = message_shapes[boundary].get(d, ())
            bandwidth = measures[boundary].bandwidth(d)
            full = message_bytes(specs, UNCOMPRESSED)
            f = float(fractions.get(d, 0.0))
            priced = []
            for setting in ladders[d]:
                nbytes = message_bytes(specs, setting)
                mean_bytes = nbytes if setting == UNCOMPRESSED else f * full + (1 - f) * nbytes
                priced.append((setting, nbytes, mean_bytes / bandwidth))
            out[(boundary, d)] = priced
    return out


def _per_message_rule(priced: Mapping[tuple[int, str], list[Priced]], budget: float) -> dict[tuple[int, str], int]:
    """Per boundary and direction, the least lossy candidate whose transfer fits the budget, else the fastest."""
    out = {}
    for key, options in priced.items():
        hiding = [i for i, p in enumerate(options) if p[2] <= budget]
        # min() keeps the first of equal times: the less lossy setting wins a tie
        out[key] = hiding[0] if hiding else min(range(len(options)), key=lambda i: options[i][2])
    return out


def _step_rule(priced: Mapping[tuple[int, str], list[Priced]], predict: Callable[[dict], float],
               tolerance: float) -> dict[tuple[int, str], int]:
    """The least lossy settings whose predicted step is at most ``1 + tolerance`` times the fastest one found.

    First the fastest: start from each direction's fastest transfer and, twice over every boundary and direction,
    take the candidate that makes the predicted step shortest (codec work can make a smaller message slower). Then
    move one rung towards less loss at a time, always the move that lengthens the predicted step the least (on a tie
    the lower boundary, forward first), while the step stays within the bound. The less lossy rungs of a ladder are
    assumed to send more bytes, as the default ladders do."""
    keys = list(priced)
    pick = {k: min(range(len(priced[k])), key=lambda i, k=k: priced[k][i][2]) for k in keys}
    for _ in range(2):
        for k in keys:
            times = [predict({**pick, k: i}) for i in range(len(priced[k]))]
            pick[k] = min(range(len(times)), key=times.__getitem__)
    bound = (1 + tolerance) * predict(pick)
    while True:  # one rung less lossy at a time, the move that costs the least step time first
        moves = [(predict({**pick, k: pick[k] - 1}), n, k) for n, k in enumerate(keys) if pick[k] > 0]
        allowed = [m for m in moves if m[0] <= bound]
        if not allowed:
            return pick
        _, _, k = min(allowed)
        pick[k] -= 1


def choose(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[str, Sequence[str]] | None = None,
    *,
    variant: str = "direct",
    headroom: float = DEFAULT_HEADROOM,
    full_fraction: float | Mapping[str, float] = 0.0,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    codec_s: CodecTimes | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[int, Choice]:
    """Pick each boundary's forward and backward setting (see the module docstring). Pure and deterministic.

    Args:
        measures: ``{boundary: LinkMeasure}``, forward = initiator to peer (as :func:`probe_boundaries` returns).
        compute_s_per_microbatch: forward+backward seconds per micro-batch, one number or one per stage (a
            sequence or ``{stage: seconds}``); the largest is the pipeline's cycle every boundary is held against.
        message_shapes: ``{boundary: {"fwd": specs, "bwd": specs}}``, the tensors of one micro-batch's message in
            each direction, a spec being ``(shape, dtype)`` or ``(shape, dtype, compressible)``.
        candidates: ``{"fwd": [...], "bwd": [...]}``, settings ordered from least to most lossy (default
            :data:`DEFAULT_CANDIDATES`; see :func:`ladder`).
        variant: the compressed variant to use where a boundary compresses (any of
            :data:`lightning_clapping.codecs.feedback.VARIANTS` but "uncompressed").
        headroom: with the per-message rule, a setting hides when its transfer takes at most ``headroom`` x the
            cycle (the ``hides`` flags report this test under both rules).
        full_fraction: share of the messages a compressed variant still sends in full precision (a number for both
            directions or ``{"fwd": x, "bwd": y}``): ``p`` for clapping-fu (its fresh steps), 0 for direct, ef21 and
            clapping-fc. A compressed setting is priced at ``f x uncompressed + (1 - f) x compressed``.
        schedule, num_microbatches: the step rule (see the module docstring): price whole steps of this schedule
            (a name of :data:`lightning_clapping.pipeline.schedule.SCHEDULES`) with the timing model, one stage per
            entry of ``compute_s_per_microbatch`` (a third of it forward, two thirds backward). None: the
            per-message rule.
        codec_s: ``{boundary: {direction: {setting: (sender_s, receiver_s)}}}``, the codec work of one message on
            each end (measured, see :func:`~lightning_clapping.autotune.probe.codec_times`); missing entries count
            as 0. Step rule only.
        tolerance: step rule: a less lossy setting is taken while the predicted step stays within ``1 + tolerance``
            times the fastest.

    Returns ``{boundary: Choice}`` for every boundary of ``message_shapes``.
    """
    if variant not in VARIANTS or variant == UNCOMPRESSED:
        raise ValueError(f"variant is the compressed variant to fall back on, one of "
                         f"{', '.join(v for v in VARIANTS if v != UNCOMPRESSED)}; got {variant!r}")
    if not (isinstance(headroom, (int, float)) and 0 < headroom < math.inf):
        raise ValueError(f"headroom must be a positive number, got {headroom!r}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    fractions = full_fraction if isinstance(full_fraction, Mapping) else dict.fromkeys(DIRECTIONS, full_fraction)
    for d in DIRECTIONS:
        if not 0 <= fractions.get(d, 0.0) <= 1:
            raise ValueError(f"full_fraction must lie in [0, 1], got {full_fraction!r}")
    ladders = {d: tuple((candidates or DEFAULT_CANDIDATES)[d]) for d in DIRECTIONS}
    for d, rungs in ladders.items():
        if not rungs:
            raise ValueError(f"no candidate settings for direction {d!r}")
        for setting in rungs:
            if setting != UNCOMPRESSED:
                get_codec(setting)  # raises for an unknown codec string
    stages = _stage_compute(compute_s_per_microbatch)
    compute = max(stages)
    budget = headroom * compute
    priced = _price(measures, message_shapes, ladders, fractions)

    step_s = None
    if schedule is None:
        pick = _per_message_rule(priced, budget)
    else:
        predict = _step_model(measures, stages, priced, schedule, num_microbatches, codec_s or {})
        pick = _step_rule(priced, predict, tolerance)
        step_s = predict(pick)

    out = {}
    for boundary in sorted(message_shapes):
        (fwd, fwd_bytes, fwd_s), (bwd, bwd_bytes, bwd_s) = (priced[(boundary, d)][pick[(boundary, d)]]
                                                            for d in DIRECTIONS)
        options = tuple((d, *p) for d in DIRECTIONS for p in priced[(boundary, d)])
        out[boundary] = Choice(
            boundary=boundary,
            variant=UNCOMPRESSED if fwd == bwd == UNCOMPRESSED else variant,
            forward=fwd, backward=bwd, forward_bytes=fwd_bytes, backward_bytes=bwd_bytes,
            forward_s=fwd_s, backward_s=bwd_s, compute_s=compute, budget_s=budget,
            forward_hides=fwd_s <= budget, backward_hides=bwd_s <= budget,
            step_s=step_s, schedule=schedule or "", options=options,
        )
    return out


def _step_model(measures: Mapping[int, LinkMeasure], stages: list[float],
                priced: Mapping[tuple[int, str], list[Priced]], schedule: str, num_microbatches: int | None,
                codec_s: CodecTimes) -> Callable[[dict], float]:
    """``predict(pick)``: the step time of ``schedule`` with the candidates ``pick`` ({(boundary, direction): index}),
    by :func:`lightning_clapping.pipeline.timing.step_time`."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"the step rule needs num_microbatches >= 1, got {num_microbatches!r}")
    boundaries = sorted({b for b, _ in priced})
    if len(stages) == 1:
        stages = stages * (len(boundaries) + 1)
    if boundaries != list(range(len(stages) - 1)):
        raise ValueError(f"the step rule needs every boundary of {len(stages)} stages, got {boundaries}")
    actions = get_schedule(schedule)(len(stages), num_microbatches)
    forward = [c / 3 for c in stages]  # a backward takes about twice its forward
    backward = [2 * c / 3 for c in stages]

    def work(b: int, d: str, setting: str) -> tuple[float, float]:
        return tuple(codec_s.get(b, {}).get(d, {}).get(setting, (0.0, 0.0)))

    def predict(pick: Mapping[tuple[int, str], int]) -> float:
        links = []
        for b in boundaries:
            (fs, _, ft), (bs, _, bt) = priced[(b, "fwd")][pick[(b, "fwd")]], priced[(b, "bwd")][pick[(b, "bwd")]]
            links.append(Link(measures[b].one_way_delay_s, ft, bt, work(b, "fwd", fs), work(b, "bwd", bs)))
        return step_time(actions, forward, backward, links)

    return predict


def choose_pipeline(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[str, Sequence[str]] | None = None,
    *,
    schedules: Sequence[str] = (),
    tolerance: float = DEFAULT_TOLERANCE,
    **choose_kwargs: Any,
) -> dict[int, Choice]:
    """:func:`choose` for each schedule of ``schedules`` (step rule); the first schedule's choice is kept unless
    another one's predicted step is more than ``tolerance`` shorter (then the shortest). Each Choice records its
    schedule. Without ``schedules``: :func:`choose` with ``choose_kwargs`` as given."""
    if not schedules:
        return choose(measures, compute_s_per_microbatch, message_shapes, candidates, tolerance=tolerance,
                      **choose_kwargs)
    best: dict[int, Choice] | None = None
    for name in schedules:
        choices = choose(measures, compute_s_per_microbatch, message_shapes, candidates, schedule=name,
                         tolerance=tolerance, **choose_kwargs)
        if best is None or _step_of(choices) * (1 + tolerance) < _step_of(best):  # type: ignore[operator]
            best = choices
    assert best is not None
    return best


def _step_of(choices: Mapping[int, Choice]) -> float | None:
    return next(iter(choices.values())).step_s if choices else None



# --------------------------------------------------------------------------------------------------------------------
# Logging


def _uncompressed_s(choice: Choice, direction: str) -> float | None:
    for d, setting, _, seconds in choice.options:
        if d == direction and setting == UNCOMPRESSED:
            return seconds
    return None


def describe(choices: Mapping[int, Choice], measures: Mapping[int, LinkMeasure]) -> str:
    """A table for the log: per boundary the measured link, the compute it must hide behind, the choice and its
    predicted transfer time per micro-batch (and the uncompressed one, when it was a candidate)."""
    lines = ["autotune (per micro-batch; a setting hides when its transfer <= budget = headroom x compute):",
             f"{'boundary':>8}  {'delay ms':>8}  {'MB/s fwd':>9}  {'MB/s bwd':>9}  {'compute ms':>10}  "
             f"{'budget ms':>9}  {'forward':<26}  {'backward':<26}  variant"]
    for b in sorted(choices):
        c, m = choices[b], measures.get(b)

        def cell(direction: str) -> str:
            setting, seconds = c.setting(direction), c.forward_s if direction == "fwd" else c.backward_s
            hides = c.forward_hides if direction == "fwd" else c.backward_hides
            text = f"{setting} {seconds * 1e3:.2f} ms"
            full = _uncompressed_s(c, direction)
            if setting != UNCOMPRESSED and full is not None:
                text += f" (unc. {full * 1e3:.1f})"
            return text + ("" if hides else " !")

        delay = f"{m.one_way_delay_s * 1e3:8.2f}" if m else f"{'?':>8}"
        fwd_bw = f"{m.bandwidth('fwd') / 1e6:9.1f}" if m else f"{'?':>9}"
        bwd_bw = f"{m.bandwidth('bwd') / 1e6:9.1f}" if m else f"{'?':>9}"
        lines.append(f"{b:>8}  {delay}  {fwd_bw}  {bwd_bw}  {c.compute_s * 1e3:10.2f}  {c.budget_s * 1e3:9.2f}  "
                     f"{cell('fwd'):<26}  {cell('bwd'):<26}  {c.variant}")
    step = _step_of(choices)
    if step is None:
        if any(not (c.forward_hides and c.backward_hides) for c in choices.values()):
            lines.append("  ! no candidate hides behind compute in this direction: the fastest one was taken")
    else:
        lines.append(f"  predicted step with these settings under {next(iter(choices.values())).schedule}: "
                     f"{step * 1e3:.1f} ms (timing model; '!': the transfer alone exceeds the budget)")
    return "\n".join(lines)


def log_values(choices: Mapping[int, Choice], measures: Mapping[int, LinkMeasure]) -> dict[str, float]:
    """Flat numbers for a logger: ``autotune/b{m}_delay_ms``, ``_fwd_mb_s``, ``_bwd_mb_s``, ``_fwd_ms``,
    ``_bwd_ms`` (predicted transfer per micro-batch), ``_fwd_bytes``, ``_bwd_bytes`` and ``_compressed`` (0/1)."""
    out: dict[str, float] = {}
    for b, c in sorted(choices.items()):
        m = measures.get(b)
        if m is not None:
            out[f"autotune/b{b}_delay_ms"] = m.one_way_delay_s * 1e3
            out[f"autotune/b{b}_fwd_mb_s"] = m.bandwidth("fwd") / 1e6
            out[f"autotune/b{b}_bwd_mb_s"] = m.bandwidth("bwd") / 1e6
        out[f"autotune/b{b}_fwd_ms"] = c.forward_s * 1e3
        out[f"autotune/b{b}_bwd_ms"] = c.backward_s * 1e3
        out[f"autotune/b{b}_fwd_bytes"] = float(c.forward_bytes)
        out[f"autotune/b{b}_bwd_bytes"] = float(c.backward_bytes)
        out[f"autotune/b{b}_compressed"] = float(c.compressed)
    step = _step_of(choices)
    if step is not None:
        out["autotune/predicted_step_ms"] = step * 1e3
    return out

