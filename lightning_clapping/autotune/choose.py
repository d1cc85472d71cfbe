"""Choosing: give every boundary the least lossy codecs its measured link can carry (pure and deterministic).

:func:`choose` prices the message of one micro-batch, for each boundary and direction, with every candidate setting:
its exact size on the wire (:func:`~lightning_clapping.autotune.messages.message_bytes`: the codec's
``payload_nbytes`` plus the message header) divided by the measured bandwidth of that direction. The candidates
come from :mod:`~lightning_clapping.autotune.ladders`: each boundary and direction has a ladder from uncompressed
down to the codec the user configured there (never beyond it), and a share of the steps (fresh steps, AQ-SGD's first
visits) sends a fresh form that is priced with it: ``(1 - f) x setting + f x fresh form`` per message.

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

**The frontier rule** (``frontier=``, the step rule only; ``ClappingStrategy(autotune="frontier")``): the published
settings of :func:`lightning_clapping.autotune.frontier.admissible` (the run's variant and p, quality deficit within
the quality tolerance on every published task) are priced too, each as one plan: its forward, backward and fresh
codecs on every boundary and direction that the ladders compress. The ladders' choice is kept unless a plan's
predicted step is more than ``tolerance`` shorter, that is on links too slow for the ladders. Then, among the plans
within ``1 + tolerance`` of the fastest step, the one with the smallest published deficit (relative to the quality
tolerance, worst task) is taken, and boundaries and directions whose links do not need it go back to the ladders'
setting, the cheapest first, while the step stays within that bound.

**The per-message rule** (``schedule=None``): the least lossy setting whose transfer hides behind compute::

    transfer seconds per micro-batch  <=  headroom x compute seconds per micro-batch

where the compute is the pipeline's cycle, the largest forward+backward time per micro-batch of any stage.
``headroom`` (default :data:`DEFAULT_HEADROOM` = 0.8) leaves 20 % for what the measurement misses. When no candidate
hides, the one with the smallest transfer time is taken (on a tie, the less lossy one). It ignores delay and codec
work; the ``hides`` flags of every Choice report this test.

Both rules treat links as full duplex: forward and backward messages cross in opposite directions at the same time,
each on its own queue.

A :class:`Choice` says, per boundary, the variant (``"uncompressed"`` when both directions stay uncompressed, else
the compressed variant the user chose) and the setting of each direction, with the numbers that justified it;
:meth:`Choice.rule` gives the ``(variant, codec)`` pair and :meth:`Choice.fresh_codec` the fresh codec to build each
direction's :class:`~lightning_clapping.codecs.feedback.MessageRule` with (a direction that stays uncompressed gets
the ``"uncompressed"`` rule even when the other one is compressed). :func:`describe` makes the log table and
:func:`log_values` the numbers for a logger.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_clapping.autotune.frontier import FrontierSetting, frontier_rule
from lightning_clapping.autotune.ladders import DEFAULT_CANDIDATES, boundary_ladders, fresh_form, fresh_steps, ladder
from lightning_clapping.autotune.messages import DIRECTIONS, UNCOMPRESSED, CodecTimes, MessageShapes, message_bytes
from lightning_clapping.autotune.probe import LinkMeasure
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import VARIANTS
from lightning_clapping.pipeline.schedule import get_schedule
from lightning_clapping.pipeline.timing import Link, step_time

__all__ = ["DEFAULT_CANDIDATES", "Choice", "boundary_ladders", "choose", "choose_pipeline", "describe", "fresh_steps",
           "ladder", "log_values"]
DEFAULT_HEADROOM = 0.8
DEFAULT_TOLERANCE = 0.05
Fresh = Mapping[str, "str | None"]  # per direction: the fresh form's setting, None: no fresh form


@dataclass(frozen=True)
class Choice:
    """What autotune chose for one boundary, and why (times and bytes per micro-batch message)."""

    boundary: int
    variant: str  #: "uncompressed" when both directions are, else the compressed variant the user chose
    forward: str  #: setting of the forward direction: "uncompressed" or a codec string
    backward: str
    forward_bytes: int  #: one message of the setting (a fresh step's form is in ``options``' pricing only)
    backward_bytes: int
    forward_s: float  #: expected transfer time of one forward message (fresh steps' share included)
    backward_s: float
    compute_s: float  #: the compute per micro-batch the transfers must hide behind (the pipeline's cycle)
    budget_s: float  #: headroom x compute_s
    forward_hides: bool
    backward_hides: bool
    #: the step the timing model predicts with every boundary's choice (None: chosen by the per-message rule)
    step_s: float | None = None
    #: the schedule the step was predicted for ("" with the per-message rule)
    schedule: str = ""
    #: every candidate priced: (direction, setting, bytes, expected seconds)
    options: tuple[tuple[str, str, int, float], ...] = ()
    #: the fresh form of each direction ("uncompressed": full precision, else a codec string; None: not recorded,
    #: a choice saved before fresh forms were priced, which keeps the strategy's fresh_codec)
    forward_fresh: str | None = None
    backward_fresh: str | None = None
    full_fraction: float = 0.0  #: share of steps priced in the fresh form
    frontier: str = ""  #: the published setting the frontier rule took ("": the ladders' choice)

    def setting(self, direction: str) -> str:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")
        return self.forward if direction == "fwd" else self.backward

    def rule(self, direction: str) -> tuple[str, str]:
        """``(variant, codec)`` for this direction's MessageRule: an uncompressed direction gets the
        ``"uncompressed"`` rule (its codec, ``"identity"``, is then not used)."""
        setting = self.setting(direction)
        return (UNCOMPRESSED, "identity") if setting == UNCOMPRESSED else (self.variant, setting)

    def fresh_codec(self, direction: str, default: Any = None) -> Any:
        """The ``fresh_codec`` of this direction's MessageRule, as priced: None for full-precision fresh steps or
        none at all, else a codec string; ``default`` (the strategy's fresh_codec) when the choice predates fresh
        forms."""
        form = self.forward_fresh if direction == "fwd" else self.backward_fresh
        if form is None:
            return default
        if form == UNCOMPRESSED or (form == self.setting(direction) and self.variant != "clapping-fu"):
            return None  # the same messages as without a fresh codec
        return form

    @property
    def compressed(self) -> bool:
        return self.variant != UNCOMPRESSED

    def to_wire(self) -> tuple:
        """Plain Python values (for a broadcast, a log, JSON); :meth:`from_wire` rebuilds the Choice."""
        return (self.boundary, self.variant, self.forward, self.backward, self.forward_bytes, self.backward_bytes,
                self.forward_s, self.backward_s, self.compute_s, self.budget_s, self.forward_hides,
                self.backward_hides, self.step_s, self.schedule, tuple(tuple(o) for o in self.options),
                self.forward_fresh, self.backward_fresh, self.full_fraction, self.frontier)

    @classmethod
    def from_wire(cls, values: Sequence[Any]) -> Choice:
        """Also reads the 15 values of a choice saved before fresh forms were recorded."""
        head, options, tail = values[:14], values[14], values[15:]
        return cls(*head, tuple(tuple(o) for o in options), *tail)


def _stage_compute(compute: float | Sequence[float] | Mapping[int, float]) -> list[float]:
    values = [compute] if isinstance(compute, (int, float)) else list(
        compute.values() if isinstance(compute, Mapping) else compute)
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"compute seconds per micro-batch must be finite numbers >= 0, got {compute!r}")
    return [float(v) for v in values]


class Priced(NamedTuple):
    """One setting of one boundary and direction, priced."""

    setting: str
    nbytes: int  #: one message of the setting
    seconds: float  #: expected transfer of one message: (1 - f) x setting + f x fresh form
    fresh: str  #: the fresh form's setting (the setting itself when there is none)
    usual_s: float  #: transfer of one message of the setting
    fresh_s: float  #: transfer of one message of the fresh form


Key = tuple[int, str]  # (boundary, direction)


class _Pricer:
    """Prices any setting of any boundary and direction on its measured link."""

    def __init__(self, measures: Mapping[int, LinkMeasure], message_shapes: MessageShapes, fraction: float) -> None:
        self.measures, self.shapes, self.fraction = measures, message_shapes, fraction

    def __call__(self, key: Key, setting: str, fresh: str | None, asked: str | None = None) -> Priced:
        """``fresh``: the fresh form asked for; ``asked``: the user's codec (the ladder's last rung), which
        :func:`~lightning_clapping.autotune.ladders.fresh_form` relaxes the fresh form with."""
        b, d = key
        specs = self.shapes[b].get(d, ())
        bandwidth = self.measures[b].bandwidth(d)
        form = fresh_form(specs, setting, fresh, asked)
        nbytes = message_bytes(specs, setting)
        usual, fresh_s = nbytes / bandwidth, message_bytes(specs, form) / bandwidth
        return Priced(setting, nbytes, (1 - self.fraction) * usual + self.fraction * fresh_s, form, usual, fresh_s)


def _per_message_rule(priced: Mapping[Key, list[Priced]], budget: float) -> dict[Key, int]:
    """Per boundary and direction, the least lossy candidate whose transfer fits the budget, else the fastest."""
    out = {}
    for key, options in priced.items():
        hiding = [i for i, p in enumerate(options) if p.seconds <= budget]
        # min() keeps the first of equal times: the less lossy setting wins a tie
        out[key] = hiding[0] if hiding else min(range(len(options)), key=lambda i: options[i].seconds)
    return out


Predict = Callable[[Mapping[Key, Priced]], float]


def _step_rule(priced: Mapping[Key, list[Priced]], predict: Predict, tolerance: float) -> dict[Key, int]:
    """The least lossy settings whose predicted step is at most ``1 + tolerance`` times the fastest one found.

    First the fastest: start from each direction's fastest transfer and, twice over every boundary and direction,
    take the candidate that makes the predicted step shortest (codec work can make a smaller message slower). Then
    move one rung towards less loss at a time, always the move that lengthens the predicted step the least (on a tie
    the lower boundary, forward first), while the step stays within the bound. The less lossy rungs of a ladder are
    assumed to send more bytes, as the default ladders do."""
    keys = list(priced)

    def at(pick: Mapping[Key, int]) -> float:
        return predict({k: priced[k][i] for k, i in pick.items()})

    pick = {k: min(range(len(priced[k])), key=lambda i, k=k: priced[k][i].seconds) for k in keys}
    for _ in range(2):
        for k in keys:
            times = [at({**pick, k: i}) for i in range(len(priced[k]))]
            pick[k] = min(range(len(times)), key=times.__getitem__)
    bound = (1 + tolerance) * at(pick)
    while True:  # one rung less lossy at a time, the move that costs the least step time first
        moves = [(at({**pick, k: pick[k] - 1}), n, k) for n, k in enumerate(keys) if pick[k] > 0]
        allowed = [m for m in moves if m[0] <= bound]
        if not allowed:
            return pick
        _, _, k = min(allowed)
        pick[k] -= 1


def choose(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[Any, Any] | None = None,
    *,
    variant: str = "direct",
    headroom: float = DEFAULT_HEADROOM,
    full_fraction: float = 0.0,
    fresh: Fresh | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    codec_s: CodecTimes | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    frontier: Sequence[FrontierSetting] = (),
    frontier_fresh: Callable[[FrontierSetting], Fresh] | None = None,
) -> dict[int, Choice]:
    """Pick each boundary's forward and backward setting (see the module docstring). Pure and deterministic.

    Args:
        measures: ``{boundary: LinkMeasure}``, forward = initiator to peer (as :func:`probe_boundaries` returns).
        compute_s_per_microbatch: forward+backward seconds per micro-batch, one number or one per stage (a
            sequence or ``{stage: seconds}``); the largest is the pipeline's cycle every boundary is held against.
        message_shapes: ``{boundary: {"fwd": specs, "bwd": specs}}``, the tensors of one micro-batch's message in
            each direction, a spec being ``(shape, dtype)`` or ``(shape, dtype, compressible)``.
        candidates: settings ordered from least to most lossy, ``{"fwd": [...], "bwd": [...]}`` for every boundary
            or ``{boundary: {"fwd": [...], "bwd": [...]}}`` (:func:`boundary_ladders`); default
            :data:`DEFAULT_CANDIDATES`.
        variant: the compressed variant to use where a boundary compresses (any of
            :data:`lightning_clapping.codecs.feedback.VARIANTS` but "uncompressed").
        headroom: with the per-message rule, a setting hides when its transfer takes at most ``headroom`` x the
            cycle (the ``hides`` flags report this test under both rules).
        full_fraction, fresh: the share of steps whose messages take their fresh form, and that form per direction
            (``{"fwd": form, "bwd": form}``, a form being "uncompressed" for full precision, a codec string, or None
            for none; default: full precision both ways); :func:`fresh_steps` gives both for a variant.
        schedule, num_microbatches: the step rule (see the module docstring): price whole steps of this schedule
            (a name of :data:`lightning_clapping.pipeline.schedule.SCHEDULES`) with the timing model, one stage per
            entry of ``compute_s_per_microbatch`` (a third of it forward, two thirds backward). None: the
            per-message rule.
        codec_s: ``{boundary: {direction: {setting: (sender_s, receiver_s)}}}``, the codec work of one message on
            each end (measured, see :func:`~lightning_clapping.autotune.probe.codec_times`); missing entries count
            as 0. Step rule only.
        tolerance: step rule: a less lossy setting is taken while the predicted step stays within ``1 + tolerance``
            times the fastest.
        frontier, frontier_fresh: the frontier rule (step rule only): the published settings that may be used
            (:func:`~lightning_clapping.autotune.frontier.admissible`), and the fresh forms of each (default: by
            :func:`fresh_steps` for ``variant`` with the setting's fresh codec).

    Returns ``{boundary: Choice}`` for every boundary of ``message_shapes``.
    """
    if variant not in VARIANTS or variant == UNCOMPRESSED:
        raise ValueError(f"variant is the compressed variant to fall back on, one of "
                         f"{', '.join(v for v in VARIANTS if v != UNCOMPRESSED)}; got {variant!r}")
    if not (isinstance(headroom, (int, float)) and 0 < headroom < math.inf):
        raise ValueError(f"headroom must be a positive number, got {headroom!r}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    if isinstance(full_fraction, bool) or not (isinstance(full_fraction, (int, float)) and 0 <= full_fraction <= 1):
        raise ValueError(f"full_fraction must be a number in [0, 1] (the share of fresh steps), got {full_fraction!r}")
    fresh = {d: UNCOMPRESSED for d in DIRECTIONS} if fresh is None else {d: fresh.get(d) for d in DIRECTIONS}
    if frontier and schedule is None:
        raise ValueError("the frontier rule prices whole steps: give schedule= and num_microbatches= with frontier=")
    ladders = _ladders(candidates, message_shapes)
    for setting in {s for rungs in ladders.values() for s in rungs} | {f for f in fresh.values() if f}:
        if setting != UNCOMPRESSED:
            get_codec(setting)  # raises for an unknown codec string
    stages = _stage_compute(compute_s_per_microbatch)
    compute = max(stages)
    budget = headroom * compute
    for boundary in message_shapes:
        if boundary not in measures:
            raise ValueError(f"boundary {boundary} has message shapes but no link measurement")
    price = _Pricer(measures, message_shapes, float(full_fraction))
    priced = {k: [price(k, s, fresh[k[1]], rungs[-1]) for s in rungs] for k, rungs in ladders.items()}

    step_s, label = None, ""
    if schedule is None:
        pick = _per_message_rule(priced, budget)
        plan = {k: priced[k][i] for k, i in pick.items()}
    else:
        predict = _step_model(measures, stages, list(priced), schedule, num_microbatches, codec_s or {},
                              float(full_fraction))
        pick = _step_rule(priced, predict, tolerance)
        plan = {k: priced[k][i] for k, i in pick.items()}
        if frontier:
            fresh_of = frontier_fresh or (lambda s: fresh_steps(variant, s.fresh)[1])
            plan, label = frontier_rule(plan, ladders, frontier, fresh_of, price, predict, tolerance)
        step_s = predict(plan)

    out = {}
    for boundary in sorted(message_shapes):
        fwd, bwd = plan[(boundary, "fwd")], plan[(boundary, "bwd")]
        options = tuple((d, p.setting, p.nbytes, p.seconds) for d in DIRECTIONS for p in priced[(boundary, d)])
        out[boundary] = Choice(
            boundary=boundary,
            variant=UNCOMPRESSED if fwd.setting == bwd.setting == UNCOMPRESSED else variant,
            forward=fwd.setting, backward=bwd.setting, forward_bytes=fwd.nbytes, backward_bytes=bwd.nbytes,
            forward_s=fwd.seconds, backward_s=bwd.seconds, compute_s=compute, budget_s=budget,
            forward_hides=fwd.seconds <= budget, backward_hides=bwd.seconds <= budget,
            step_s=step_s, schedule=schedule or "", options=options, forward_fresh=fwd.fresh,
            backward_fresh=bwd.fresh, full_fraction=float(full_fraction), frontier=label,
        )
    return out


def _ladders(candidates: Mapping[Any, Any] | None, message_shapes: MessageShapes) -> dict[Key, tuple[str, ...]]:
    """``{(boundary, direction): ladder}`` for every boundary of ``message_shapes``."""
    candidates = DEFAULT_CANDIDATES if candidates is None else candidates
    per_boundary = not set(candidates) <= set(DIRECTIONS)
    out = {}
    for b in sorted(message_shapes):
        if per_boundary and b not in candidates:
            raise ValueError(f"candidates name no ladders for boundary {b}")
        for d in DIRECTIONS:
            rungs = tuple((candidates[b] if per_boundary else candidates).get(d, ()))
            if not rungs:
                raise ValueError(f"no candidate settings for direction {d!r} of boundary {b}")
            out[(b, d)] = rungs
    return out


def _step_model(measures: Mapping[int, LinkMeasure], stages: list[float], keys: Sequence[Key], schedule: str,
                num_microbatches: int | None, codec_s: CodecTimes, fraction: float) -> Predict:
    """``predict(plan)``: the step time of ``schedule`` with the priced settings ``plan`` ({(boundary, direction):
    Priced}), by :func:`lightning_clapping.pipeline.timing.step_time`; with fresh steps, ``(1 - f) x`` the step of
    the settings ``+ f x`` the step of their fresh forms."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"the step rule needs num_microbatches >= 1, got {num_microbatches!r}")
    boundaries = sorted({b for b, _ in keys})
    if len(stages) == 1:
        stages = stages * (len(boundaries) + 1)
    if boundaries != list(range(len(stages) - 1)):
        raise ValueError(f"the step rule needs every boundary of {len(stages)} stages, got {boundaries}")
    actions = get_schedule(schedule)(len(stages), num_microbatches)
    forward = [c / 3 for c in stages]  # a backward takes about twice its forward
    backward = [2 * c / 3 for c in stages]

    def work(b: int, d: str, setting: str) -> tuple[float, float]:
        return tuple(codec_s.get(b, {}).get(d, {}).get(setting, (0.0, 0.0)))

    def step(plan: Mapping[Key, Priced], fresh: bool) -> float:
        links = []
        for b in boundaries:
            f, g = plan[(b, "fwd")], plan[(b, "bwd")]
            if fresh:
                links.append(Link(measures[b].one_way_delay_s, f.fresh_s, g.fresh_s, work(b, "fwd", f.fresh),
                                  work(b, "bwd", g.fresh)))
            else:
                links.append(Link(measures[b].one_way_delay_s, f.usual_s, g.usual_s, work(b, "fwd", f.setting),
                                  work(b, "bwd", g.setting)))
        return step_time(actions, forward, backward, links)

    def predict(plan: Mapping[Key, Priced]) -> float:
        usual = step(plan, False)
        if fraction == 0 or all(p.fresh == p.setting for p in plan.values()):
            return usual
        return (1 - fraction) * usual + fraction * step(plan, True)

    return predict


def choose_pipeline(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[Any, Any] | None = None,
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
    fresh = [f"b{b} {d} {'full' if form == UNCOMPRESSED else form}" for b, c in sorted(choices.items())
             for d, form in (("fwd", c.forward_fresh), ("bwd", c.backward_fresh))
             if c.full_fraction > 0 and form is not None and form != c.setting(d)]
    if fresh:
        lines.append(f"  fresh steps ({next(iter(choices.values())).full_fraction:.0%} of steps, priced): "
                     + ", ".join(fresh))
    label = next(iter(choices.values())).frontier if choices else ""
    if label:
        lines.append(f"  frontier rule: the links need more than the ladders give; took the published setting "
                     f"{label!r} (deficit within the quality tolerance)")
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

