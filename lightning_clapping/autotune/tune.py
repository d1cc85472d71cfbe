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

from lightning_clapping.autotune.choose import Choice, choose_pipeline, describe, ladder, log_values
from lightning_clapping.autotune.messages import DIRECTIONS, UNCOMPRESSED, CodecTimes, MessageShapes, TensorSpec
from lightning_clapping.autotune.messages import message_bytes, spec_of
from lightning_clapping.autotune.probe import Group, LinkMeasure, ProbeError, codec_times, probe_boundaries
from lightning_clapping.comm.placement import Placement

#: what the strategy uses: the entry point, and what renders its result
__all__ = ["Choice", "LinkMeasure", "agree", "describe", "log_values", "tune_pipeline"]


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
    what it sends). Two collectives over ``group`` (all ranks must call): ``all_gather_object`` of these numbers,
    then ``broadcast_object_list`` of the choices that rank ``src`` computed with :func:`~.choose.choose`
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
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
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
    dist.broadcast_object_list(payload, src=src, group=group)
    status, body = payload[0]
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
) -> tuple[dict[int, Choice], dict[int, LinkMeasure]]:
    """What one pipeline rank does to autotune, between two steps (every rank at once): probe its boundaries with
    their real uncompressed message size, time the candidate codecs on the messages it sends, then :func:`agree`
    on the choices: by the step rule for ``schedules`` (the first is the one running; more: autotune may switch),
    with ``num_microbatches`` per step; without ``schedules``, by the per-message rule.

    ``placement``: this rank's stage and its replica's ranks; the agreement runs over its pipeline group, and the
    replica's last stage decides. ``sent_specs``: what this rank sent in the last step, by the executor's rule name
    (``"fwd_out"``: boundary ``stage``, ``"bwd_out"``: boundary ``stage - 1``); ``user_codecs``: the top of each
    direction's ladder (``{"fwd": "q4", "bwd": "q8"}``, None: the default ladder).
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
    measures = probe_boundaries(stage, num_stages, placement.rank_of_stage, probe_bytes, timeout=timeout)
    candidates = {d: ladder(d, user_codecs.get(d)) for d in DIRECTIONS}
    timed = {b: {d: codec_times(specs, candidates[d]) for d, specs in dirs.items()} for b, dirs in shapes.items()}
    extra = {"schedules": tuple(schedules), "num_microbatches": num_microbatches} if schedules else {}
    return agree(stage, num_stages, measures, compute_s, shapes, variant=variant, candidates=candidates,
                 group=placement.pp_group, src=placement.last_rank, codec_s=timed, **extra)
