"""Quality against bytes: every compression variant through a 4-stage pipeline on five real tasks.

    python benchmarks/quality.py             # the full comparison (3 seeds, all variants; prints its estimate)
    python benchmarks/quality.py --standard  # 3 seeds, shorter runs: about 8.5 h on 2 cores (BENCHMARKS.md's numbers)
    python benchmarks/quality.py --quick     # a few minutes on 2 cores: 1 seed, fewer steps, smaller held-out sets
    python benchmarks/quality.py --tiny      # a smoke test (seconds of training): 2 steps, 2 variants, data subsets
    options: --out DIR (default benchmarks/results), --tasks TASK... (default: all five), --seeds N,
             --steps-scale F, --val-every N (held-out points every N steps), --configs LABEL..., --resume (skip runs
             already in DIR/quality_runs.jsonl), --report-only (rebuild the report from it)

Tasks (see ``_quality_tasks.py``): Fashion-MNIST with an MLP 784-512-256-128-10 (held-out metric: accuracy on the
official test split), a character-level transformer LM on Shakespeare (d=128, 4 blocks, context 128; held-out
metric: validation loss on held-out plays) and the fine-tuning of a pretrained model, all-MiniLM-L6-v2 (transformers)
classifying WordNet noun glosses into 26 supersenses (held-out metric: accuracy on the validation split). Each model
is cut into 4 stages (``devices=4``, gloo on CPU). The first two run every configuration below; the fine-tuning task,
at about 4 minutes a run, runs the subset in ``TASK_CONFIGS`` unless ``--configs`` names others; so do the two
tasks of ``_more_tasks.py`` (a character LM on WordNet's glosses at width 96, a vision transformer on Fashion-MNIST).

Variants, each at two codec settings (forward / backward codec):

* moderate:   ``q4`` / ``q8``   (4-bit activations, 8-bit gradients, one fp32 scale per channel)
* aggressive: ``q2`` / ``q4``   (2-bit activations, 4-bit gradients)

Frontier configurations beyond that grid (``FRONTIER_CONFIGS``), aiming at >= 20x fewer bytes than uncompressed:
``clapping-fc p=0.25 topk`` (the 10 % largest values, 4-bit, both directions) and ``clapping-fu`` with random 10 % of
the values in 4 bits on reuse steps and a fresh-step codec (``fresh_codec``: q4 or q3 with fp16 scales) at p = 0.5 and
0.25; ``clapping-fc`` with low-rank factors (``lowrank:2/4/8``, both directions) at p = 0.5 and ``direct`` with
``lowrank:4``, the same codec without feedback; one bit per value (``q1`` both ways, about 30x) plain, under EF21 and
under Clapping-FC; and an opt-in model change, a trainable ``lightning_clapping.Bottleneck`` of width / 4, / 8 or / 16
at every cut (``bn4``, ``bn8``, ``bn16``), alone and with codecs on its code; and codecs scheduled over training
(``lightning_clapping.CodecScheduler``): ``q1 then moderate`` (one bit until 80 % of the steps, then q4/q8, direct and
Clapping-FC) and ``aggressive then moderate`` (q2/q4, then q4/q8 for the last quarter); and lazy sampling's p
changed halfway (``LazySamplingDataModule(p={0: p, step: p2})``): Clapping-FU with random 10 % from p = 0.5 to 0.25
and from 0.25 to 0.5, Clapping-FC q4/q8 from p = 0.5 to 1; for the fine-tuning task only (``ONLY_FOR``), a bottleneck
of width / 4, / 3 or / 2 started from the principal directions of what reaches each cut (``bn4 pca`` ...:
``lightning_clapping.fit_bottlenecks`` on the first 8 training batches; ``pca-tokens``: on their real tokens only),
alone and with codecs. Only where ``--configs`` names them (``OPT_IN_CONFIGS``): the residual bottleneck
(``Bottleneck(..., residual=True)``: a learned encoder and decoder around the same low-rank identity path, the same
code on the wire) at width / 8 alone, with q8 both ways (``bn8 residual q8``), at / 16 with q8 or q4/q8, and at / 8
with one bit per value on the code under Clapping-FC; and codes that widen as training goes (``RankScheduler``,
``bn8-to-bn2 moderate``: ``_bottleneck_variants.py``). The report draws the bytes-quality frontier of every
configuration and judges the 20x goal (within 1 point / 2 %) for each.

``uncompressed`` (no codec; plus ``uncompressed p=0.5``: lazy sampling alone, to tell the cost of reusing batches
from the cost of compressing), ``direct``, ``ef21`` (plain data, every batch fresh), ``aqsgd`` (data wrapped in
``LazySamplingDataModule(p=1)``, which only adds sample ids), ``clapping-fc`` and ``clapping-fu`` at p = 0.5 and
p = 0.25 (``LazySamplingDataModule(dm, p, seed)``). Every run of a task uses the same model initialisation per seed,
the same optimizer and schedule, and the same number of optimizer steps.

Per run it records the held-out metric every ``val_every`` steps (and at the last step), the bytes sent between
stages (sum of the logged ``clapping/bytes`` of every step: all boundaries, both directions, headers included),
samples drawn from the data (``clapping/distinct_samples``; computed from the loader for plain data), and the
error-feedback memory (``clapping/feedback_bytes``: both ends of every boundary, AQ-SGD's per-sample store included).

Outputs under ``--out``: ``quality.json`` (settings, machine, raw runs, aggregates, target verdicts),
``quality.csv`` (one row per run and one per aggregated configuration), ``quality_<task>.png`` (metric against
steps and against cumulative bytes), ``quality_frontier_<task>.png`` (final metric against the byte ratio to
uncompressed, the Pareto frontier and the 20x goal), ``quality_runs.jsonl`` (raw runs as they finish, for
``--resume``), and a printed table with the targets and the frontier.

All runs happen inside ONE launch: Lightning's launcher starts the 4 processes at the first ``fit`` (re-running this
script with the same arguments), and every rank then walks the same list of runs, so the start-up is paid once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

torch.set_num_threads(1)  # four stage processes share a small CPU

import lightning as L  # noqa: E402

import lightning_clapping  # noqa: E402
from _quality_tasks import BOTTLENECK, FITTED, P_SCHEDULED, SCHEDULED, TASKS, fit_to_data  # noqa: E402
from _more_tasks import OPT_IN_TASKS, register as register_more_tasks  # noqa: E402
from _bottleneck_variants import (OPT_IN_CONFIGS, VARIANT_BOTTLENECKS, VARIANT_CODECS, variant_callbacks,  # noqa: E402
                                  variant_model)

STAGES = 4
#: codec setting -> (forward codec, backward codec, codec of fresh-step messages or None); the first two form the
#: grid of every variant, the others only serve the frontier configurations below
CODEC_SETTINGS: dict[str, tuple[str, str, str | None]] = {
    "moderate": ("q4", "q8", None),
    "aggressive": ("q2", "q4", None),
    "topk": ("topk:0.1+q4", "topk:0.1+q4", None),
    "randk fresh-q4": ("randk:0.1+q4", "randk:0.1+q4", "q4:fp16"),
    "randk fresh-q3": ("randk:0.1+q4", "randk:0.1+q4", "q3:group128:fp16"),
    # rank-R factors in fp16 (codecs/lowrank.py), both directions: on Shakespeare's [512, 128] messages 100x / 51x /
    # 25x for R = 2 / 4 / 8; on the MLP's [32, 512..128] messages 25-30x / 13-15x / 6-8x
    "lowrank2": ("lowrank:2", "lowrank:2", None),
    "lowrank4": ("lowrank:4", "lowrank:4", None),
    "lowrank8": ("lowrank:8", "lowrank:8", None),
    # one bit per value (the sign and one fp32 mean magnitude per channel), both directions: about 30x
    "q1": ("q1", "q1", None),
    # a model change: a trainable Bottleneck (lightning_clapping.Bottleneck) of width / N at every cut, then a codec
    "bn4": (None, None, None), "bn4 q8": ("q8", "q8", None), "bn4 moderate": ("q4", "q8", None),
    "bn8": (None, None, None), "bn8 q8": ("q8", "q8", None), "bn8 moderate": ("q4", "q8", None),
    "bn16 moderate": ("q4", "q8", None),
    # the same, started with Bottleneck(init="rescaled"): each half times (width / rank) ** 0.25
    "bn8 rescaled": (None, None, None),
    "bn8 rescaled q8": ("q8", "q8", None),
    "bn16 rescaled q8": ("q8", "q8", None),
    # the same, started from the principal directions of what reaches each cut (a pretrained model's start)
    "bn3 pca": (None, None, None),
    "bn3 pca q4": ("q4", "q4", None),
    "bn3 pca-tokens q4": ("q4", "q4", None),
    "bn4 pca moderate": ("q4", "q8", None),
    "bn2 pca aggressive": ("q2", "q4", None),
    "bn3 q4": ("q4", "q4", None),
    # a schedule over training (lightning_clapping.CodecScheduler): these codecs first, then SCHEDULED's
    "q1 then moderate": ("q1", "q1", None),
    "aggressive then moderate": ("q2", "q4", None),
}
# lazy sampling's p scheduled over training (P_SCHEDULED in _quality_tasks): the codecs of the setting each one holds
CODEC_SETTINGS.update({name: CODEC_SETTINGS[held] for name, (held, _, _) in P_SCHEDULED.items()})
CODEC_SETTINGS.update(VARIANT_CODECS)  # the bottleneck's residual and widening variants (_bottleneck_variants.py)
BOTTLENECK.update(VARIANT_BOTTLENECKS)
GRID_SETTINGS = ("moderate", "aggressive")
SMALL_P = 0.25

def config_label(variant: str, p: float, setting: str | None) -> str:
    label = f"{variant} p={p:g}" if variant.startswith("clapping") or p < 1 else variant
    return label if setting is None else f"{label} {setting}"


#: the compression frontier beyond the grid: (variant, p, codec setting), aiming at >= 20x fewer bytes than
#: uncompressed within 1 point / 2 %. Clapping-FU sends fresh steps with the fresh codec (q3/q4 with fp16
#: scales, about 7-10x) and reuse steps as 10 % random values in 4 bits (about 80x): about 13x at p = 0.5 with q4,
#: 17x with q3, 22x at p = 0.25 with q4. Clapping-FC sends every step as the 10 % largest values in 4 bits (16-18x).
FRONTIER_CONFIGS: list[tuple[str, float, str]] = [
    ("clapping-fc", SMALL_P, "topk"),
    ("clapping-fu", 0.5, "randk fresh-q4"),
    ("clapping-fu", 0.5, "randk fresh-q3"),
    ("clapping-fu", SMALL_P, "randk fresh-q4"),
    # low-rank factors under Clapping-FC's error feedback, and the same codec without feedback (direct)
    ("clapping-fc", 0.5, "lowrank2"),
    ("clapping-fc", 0.5, "lowrank4"),
    ("clapping-fc", 0.5, "lowrank8"),
    ("direct", 1.0, "lowrank4"),
    # one bit per value, about 30x: plain, with EF21's feedback, and under Clapping-FC
    ("direct", 1.0, "q1"),
    ("ef21", 1.0, "q1"),
    ("clapping-fc", 0.5, "q1"),
    # the opt-in boundary bottleneck (a model change): alone (8x), then with codecs on its code
    ("uncompressed", 1.0, "bn4"),
    ("direct", 1.0, "bn4 q8"),
    ("direct", 1.0, "bn4 moderate"),
    ("uncompressed", 1.0, "bn8"),
    ("direct", 1.0, "bn8 q8"),
    ("direct", 1.0, "bn8 moderate"),
    ("clapping-fc", 0.5, "bn8 moderate"),
    ("direct", 1.0, "bn16 moderate"),
    # the same model change started so that an even input keeps its energy (Bottleneck(init="rescaled"))
    ("uncompressed", 1.0, "bn8 rescaled"),
    ("direct", 1.0, "bn8 rescaled q8"),
    ("direct", 1.0, "bn16 rescaled q8"),
    # coarse while the loss falls fast, q4/q8 for the last fifth / quarter of the steps
    ("direct", 1.0, "q1 then moderate"),
    ("clapping-fc", 0.5, "q1 then moderate"),
    ("clapping-fc", 0.5, "aggressive then moderate"),
    # lazy sampling's p changed halfway: Clapping-FU reusing more in the second half or in the first (coarse first),
    # at about the same bytes; Clapping-FC drawing only fresh batches in the second half (the same bytes as p=0.5)
    ("clapping-fu", 0.5, "randk fresh-q4 then p=0.25"),
    ("clapping-fu", SMALL_P, "randk fresh-q4 then p=0.5"),
    ("clapping-fc", 0.5, "moderate then p=1"),
]
#: frontier configurations that only the fine-tuning task runs: a bottleneck started from the principal directions of
#: what reaches each cut of the pretrained model, q4/q8 on 96 of 384 values (about 21x), alone and with q4 both ways on
#: 128 (about 24x), q2/q4 on 192 (21x); the 128-wide one with q4 started as the random projection, the control
#: that tells the start from the width; and the 128-wide one with q4 fitted on the real tokens only (not the padding)
FINE_TUNING_CONFIGS: list[tuple[str, float, str]] = [
    ("direct", 1.0, "bn4 pca moderate"),
    ("uncompressed", 1.0, "bn3 pca"),
    ("direct", 1.0, "bn3 pca q4"),
    ("direct", 1.0, "bn2 pca aggressive"),
    ("direct", 1.0, "bn3 q4"),
    ("direct", 1.0, "bn3 pca-tokens q4"),
]
FRONTIER_CONFIGS += FINE_TUNING_CONFIGS
FRONTIER_CONFIGS += OPT_IN_CONFIGS  # run only where --configs names them (_bottleneck_variants.py)
OPT_IN = {config_label(*config) for config in OPT_IN_CONFIGS}
#: configuration label -> the only task that runs it
ONLY_FOR: dict[str, str] = {config_label(*config): "wordnet_minilm" for config in FINE_TUNING_CONFIGS}

#: the configurations the fine-tuning task runs when a mode runs all (``--configs`` unset): the reference, lazy
#: sampling alone, the mild codecs plain and under Clapping-FC, one bit per value plain and under Clapping-FC, the
#: bottleneck with q8 on its code, and Clapping-FU's random 10 % (the other tasks run every configuration)
TASK_CONFIGS: dict[str, list[str]] = {
    "wordnet_minilm": ["uncompressed", "uncompressed p=0.5", "direct moderate", "clapping-fc p=0.5 moderate",
                       "direct q1", "clapping-fc p=0.5 q1", "direct bn8 q8", "clapping-fu p=0.5 randk fresh-q4",
                       *ONLY_FOR],
}

#: per mode: seeds, runs (None: all), and per task steps, validation interval, train/eval subsets
MODES: dict[str, dict] = {
    "tiny": {
        "seeds": 1,
        "configs": ["uncompressed", "clapping-fc p=0.5 moderate", "clapping-fu p=0.5 randk fresh-q3"],
        "tasks": {
            "fashion_mnist": {"steps": 2, "val_every": 2, "limit": 512, "eval_samples": 500},
            "shakespeare": {"steps": 2, "val_every": 2, "limit": 128, "eval_samples": 64},
            "wordnet_minilm": {"steps": 2, "val_every": 2, "limit": 256, "eval_samples": 64},
        },
    },
    "quick": {
        "seeds": 1,
        "configs": None,
        "tasks": {
            "fashion_mnist": {"steps": 120, "val_every": 40, "limit": None, "eval_samples": 2000},
            "shakespeare": {"steps": 40, "val_every": 20, "limit": None, "eval_samples": 128},
            "wordnet_minilm": {"steps": 40, "val_every": 20, "limit": None, "eval_samples": 256},
        },
    },
    # what BENCHMARKS.md reports: 3 seeds and every variant, with runs short enough for about 50 min on 2 cores
    "standard": {
        "seeds": 3,
        "configs": None,
        "tasks": {
            # 430 steps = one epoch of Fashion-MNIST at p = 1
            "fashion_mnist": {"steps": 430, "val_every": 86, "limit": None, "eval_samples": None},
            "shakespeare": {"steps": 120, "val_every": 30, "limit": None, "eval_samples": 256},
            # 200 steps of 32 glosses: a short fine-tuning run
            "wordnet_minilm": {"steps": 200, "val_every": 50, "limit": None, "eval_samples": 1024},
        },
    },
    "full": {
        "seeds": 3,
        "configs": None,
        "tasks": {
            # 860 steps = 2 epochs of Fashion-MNIST (AQ-SGD compresses from its second visit of a sample on)
            "fashion_mnist": {"steps": 860, "val_every": 86, "limit": None, "eval_samples": None},
            "shakespeare": {"steps": 600, "val_every": 60, "limit": None, "eval_samples": 512},
            "wordnet_minilm": {"steps": 600, "val_every": 100, "limit": None, "eval_samples": None},
        },
    },
}

#: rough seconds per training step and per held-out sample seen on the 2-core development machine (4 stage processes,
#: other jobs running at the same time), only for the estimate printed at the start; the ETA after each run is measured
STEP_SECONDS = {"fashion_mnist": 0.11, "shakespeare": 0.5, "wordnet_minilm": 0.8}
EVAL_SECONDS = {"fashion_mnist": 0.0002, "shakespeare": 0.006, "wordnet_minilm": 0.004}
register_more_tasks(TASKS, MODES, STEP_SECONDS, EVAL_SECONDS, TASK_CONFIGS)  # wordnet_glosses, fashion_vit
RUN_OVERHEAD_S = 3.0


@dataclass
class RunConfig:
    task: str
    variant: str
    p: float
    setting: str | None  # codec setting name, None for uncompressed
    seed: int
    steps: int
    val_every: int
    limit: int | None
    eval_samples: int | None
    lazy: bool  # wrap the data in LazySamplingDataModule
    fwd: str | None = None
    bwd: str | None = None
    fresh: str | None = None  # codec of fresh-step messages (None: the variant's default)
    mode: str = "full"
    label: str = ""
    key: str = field(default="")

    def __post_init__(self) -> None:
        if self.setting is not None:
            self.fwd, self.bwd, self.fresh = CODEC_SETTINGS[self.setting]
        self.label = config_label(self.variant, self.p, self.setting)
        self.key = (f"{self.mode}|{self.task}|{self.label}|seed={self.seed}|steps={self.steps}|"
                    f"limit={self.limit}|eval={self.eval_samples}")


def all_configs() -> list[tuple[str, float, str | None, bool]]:
    """(variant, p, codec setting, lazy wrapper) in table order.

    ``uncompressed p=0.5`` is lazy sampling without compression: it separates what reusing batches costs (fewer
    fresh samples in the same steps) from what compressing costs.
    """
    out: list[tuple[str, float, str | None, bool]] = [("uncompressed", 1.0, None, False),
                                                     ("uncompressed", 0.5, None, True)]
    for setting in GRID_SETTINGS:
        out += [("direct", 1.0, setting, False), ("ef21", 1.0, setting, False), ("aqsgd", 1.0, setting, True)]
        for variant in ("clapping-fc", "clapping-fu"):
            for p in (0.5, SMALL_P):
                out.append((variant, p, setting, True))
    out += [(variant, p, setting, variant.startswith("clapping") or variant == "aqsgd")
            for variant, p, setting in FRONTIER_CONFIGS]
    return out


def build_plan(args: argparse.Namespace) -> list[RunConfig]:
    """The same list on every rank: seeds outermost, so a stopped run still has every variant of the first seeds."""
    mode = MODES[args.mode]
    seeds = args.seeds if args.seeds is not None else mode["seeds"]
    wanted = mode["configs"] if args.configs is None else args.configs
    plan = []
    for seed in range(seeds):
        for task in args.tasks:
            t = dict(mode["tasks"][task])
            if args.steps_scale != 1.0:
                t["val_every"] = max(1, round(t["val_every"] * args.steps_scale))
                t["steps"] = max(t["val_every"], round(t["steps"] * args.steps_scale / t["val_every"]) * t["val_every"])
            if args.val_every is not None:  # held-out points every N steps; the last step still validated
                t["val_every"] = args.val_every
                t["steps"] = max(args.val_every, round(t["steps"] / args.val_every) * args.val_every)
            task_wanted = TASK_CONFIGS.get(task) if wanted is None else wanted
            for variant, p, setting, lazy in all_configs():
                label = config_label(variant, p, setting)
                if task_wanted is not None and label not in task_wanted or ONLY_FOR.get(label, task) != task:
                    continue
                if wanted is None and label in OPT_IN:
                    continue
                plan.append(RunConfig(task=task, variant=variant, p=p, setting=setting, seed=seed, lazy=lazy,
                                      mode=args.mode, **t))
    return plan


def estimate_seconds(plan: list[RunConfig]) -> float:
    total = 0.0
    for cfg in plan:
        evals = cfg.steps // cfg.val_every
        n_eval = cfg.eval_samples or {"fashion_mnist": 10000, "wordnet_minilm": 8212}.get(cfg.task, 3138)
        total += RUN_OVERHEAD_S + cfg.steps * STEP_SECONDS[cfg.task] + evals * n_eval * EVAL_SECONDS[cfg.task]
    return total


# --------------------------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------------------------


class Recorder(L.Callback):
    """Reads the strategy's per-step numbers from ``trainer.callback_metrics`` (they describe the previous step) and
    its exact sums from ``trainer.strategy.byte_totals``."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.cum_bytes = 0.0
        self.steps = 0
        self.drawn: float | None = None
        self.feedback: list[float] = []
        self.fresh = 0
        self.train_loss: list[float] = []
        self.curve: list[dict] = []
        self._since_val = 0  # index into train_loss where the current validation interval began
        self.t0 = self.t_fit = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.steps += 1
        self.cum_bytes = trainer.strategy.byte_totals["bytes"]  # every step so far, this one included
        if "clapping/feedback_bytes" in m:  # describes the previous step (none at the first)
            self.feedback.append(float(m["clapping/feedback_bytes"]))
        if "clapping/distinct_samples" in m:
            self.drawn = float(m["clapping/distinct_samples"])
        self.fresh = int(trainer.strategy.byte_totals["fresh_steps"])
        self.train_loss.append(float(m["train_loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        window, self._since_val = self.train_loss[self._since_val:], len(self.train_loss)
        self.curve.append({
            "step": int(trainer.global_step),
            "metric": float(m[self.metric]),
            "val_loss": float(m["val_loss"]),
            "cum_bytes": self.cum_bytes,
            "train_loss": sum(window) / len(window) if window else float("nan"),
            "samples_drawn": self.drawn,
        })

    def on_train_end(self, trainer, pl_module) -> None:
        self.t_fit = time.perf_counter() - self.t0
        totals = trainer.strategy.byte_totals  # now including the last step
        self.cum_bytes, self.fresh = totals["bytes"], int(totals["fresh_steps"])


def samples_drawn_plain(steps: int, n: int, batch: int) -> int:
    """Samples a plain shuffled loader (no drop_last) has yielded after ``steps`` batches."""
    per_epoch = -(-n // batch)
    epochs, rest = divmod(steps, per_epoch)
    return epochs * n + min(rest * batch, n)


def scheduler(cfg: RunConfig) -> list[lightning_clapping.CodecScheduler]:
    """The codec schedule of a scheduled setting (none otherwise): its second codecs from that fraction of the steps."""
    if cfg.setting not in SCHEDULED:
        return []
    fraction, pair = SCHEDULED[cfg.setting]
    return [lightning_clapping.CodecScheduler({round(fraction * cfg.steps): pair})]


def run_one(cfg: RunConfig, timeout_min: float) -> dict | None:
    """One ``Trainer.fit`` on every rank; returns the record on rank 0, None elsewhere."""
    task = TASKS[cfg.task]
    L.seed_everything(cfg.seed, verbose=False)  # same initial weights and batch order for every variant of a seed
    dm = task.make_data(cfg.seed, cfg.limit, cfg.eval_samples, task.batch_size)
    dm.setup("fit")
    model, split_points = task.make_model(dm), task.split_points
    if cfg.setting in BOTTLENECK:
        model, split_points = task.add_bottlenecks(model, *BOTTLENECK[cfg.setting])
        variant_model(cfg.setting, model, cfg.task)
        if BOTTLENECK[cfg.setting][1] in FITTED:
            fit_to_data(task, model, dm, BOTTLENECK[cfg.setting][1])
    p: float | dict[int, float] = cfg.p
    if cfg.setting in P_SCHEDULED:
        _, fraction, later = P_SCHEDULED[cfg.setting]
        # loader steps: optimizer steps here (no accumulation); the first p holds for at least one step
        p = {0: cfg.p, max(1, round(fraction * cfg.steps)): later}
    data = lightning_clapping.LazySamplingDataModule(dm, p=p, seed=cfg.seed) if cfg.lazy else dm
    strategy = lightning_clapping.ClappingStrategy(
        split_points=split_points, microbatches=task.microbatches, variant=cfg.variant,
        forward_codec=cfg.fwd or "identity", backward_codec=cfg.bwd or "identity", fresh_codec=cfg.fresh,
        timeout=timedelta(minutes=timeout_min))
    recorder = Recorder(task.metric)
    trainer = L.Trainer(
        accelerator="cpu", devices=STAGES, strategy=strategy, max_steps=cfg.steps,
        val_check_interval=cfg.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        gradient_clip_val=task.gradient_clip_val, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder] + scheduler(cfg) + variant_callbacks(cfg.setting, model, cfg.steps))
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return None
    n_train = len(dm.dataset("train"))
    plain_drawn = samples_drawn_plain(recorder.steps, n_train, task.batch_size)
    drawn = recorder.drawn if recorder.drawn is not None else plain_drawn
    for point in recorder.curve:
        if point["samples_drawn"] is None:
            point["samples_drawn"] = samples_drawn_plain(point["step"], n_train, task.batch_size)
    if not recorder.curve or recorder.curve[-1]["step"] != recorder.steps:
        raise RuntimeError(f"{cfg.key}: no held-out evaluation at the last step ({recorder.steps})")
    after_first = recorder.feedback[1:] or recorder.feedback
    return {
        **asdict(cfg),
        "steps_done": recorder.steps,
        "final_metric": recorder.curve[-1]["metric"],
        "final_val_loss": recorder.curve[-1]["val_loss"],
        "total_bytes": recorder.cum_bytes,
        "samples_drawn": drawn,
        "samples_drawn_plain_check": plain_drawn,
        "train_size": n_train,
        "fresh_steps": recorder.fresh,
        "feedback_bytes_final": recorder.feedback[-1] if recorder.feedback else 0.0,
        "feedback_bytes_min": min(after_first) if after_first else 0.0,
        "feedback_bytes_max": max(recorder.feedback) if recorder.feedback else 0.0,
        "curve": recorder.curve,
        "fit_seconds": recorder.t_fit,
        "wall_seconds": wall,
    }


# --------------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------------


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_clapping"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*num_workers.*")
    warnings.filterwarnings("ignore", message=".*LazySampling.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="mode")
    size.add_argument("--tiny", action="store_const", const="tiny", dest="mode")
    size.add_argument("--standard", action="store_const", const="standard", dest="mode",
                      help="3 seeds, shorter runs than the full mode (what BENCHMARKS.md reports; ~50 min here)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tasks", nargs="+", default=[t for t in TASKS if t not in OPT_IN_TASKS], choices=list(TASKS))
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 3 full/standard, 1 quick/tiny)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="run only these configurations, by label (e.g. uncompressed 'clapping-fu p=0.5 moderate')")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="scale every task's step count")
    ap.add_argument("--val-every", type=int, default=None,
                    help="validate every N steps in every task (after --steps-scale; the step count is rounded to "
                         "a multiple of N)")
    ap.add_argument("--resume", action="store_true", help="skip runs already in OUT/quality_runs.jsonl")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the report from OUT/quality_runs.jsonl")
    ap.add_argument("--timeout-min", type=float, default=5.0, help="a stage waiting longer for a peer fails")
    ap.set_defaults(mode="full")
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    return args


def meta(args: argparse.Namespace) -> dict:
    return {
        "mode_settings": MODES[args.mode],
        "steps_scale": args.steps_scale,
        "codec_settings": {k: {"forward": f, "backward": b, "fresh": fr} for k, (f, b, fr) in CODEC_SETTINGS.items()},
        "scheduled_settings": {k: {"after_fraction": f, "forward": a, "backward": b} for k, (f, (a, b)) in
                               SCHEDULED.items()},
        "p_scheduled_settings": {k: {"from_fraction": f, "p": p} for k, (_, f, p) in P_SCHEDULED.items()},
        "grid_settings": list(GRID_SETTINGS),
        "frontier_configs": [config_label(v, p, st) for v, p, st in FRONTIER_CONFIGS],
        "lazy_sampling_p": [0.5, SMALL_P],
        "stages": STAGES,
        "config_order": [config_label(v, p, st) for v, p, st, _ in all_configs()],
        "optimizers": {"fashion_mnist": "Adam lr 1e-3", "shakespeare": "AdamW lr 1e-3, wd 0.01, 20-step warmup, "
                       "gradient clipping 1.0", "wordnet_minilm": "AdamW lr 1e-4 (pretrained encoder, dropout off)"},
    }


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by an interrupted run
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    from _quality_report import report  # matplotlib only where it is needed

    # the process the user started (it becomes rank 0 at the first fit); under torchrun/SLURM: local rank 0, node 0
    launcher = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    runs_file = args.out / "quality_runs.jsonl"
    missing = {name: TASKS[name].missing() for name in args.tasks}
    skipped = {name: why for name, why in missing.items() if why}
    args.tasks = [name for name in args.tasks if not missing[name]]
    if launcher:
        for name, why in skipped.items():
            print(f"[quality] skipping {name}: {why}", flush=True)
    if args.report_only:
        report(read_jsonl(runs_file), args, skipped, meta(args))
        return 0
    if not args.tasks:
        print("[quality] no task has its data here; nothing to run", flush=True)
        return 0
    plan = build_plan(args)
    done = read_jsonl(runs_file) if args.resume else []
    done_keys = {r["key"] for r in done}
    todo = [cfg for cfg in plan if cfg.key not in done_keys]
    if launcher:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            runs_file.write_text("")
        est = estimate_seconds(todo)
        print(f"[quality] mode {args.mode}: {len(todo)} runs ({len(plan) - len(todo)} resumed) over "
              f"{', '.join(args.tasks)}; rough estimate {est / 60:.0f} min (at the step times of a busy 2-core "
              f"machine; this one has {os.cpu_count()} logical CPUs), then an ETA after every run", flush=True)
    records: list[dict] = [r for r in done if r["key"] in {c.key for c in plan}]
    started = time.perf_counter()
    rank0 = True
    for i, cfg in enumerate(todo):
        record = run_one(cfg, args.timeout_min)
        rank0 = record is not None
        if not rank0:
            continue
        records.append(record)
        with runs_file.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        elapsed = time.perf_counter() - started
        left = estimate_seconds(todo[i + 1:]) * elapsed / max(estimate_seconds(todo[: i + 1]), 1e-9)
        print(f"[quality] {i + 1}/{len(todo)} {cfg.task} {cfg.label} seed {cfg.seed}: "
              f"{TASKS[cfg.task].metric} {record['final_metric']:.4f}, {record['total_bytes'] / 2**20:.1f} MiB sent, "
              f"{record['wall_seconds']:.1f}s (ETA {left / 60:.1f} min)", flush=True)
    if rank0:
        report(records, args, skipped, meta(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
