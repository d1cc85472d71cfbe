"""Autotune, on every rank at once: probe the links, time the codecs, agree on one choice.

Used once after the first training step (:func:`tune_pipeline`, the strategy's one entry point): each rank probes
its boundaries (:mod:`.probe`), times the candidate codecs on the messages it sends, and :func:`agree` gathers every
rank's numbers, lets one rank choose (:mod:`.choose`) and hands the choice to all. :func:`describe` and
:func:`log_values` (from :mod:`.choose`) render what was chosen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_clapping.autotune.choose import DEFAULT_TOLERANCE, Choice, choose_pipeline, describe, log_values
from lightning_clapping.autotune.frontier import FrontierSetting, admissible
from lightning_clapping.autotune.ladders import boundary_ladders, first_visit_fraction, fresh_steps
from lightning_clapping.autotune.messages import UNCOMPRESSED, CodecTimes, MessageShapes, TensorSpec
from lightning_clapping.autotune.messages import message_bytes, spec_of
from lightning_clapping.autotune.probe import Group, LinkMeasure, ProbeError, codec_times, probe_boundaries
from lightning_clapping.comm import safe_objects
from lightning_clapping.comm.placement import Placement

#: what the strategy uses: the entry point, and what renders its result
__all__ = ["Choice", "LinkMeasure", "agree", "describe", "first_visit_fraction", "log_values", "tune_pipeline"]


def agree(
    stage: int,
    num_stages: int,
    measures: Mapping[int, LinkMeasure],
    compute_s: float,
    message_shapes: MessageShapes,
    *,
    group: Group = None,
    src: int = 0,
    codec_s: CodecTimes | None = None,
    **choose_kwargs: Any,
) -> tuple[dict[int, Choice], dict[int, LinkMeasure]]:
    """Decide on one rank and tell every rank: returns ``(choices, measures of every boundary)``, the same everywhere.

    Each rank passes what it knows: its stage, the measures :func:`~.probe.probe_boundaries` returned, its own compute
    seconds per micro-batch and the message shapes it knows (e.g. ``{s: {"fwd": ...}, s - 1: {"bwd": ...}}`` for
    what it sends). Two collectives over ``group`` (all ranks must call), as JSON and never pickled
    (:mod:`~lightning_clapping.comm.safe_objects`): an all-gather of these numbers, then a broadcast of the choices
    that rank ``src`` computed with :func:`~.choose.choose`
    (``choose_kwargs``: those of :func:`~.choose.choose_pipeline`; ``codec_s``: the codec times this rank measured
    for the messages it sends, merged over the ranks and handed to the step rule). Raises :class:`ProbeError` on
    every rank when the two ends of a boundary report different measurements, and ValueError on every rank when
    ``choose`` refused its arguments on rank ``src``.
    """
    mine = {
        "stage": int(stage),
        "measures": {int(b): m.to_wire() for b, m in measures.items()},
        "compute_s": float(compute_s),
        "shapes": {int(b): {d: [spec_of(s) for s in specs] for d, specs in dirs.items()}
                   for b, dirs in message_shapes.items()},
        "codec_s": {int(b): {d: dict(t) for d, t in dirs.items()} for b, dirs in (codec_s or {}).items()},
    }
    gathered = safe_objects.all_gather(mine, group=group)
    wires: dict[int, list[float]] = {}
    compute: dict[int, float] = {}
    shapes: dict[int, dict[str, list]] = {}
    times: dict[int, dict[str, dict]] = {}
    for item in gathered:
        compute[item["stage"]] = item["compute_s"]
        for b, dirs in item["codec_s"].items():
            for d, t in dirs.items():
                times.setdefault(b, {})[d] = t
        for b, wire in item["measures"].items():
            if b in wires and not _same_wire(wires[b], wire):
                raise ProbeError(f"the two ends of boundary {b} measured different links: {wires[b]} and {wire}")
            wires[b] = wire
        for b, dirs in item["shapes"].items():
            for d, specs in dirs.items():
                shapes.setdefault(b, {})[d] = specs
    all_measures = {b: LinkMeasure.from_wire(w) for b, w in sorted(wires.items())}
    missing = [s for s in range(num_stages) if s not in compute]
    if missing:
        raise ValueError(f"stages {missing} did not report their compute time")
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            choices = choose_pipeline(all_measures, [compute[s] for s in range(num_stages)], shapes, codec_s=times,
                                      **choose_kwargs)
            payload = [("ok", [c.to_wire() for c in choices.values()])]
        except (ValueError, TypeError) as err:  # every rank raises it, instead of waiting for a broadcast
            payload = [("error", f"{type(err).__name__}: {err}")]
    status, body = safe_objects.broadcast(payload[0], src, group=group)
    if status != "ok":
        raise ValueError(f"autotune could not choose on rank {src}: {body}")
    return {w[0]: Choice.from_wire(w) for w in body}, all_measures


def _same_wire(a: list[float], b: list[float]) -> bool:
    """Equal measurement lists, NaN matching NaN (an unprobed reverse direction)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def tune_pipeline(
    placement: Placement,
    sent_specs: Mapping[str, Sequence[TensorSpec]],
    compute_s: float,
    variant: str,
    user_codecs: Mapping[str, Any],
    timeout: timedelta | None = None,
    schedules: Sequence[str] = (),
    num_microbatches: int | None = None,
    *,
    fresh_codec: Any = None,
    p: float = 1.0,
    first_visits: float = 0.0,
    frontier: Mapping[str, float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[dict[int, Choice], dict[int, LinkMeasure]]:
    """What one pipeline rank does to autotune, between two steps (every rank at once): probe its boundaries with
    their real uncompressed message size, time the candidate codecs on the messages it sends, then :func:`agree`
    on the choices: by the step rule for ``schedules`` (the first is the one running; more: autotune may switch),
    with ``num_microbatches`` per step; without ``schedules``, by the per-message rule.

    ``placement``: this rank's stage and its replica's ranks; the agreement runs over its pipeline group, and the
    replica's last stage decides. ``sent_specs``: what this rank sent in the last step, by the executor's rule name
    (``"fwd_out"``: boundary ``stage``, ``"bwd_out"``: boundary ``stage - 1``); ``user_codecs``: the codecs the user
    configured, ``{"fwd": codec or {boundary: codec or None}, "bwd": ...}`` (each boundary's ladder ends at its
    codec, a boundary mapped to None stays uncompressed: :func:`~.ladders.boundary_ladders`; None: the default
    ladder). ``fresh_codec``, ``p`` (the lazy sampler's, 1.0 without one) and ``first_visits`` (AQ-SGD's share of
    steps with never-seen samples) say what fresh steps send (:func:`~.ladders.fresh_steps`); ``frontier``: the
    quality tolerance ``{unit: deficit}`` of the frontier rule (:func:`~.frontier.admissible`), None: ladders only;
    ``tolerance``: the step rule's.
    """
    stage, num_stages = placement.stage, placement.num_stages
    shapes: dict[int, dict[str, Sequence[TensorSpec]]] = {}
    if "fwd_out" in sent_specs:
        shapes[stage] = {"fwd": sent_specs["fwd_out"]}
    if "bwd_out" in sent_specs:
        shapes.setdefault(stage - 1, {})["bwd"] = sent_specs["bwd_out"]
    # the lower stage of a boundary sets its probe size: the boundary's uncompressed message of one micro-batch
    probe_bytes = {stage - 1: 0, stage: message_bytes(sent_specs["fwd_out"], UNCOMPRESSED)
                   if "fwd_out" in sent_specs else 0}
    measures = probe_boundaries(stage, num_stages, placement.rank_of_stage, probe_bytes, timeout=timeout,
                                device=placement.device)
    ladders = boundary_ladders(num_stages - 1, user_codecs)
    fraction, fresh = fresh_steps(variant, fresh_codec, p, first_visits)
    published = admissible(variant, p, frontier) if frontier is not None and schedules else []
    timed = {b: {d: codec_times(specs, settings_to_time(variant, ladders[b][d], fresh[d], published, d),
                                     device=placement.device)
                 for d, specs in dirs.items()} for b, dirs in shapes.items()}
    extra = {"schedules": tuple(schedules), "num_microbatches": num_microbatches, "frontier": published} \
        if schedules else {}
    return agree(stage, num_stages, measures, compute_s, shapes, variant=variant, candidates=ladders,
                 full_fraction=fraction, fresh=fresh, tolerance=tolerance, group=placement.pp_group,
                 src=placement.last_rank, codec_s=timed, **extra)


def settings_to_time(variant: str, rungs: Sequence[str], fresh: str | None, published: Sequence[FrontierSetting],
                     direction: str) -> list[str]:
    """Every setting the step rule may price for one direction: the ladder's rungs, the fresh form, and the
    published settings' codecs (a direction whose ladder is only "uncompressed" stays so)."""
    if tuple(rungs) == (UNCOMPRESSED,):
        return [UNCOMPRESSED]
    extra = [fresh]
    for s in published:
        extra += [s.setting(direction), fresh_steps(variant, s.fresh)[1][direction]]
    return list(dict.fromkeys([*rungs, *(x for x in extra if x is not None)]))
