"""Which rule each message gets: the options' codecs, until autotune chooses per boundary and direction.

With ``autotune=True`` the links are measured after the second training step (:mod:`lightning_clapping.autotune.tune`),
rank 0 decides, and every rank rebuilds its training rules from the choice (and, with ``schedule="auto"``, switches
schedule) before the next step. The choice is kept for the rest of the run, saved in checkpoints, and adopted again
when a run resumes, so that the saved error-feedback buffers fit the rules.

A codec schedule (:class:`~lightning_clapping.CodecScheduler`, through ``ClappingStrategy.set_codecs``) replaces the
options' codecs of the training messages between two steps; the codecs in force are saved and adopted the same way.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_clapping.autotune import tune as autotune
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import MessageRule
from lightning_clapping.comm import safe_objects
from lightning_clapping.comm.placement import Placement
from lightning_clapping.data import find_lazy_loader
from lightning_clapping.options import ClappingOptions
from lightning_clapping.comm.step_stats import StepStats
from lightning_clapping.pipeline.executor import PipelineExecutor
from lightning_clapping.pipeline.schedule import SCHEDULES, get_schedule

TUNE_AFTER_STEPS = 2  # the first step builds the buffers and announces the shapes; the second is a steady one


def schedulable(options: ClappingOptions) -> bool:
    """Whether a codec schedule may change the run's codecs: a compressed variant whose codecs autotune does not
    choose."""
    return options.variant != "uncompressed" and not options.autotune


def check_schedulable(options: ClappingOptions) -> None:
    """Refuse a codec schedule (``CodecScheduler``, ``set_codecs``) where :func:`schedulable` says no."""
    if not schedulable(options):
        raise ValueError(
            "a codec schedule (CodecScheduler, ClappingStrategy.set_codecs) changes the codecs of a compressed variant "
            f"that autotune does not choose; this run has variant={options.variant!r}, autotune="
            f"{bool(options.autotune)}: pass variant='clapping-fc' (or another compressed variant) and leave autotune "
            "off, or drop the schedule")


class Tuning:
    """The message rules of a run and autotune's choice of them (kept across the Trainer's runs, like the options).

    ``choices`` is ``{boundary: autotune.Choice}`` once decided (``None`` before); ``schedule`` is the schedule that
    runs (autotune may change it under ``schedule="auto"``).
    """

    def __init__(self, options: ClappingOptions) -> None:
        self.options = options
        self.choices: dict[int, Any] | None = None
        self.codecs: dict[str, Any] | None = None  # {"fwd": Codec, "bwd": Codec} of a codec schedule, else None
        self.schedule = options.schedule
        self.train_steps = 0

    def make_rule(self, boundary: int, direction: str, training: bool) -> MessageRule:
        """The encoder/decoder of one boundary and direction (both ends build the same one)."""
        o = self.options
        codec = o.forward_codec if direction == "fwd" else o.backward_codec
        if isinstance(codec, dict):
            codec = codec.get(boundary)
        fresh = o.fresh_codec
        if training and self.choices is not None and boundary in self.choices:
            variant, codec = self.choices[boundary].rule(direction)
            fresh = self.choices[boundary].fresh_codec(direction, o.fresh_codec)  # what autotune priced
            if variant == "uncompressed":
                codec = "identity"
        elif codec is None:  # a boundary the user left uncompressed
            variant, codec = "uncompressed", "identity"
        elif not training:
            variant = "direct" if o.compress_eval else "uncompressed"
        else:
            variant = o.variant
            codec = self.codecs[direction] if self.codecs is not None else codec
        return MessageRule(variant, codec, boundary, direction, warm_start=o.warm_start,
                           store_dtype=o.sample_store_dtype, lazy_threshold=o.lazy_messages,
                           max_skips=o.max_skips, fresh_codec=fresh)

    def after_train_step(self, stats: StepStats, num_microbatches: int, executor: PipelineExecutor,
                         placement: Placement, module: pl.LightningModule) -> None:
        """Count the step; after the second one, run autotune (if asked and not decided yet)."""
        self.train_steps += 1
        if (self.options.autotune and self.choices is None and self.train_steps == TUNE_AFTER_STEPS
                and placement.num_stages > 1):
            self._run(executor, placement, module, stats.compute_s / num_microbatches, num_microbatches)

    def _run(self, executor: PipelineExecutor, placement: Placement, module: pl.LightningModule, compute_s: float,
             num_microbatches: int) -> None:
        """Probe the links, decide on rank 0, rebuild the training rules on every rank (between two steps)."""
        o, trainer, tune = self.options, module.trainer, self.options.autotune_settings
        lazy = find_lazy_loader(trainer)
        batches = trainer.estimated_stepping_batches * trainer.accumulate_grad_batches  # the whole run's
        # a schedule of p: the mean p over the run's remaining loader steps (the share of fresh steps to price); the
        # published quality (frontier rule) covers a fixed p, so it applies only where that mean is one of its p
        p = 1.0 if lazy is None else lazy.mean_p(lazy.step, batches)
        first = autotune.first_visit_fraction(  # batches: this run's so far, an epoch's, the whole run's
            p, self.train_steps, trainer.num_training_batches, batches) if o.variant == "aqsgd" else 0.0
        choices, every = autotune.tune_pipeline(
            placement, executor.sent_specs, compute_s, o.variant, {"fwd": o.forward_codec, "bwd": o.backward_codec},
            timeout=o.timeout, schedules=self.schedule_candidates(), num_microbatches=num_microbatches,
            fresh_codec=o.fresh_codec, p=p, first_visits=first, frontier=tune.quality if tune.frontier else None,
            tolerance=tune.step_tolerance)
        if placement.num_replicas > 1:  # every replica probed its own links; all follow replica 0's choice
            wires = safe_objects.broadcast([c.to_wire() for c in choices.values()], 0)
            choices = {w[0]: autotune.Choice.from_wire(w) for w in wires}
        self.adopt(choices, executor)
        rank_zero_info("ClappingStrategy autotune (kept for the rest of the run):\n"
                       + autotune.describe(choices, every))
        for name, value in autotune.log_values(choices, every).items():
            pl.LightningModule.log(module, name, value, on_step=True, on_epoch=False)

    def schedule_candidates(self) -> tuple[str, ...]:
        """The schedules autotune prices: the running one first (kept unless another is clearly faster)."""
        if not self.options.schedule_auto:
            return (self.schedule,)
        return (self.schedule, *(s for s in SCHEDULES if s != self.schedule))

    def adopt(self, choices: dict[int, Any], executor: PipelineExecutor) -> None:
        """Use autotune's choice from the next step on: its codecs, and with ``schedule="auto"`` its schedule."""
        self.choices = choices
        executor.rebuild_rules(training_only=True)
        chosen = next(iter(choices.values())).schedule if choices else ""
        if self.options.schedule_auto and chosen and chosen != self.schedule:
            self.schedule = chosen
            executor.schedule_fn = get_schedule(chosen)

    def set_codecs(self, forward: Any, backward: Any, executor: PipelineExecutor | None) -> None:
        """The training messages' codecs from the next step on, on every boundary the options compress (every rank
        between the same two steps: the rebuilt rules start with empty feedback buffers at both ends)."""
        check_schedulable(self.options)
        codecs = {"fwd": get_codec(forward), "bwd": get_codec(backward)}
        same = self._in_force() == [codecs["fwd"].name, codecs["bwd"].name]
        self.codecs = codecs
        if executor is not None and not same:  # the same codecs keep their rules and buffers
            executor.rebuild_rules(training_only=True)

    def _in_force(self) -> list[str] | None:
        """The names of the training codecs in force, if one pair holds on every compressed boundary."""
        if self.codecs is not None:
            return self.codecs_wire()
        fwd, bwd = self.options.forward_codec, self.options.backward_codec
        return None if isinstance(fwd, dict) or isinstance(bwd, dict) else [getattr(fwd, "name", None),
                                                                           getattr(bwd, "name", None)]

    def codecs_wire(self) -> list[str] | None:
        """The scheduled codecs' names as a checkpoint keeps them (``None``: the options' codecs)."""
        return None if self.codecs is None else [self.codecs["fwd"].name, self.codecs["bwd"].name]

    def to_wire(self) -> list[Any] | None:
        """The choice as a checkpoint keeps it (``None`` before autotune decided)."""
        return [c.to_wire() for c in self.choices.values()] if self.choices else None

    def restore(self, wire: list[Any] | None, executor: PipelineExecutor, codecs: list[str] | None = None) -> None:
        """A resumed run adopts the saved run's choice and scheduled codecs, so that its error-feedback buffers fit
        the rules."""
        if codecs and schedulable(self.options):
            self.set_codecs(codecs[0], codecs[1], executor)
        elif not codecs and self.codecs is not None:  # saved with the options' codecs (before a switch)
            self.codecs = None
            executor.rebuild_rules(training_only=True)
        if self.options.autotune and wire:
            self.adopt({w[0]: autotune.Choice.from_wire(w) for w in wire}, executor)
