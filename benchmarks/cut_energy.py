"""How many directions the values crossing each cut need, as training goes: the energy spectrum at every cut.

    python benchmarks/cut_energy.py [--tasks shakespeare wordnet_glosses fashion_vit] [--steps-scale S] \\
        [--points 8] [--seed 0] [--out benchmarks/results/cut_energy.json]

For each task of ``quality.py`` named, the model is trained uncompressed in one process (the pipeline trains the
same, section 1) for the longer runs' steps: the task's ``--standard`` steps times ``LONGER_SCALE`` (4 for
Shakespeare, whose 120 become 480; the other tasks' standard lengths are already their longer ones), or times
``--steps-scale`` when it is given.
At step 0 and ``--points`` evenly spaced steps after, the values reaching each split point on the first 4 held-out
batches (the residual stream entering the block) give the second-moment matrix ``x^T x`` (float64, uncentred: what
a bias-free ``Bottleneck`` keeps is its projection of it). Reported per cut and step: the fraction of the energy kept
by the top d/16, d/8, d/4 and d/2 directions (what a Bottleneck of that rank keeps at best, fitted to these values),
how many directions keep 90, 95 and 99 %, and the effective rank (the exponential of the eigenvalues' entropy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import quality  # noqa: E402  (its task table, with the two more tasks registered)

EVAL_BATCHES = 4
LONGER_SCALE = {"shakespeare": 4.0}  # the longer runs' length over the --standard one (other tasks: 1)
DIVISORS = (16, 8, 4, 2)
LEVELS = (0.90, 0.95, 0.99)


def spectrum_summary(gram: torch.Tensor) -> dict:
    """Kept fractions, directions per level and effective rank of one second-moment matrix."""
    values = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0)
    total = float(values.sum())
    cum = (values.cumsum(0) / total).tolist()
    d = values.numel()
    p = values / total
    entropy = -float((p[p > 0] * p[p > 0].log()).sum())
    return {
        "kept": {f"d/{k}": cum[d // k - 1] for k in DIVISORS},
        "directions": {f"{round(level * 100)} %": next(i + 1 for i, c in enumerate(cum) if c >= level) for level in
                       LEVELS},
        "effective_rank": math.exp(entropy),
        "eigenvalues": (values / total).tolist(),
    }


class CutEnergy(L.Callback):
    """At the given steps (and before the first), the spectrum at each of ``cuts`` on ``batches``."""

    def __init__(self, task, cuts: list[str], batches: list, steps: list[int]) -> None:
        self.task, self.cuts, self.batches, self.steps = task, cuts, batches, set(steps)
        self.points: list[dict] = []

    def measure(self, model: L.LightningModule, step: int) -> None:
        grams: dict[str, torch.Tensor] = {}

        def hook(name):
            def record(module, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                grams[name] = grams.get(name, 0) + x.t() @ x
            return record

        handles = [model.get_submodule(c).register_forward_pre_hook(hook(c)) for c in self.cuts]
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.batches:
                    self.task.fit_forward(model, batch)
        finally:
            model.train(was)
            for h in handles:
                h.remove()
        self.points.append({"step": step, "cuts": {c: spectrum_summary(grams[c]) for c in self.cuts}})
        first = self.points[-1]["cuts"][self.cuts[0]]
        print(f"[cut_energy] {self.task.name} step {step}: {self.cuts[0]} keeps {first['kept']}, effective rank "
              f"{first['effective_rank']:.1f}", flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self.measure(pl_module, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.measure(pl_module, trainer.global_step)


def run_task(name: str, steps_scale: float | None, points: int, seed: int) -> dict:
    task = quality.TASKS[name]
    scale = LONGER_SCALE.get(name, 1.0) if steps_scale is None else steps_scale
    steps = round(quality.MODES["standard"]["tasks"][name]["steps"] * scale)
    L.seed_everything(seed, verbose=False)
    dm = task.make_data(seed, None, None, task.batch_size)
    dm.setup("fit")
    model = task.make_model(dm)
    batches = list(itertools.islice(dm.val_dataloader(), EVAL_BATCHES))
    at = sorted({round(steps * (i + 1) / points) for i in range(points)})
    energy = CutEnergy(task, list(task.split_points), batches, at)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=task.gradient_clip_val, callbacks=[energy])
    trainer.fit(model, datamodule=dm)
    return {"task": name, "title": task.title, "steps": steps, "seed": seed, "eval_batches": EVAL_BATCHES,
            "points": energy.points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["shakespeare"], choices=list(quality.TASKS))
    ap.add_argument("--steps-scale", type=float, default=None,
                    help="scale every task's --standard steps (default: the longer runs' length per task)")
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "cut_energy.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in args.tasks:
        results[name] = run_task(name, args.steps_scale, args.points, args.seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        for point in results[name]["points"]:
            row = "  ".join(f"{c}: {s['kept']['d/8']:.3f}/{s['kept']['d/4']:.3f} {s['directions']['95 %']:3d}"
                            for c, s in point["cuts"].items())
            print(f"{name} step {point['step']:4d}  kept d/8 / d/4, directions for 95 %:  {row}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
