"""Replica sync modes against every-step averaging: held-out quality and everything a rank sends.

    python benchmarks/replica_sync.py [--tasks fashion_mnist shakespeare] [--seeds 3] [--steps-scale 1.0]
                                      [--configs LABEL ...] [--out benchmarks/results] [--tiny]

Each task's model (``_quality_tasks.py``: the MLP on Fashion-MNIST, the character transformer on Shakespeare, the
pretrained MiniLM fine-tuned on WordNet supersenses; ``_tied_task.py``: ``shakespeare_tied``, the character
transformer with its token embedding and output head tied, one tensor on the first and the last stage) is cut into 2
stages and replicated twice (4 processes, gloo on CPU, one launch for every run); each replica trains on its own half
of the data with the task's batch size, so one optimizer step sees twice the batch of one replica. Every
configuration of a seed starts from the same weights.
Per run: the held-out metric at the last step (a sync step of every DiLoCo setting: the steps are a multiple of 16),
and ``trainer.strategy.byte_totals`` after ``fit``: everything a replica's ranks sent (pipeline messages, the
replica sync, the sum of a tied tensor's gradients between its stages), per optimizer step, against uncompressed
every-step training (``raw_bytes``); the tied sum apart as ``tied_per_step`` (sent) and ``tied_raw_per_step`` (the same
in fp32, uncompressed). LAG's skip rate is ``1 - (replica bytes - flags) / gradient bytes``.

The configurations ending in ``+ tied <codec>`` set ``tied_codec=``: they are meant for ``shakespeare_tied`` (on a
model without tied weights they are the configuration without it).

Saves OUT/replica_sync.json (settings, raw runs, means over seeds) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import lightning_clapping  # noqa: E402
from lightning_clapping import LAG, DiLoCo  # noqa: E402
import _table  # noqa: E402
from _quality_tasks import TASKS as QUALITY_TASKS  # noqa: E402
from _tied_task import TIED_TASKS  # noqa: E402
from quality import Recorder, quiet  # noqa: E402

TASKS = {**QUALITY_TASKS, **TIED_TASKS}
SPARSE = "topk:0.05+q4"  # the 5 % largest of each tensor in 4 bits with their positions: 23.7x on a 32k x 256 tensor
FC_Q4Q8 = {"variant": "clapping-fc", "forward_codec": "q4", "backward_codec": "q8"}  # Clapping-FC on the pipeline
#: label -> ClappingStrategy arguments
CONFIGS: dict[str, dict] = {
    "every-step": {},
    "lag": {"replica_sync": "lag"},
    "lag, reference=average": {"replica_sync": LAG(reference="average")},
    "diloco H=8": {"replica_sync": DiLoCo(inner_steps=8)},
    "diloco H=8 avg": {"replica_sync": DiLoCo(inner_steps=8, outer_lr=1.0, momentum=0.0)},  # plain model averaging
    "diloco H=16": {"replica_sync": DiLoCo(inner_steps=16)},
    "diloco H=16 avg": {"replica_sync": DiLoCo(inner_steps=16, outer_lr=1.0, momentum=0.0)},
    "diloco H=8 q4": {"replica_sync": DiLoCo(inner_steps=8, codec="q4")},
    "diloco H=16 q4": {"replica_sync": DiLoCo(inner_steps=16, codec="q4")},
    "diloco H=16 avg q4": {"replica_sync": DiLoCo(inner_steps=16, outer_lr=1.0, momentum=0.0, codec="q4")},
    f"diloco H=8 {SPARSE}": {"replica_sync": DiLoCo(inner_steps=8, codec=SPARSE)},
    f"diloco H=16 {SPARSE}": {"replica_sync": DiLoCo(inner_steps=16, codec=SPARSE)},
    "clapping-fc q4/q8 + diloco H=16 q4": {"replica_sync": DiLoCo(inner_steps=16, codec="q4"), **FC_Q4Q8},
    f"clapping-fc q4/q8 + diloco H=8 {SPARSE}": {"replica_sync": DiLoCo(inner_steps=8, codec=SPARSE), **FC_Q4Q8},
    # the sum of the tied copies' gradients compressed (shakespeare_tied): alone, under DiLoCo, under DiLoCo and
    # Clapping-FC (the settings whose bytes benchmarks/bytes_by_kind.py measures on a tied Llama)
    "every-step + tied q4": {"tied_codec": "q4"},
    "diloco H=16 q4 + tied q4": {"replica_sync": DiLoCo(inner_steps=16, codec="q4"), "tied_codec": "q4"},
    f"diloco H=16 q4 + tied {SPARSE}": {"replica_sync": DiLoCo(inner_steps=16, codec="q4"), "tied_codec": SPARSE},
    "clapping-fc q4/q8 + diloco H=16 q4 + tied q4": {
        "replica_sync": DiLoCo(inner_steps=16, codec="q4"), **FC_Q4Q8, "tied_codec": "q4"},
    f"clapping-fc q4/q8 + diloco H=16 q4 + tied {SPARSE}": {
        "replica_sync": DiLoCo(inner_steps=16, codec="q4"), **FC_Q4Q8, "tied_codec": SPARSE},
    "clapping-fc q4/q8 + diloco H=16 avg q4": {
        "replica_sync": DiLoCo(inner_steps=16, outer_lr=1.0, momentum=0.0, codec="q4"), **FC_Q4Q8},
    # shorter intervals, for the fine-tuning task (where H=16 loses 2 points in 64 steps)
    "clapping-fc q4/q8 + diloco H=8 avg q4": {
        "replica_sync": DiLoCo(inner_steps=8, outer_lr=1.0, momentum=0.0, codec="q4"), **FC_Q4Q8},
    "clapping-fc q4/q8 + diloco H=4 avg q4": {
        "replica_sync": DiLoCo(inner_steps=4, outer_lr=1.0, momentum=0.0, codec="q4"), **FC_Q4Q8},
    # the same two with plain averaging as the outer step (what holds on shakespeare_tied)
    "clapping-fc q4/q8 + diloco H=16 avg q4 + tied q4": {
        "replica_sync": DiLoCo(inner_steps=16, outer_lr=1.0, momentum=0.0, codec="q4"), **FC_Q4Q8,
        "tied_codec": "q4"},
    f"clapping-fc q4/q8 + diloco H=16 avg q4 + tied {SPARSE}": {
        "replica_sync": DiLoCo(inner_steps=16, outer_lr=1.0, momentum=0.0, codec="q4"), **FC_Q4Q8,
        "tied_codec": SPARSE},
}
SPLITS = {"fashion_mnist": ["net.4"], "shakespeare": ["blocks.2"], "wordnet_minilm": ["encoder.encoder.layer.3"],
          "shakespeare_tied": ["blocks.2"], "shakespeare_untied_twin": ["blocks.2"]}
STEPS = {"fashion_mnist": 224, "shakespeare": 128, "wordnet_minilm": 64, "shakespeare_tied": 128,
         "shakespeare_untied_twin": 128}  # multiples of 16
TINY = {"steps": 16, "limit": 256, "eval_samples": 64}


@dataclass
class Run:
    task: str
    config: str
    seed: int
    steps: int
    limit: int | None
    eval_samples: int | None


def run_one(run: Run) -> dict | None:
    task = TASKS[run.task]
    L.seed_everything(run.seed, verbose=False)
    dm = task.make_data(run.seed, run.limit, run.eval_samples, task.batch_size)
    dm.setup("fit")
    model = task.make_model(dm)
    numel = {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}
    kwargs = {"forward_codec": "identity", "backward_codec": "identity", **CONFIGS[run.config]}
    strategy = lightning_clapping.ClappingStrategy(split_points=SPLITS[run.task], microbatches=task.microbatches,
                                                   **kwargs)
    recorder = Recorder(task.metric)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=run.steps,
                        val_check_interval=run.steps, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        gradient_clip_val=task.gradient_clip_val, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    totals = trainer.strategy.byte_totals
    if trainer.global_rank != 0:
        return None
    gradient_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # k copies of a tied tensor: k (k - 1) fp32 gradients per sum, as the tied bytes count them uncompressed
    tied_raw = sum(len(g.stages) * (len(g.stages) - 1) * 4 * numel[g.keys[0]]
                   for g in trainer.strategy.partition.tied)
    return {**asdict(run), "metric": recorder.curve[-1]["metric"], "val_loss": recorder.curve[-1]["val_loss"],
            "bytes_per_step": totals["bytes"] / totals["steps"], "raw_per_step": totals["raw_bytes"] / totals["steps"],
            "replica_per_step": totals["replica_bytes"] / totals["steps"],
            "pipeline_per_step": (totals["bytes"] - totals["replica_bytes"] - totals["tied_bytes"]) / totals["steps"],
            "tied_per_step": totals["tied_bytes"] / totals["steps"], "tied_raw_per_step": tied_raw,
            "gradient_bytes": gradient_bytes, "fewer_bytes": totals["raw_bytes"] / totals["bytes"],
            "seconds": time.perf_counter() - t0}


def _tied(run: dict) -> float:
    """The tied sum's bytes per step (runs saved before they were recorded apart: what is left of the total)."""
    if "tied_per_step" in run:
        return run["tied_per_step"]
    return run["bytes_per_step"] - run["replica_per_step"] - run["pipeline_per_step"]


def summarize(runs: list[dict]) -> list[dict]:
    runs = [{**r, "tied_per_step": _tied(r)} for r in runs]
    rows = []
    for task in dict.fromkeys(r["task"] for r in runs):
        base = [r for r in runs if r["task"] == task and r["config"] == "every-step"]
        for config in dict.fromkeys(r["config"] for r in runs if r["task"] == task):
            mine = [r for r in runs if r["task"] == task and r["config"] == config]
            mean = {k: sum(r[k] for r in mine) / len(mine) for k in ("metric", "bytes_per_step", "fewer_bytes",
                                                                    "replica_per_step", "pipeline_per_step",
                                                                    "tied_per_step")}
            spread = (sum((r["metric"] - mean["metric"]) ** 2 for r in mine) / (len(mine) - 1)) ** 0.5 \
                if len(mine) > 1 else 0.0
            ref = sum(r["metric"] for r in base) / len(base) if base else float("nan")
            higher = TASKS[task].higher_is_better
            delta = (mean["metric"] - ref) * 100 if higher else (mean["metric"] / ref - 1) * 100
            within = delta >= -1.0 if higher else delta <= 2.0
            rows.append({"task": task, "config": config, "seeds": len(mine), **mean, "metric_std": spread,
                         "delta": delta, "delta_unit": "points" if higher else "%", "within_tolerance": within})
    return rows


def table(rows: list[dict]) -> str:
    return _table.table([(r["task"], r["config"], r["metric"], f"{r['delta']:+.2f} {r['delta_unit']}",
                          r["bytes_per_step"] / 1e6, f"{r['fewer_bytes']:.1f}x", r["tied_per_step"] / 1e3,
                          "yes" if r["within_tolerance"] else "NO") for r in rows],
                        ["task", "config", "metric", "vs every-step", "MB/step", "fewer", "tied kB/step", "ok"],
                        floatfmt=(None, None, ".4f", None, ".3f", None, ".2f"),
                        colalign=("left", "left") + ("right",) * 5 + ("left",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["fashion_mnist", "shakespeare"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tiny", action="store_true", help="a smoke test: 16 steps on data subsets, one seed")
    ap.add_argument("--add", action="store_true", help="keep the runs already in OUT's results file (other configs)")
    args = ap.parse_args()
    quiet()
    if args.tiny and args.configs == list(CONFIGS):
        args.configs = ["every-step", "diloco H=8 q4"]
    plan = [Run(task, config, seed, TINY["steps"] if args.tiny else int(STEPS[task] * args.steps_scale) // 16 * 16,
                TINY["limit"] if args.tiny else None, TINY["eval_samples"] if args.tiny else None)
            for seed in range(1 if args.tiny else args.seeds) for task in args.tasks for config in args.configs]
    runs = [r for r in (run_one(run) for run in plan) if r is not None]
    if os.environ.get("LOCAL_RANK", "0") != "0" or not runs:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "replica_sync_tiny.json" if args.tiny else "replica_sync.json"
    if args.add and (out / name).exists():
        new = {(r["task"], r["config"], r["seed"]) for r in runs}
        runs = [r for r in json.loads((out / name).read_text())["runs"]
                if (r["task"], r["config"], r["seed"]) not in new] + runs
    rows = summarize(runs)
    (out / name).write_text(json.dumps({"layout": "2 stages x 2 replicas", "steps": STEPS,
                                        "configs": {k: repr(v) for k, v in CONFIGS.items()},
                                        "rows": rows, "runs": runs}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
