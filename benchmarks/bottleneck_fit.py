"""Fitting the bottlenecks of a model larger than one process: in one process against on the pipeline's stages.

    python benchmarks/bottleneck_fit.py [--quick | --tiny] [--out benchmarks/results]

The model is examples/big_model.py's WideMLP (blocks of Linear(width, width) + Tanh), 16 blocks of 4096 by default
(1.07 GB of fp32 weights), built in ``configure_model()``, with a ``Bottleneck(width, width / 16)`` after every fourth
block (three of them). ``FitBottlenecks`` starts them from 8 batches of 64 inputs, then one training step runs (the
callback acts at the start of training). Two runs:

- one process: the callback calls ``fit_bottlenecks``; the model is materialized with ``materialize_module``, so it
  starts from the stages' weights;
- 4 stages cut at the bottlenecks (``ClappingStrategy``): no process ever holds the whole model.

Reported per rank, above the resident memory the process had before the model was built, as multiples of the model's
size: the peak before the fit (building) and the peak through the fit; the fit's wall time; each bottleneck's kept
energy; and the largest difference between the two runs' fitted weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = {  # width, blocks, fitting batches of 64
    "full": (4096, 16, 8),
    "quick": (2048, 16, 8),
    "tiny": (256, 8, 2),
}
STAGES = 4


def worker(out: Path, name: str, width: int, blocks: int, batches: int, stages: int) -> None:
    """One run (every rank executes this: Lightning's launcher re-runs the script)."""
    import lightning as L
    import torch
    from memory import peak, rss

    import lightning_clapping
    from examples.big_model import WideMLP, synthetic_data

    start = rss()  # after the imports: what a process holds before any model exists
    row: dict = {}
    every = blocks // STAGES

    class BottleneckedMLP(WideMLP):
        def configure_model(self) -> None:
            if self.blocks is not None:
                return
            layers = []  # built in the order they run, as materializing the stages initialises them
            for i in range(blocks):
                layers.append(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()))
                if (i + 1) % every == 0 and i + 1 < blocks:
                    layers.append(lightning_clapping.Bottleneck(width, width // 16))
            self.blocks = torch.nn.ModuleList(layers)
            self.head = torch.nn.Linear(width, self.hparams.classes)

    class Before(L.Callback):
        def on_train_start(self, trainer, pl_module):
            row.update(build_peak=peak() - start, fit_start=time.perf_counter())

    class After(L.Callback):
        def on_train_start(self, trainer, pl_module):
            row.update(fit_peak=peak() - start, fit_s=time.perf_counter() - row.pop("fit_start"),
                       kept=fit.kept, rank=trainer.global_rank,
                       model_bytes=sum(p.numel() * 4 for p in pl_module.parameters()))
            held = {k: v.clone() for k, v in pl_module.state_dict().items()
                    if (".down." in k or ".up." in k) and not v.is_meta}
            torch.save(held, out / f"{name}_rank{trainer.global_rank}.pt")

    g = torch.Generator().manual_seed(1)
    mix = torch.randn(width // 4, width, generator=g) / (width // 4) ** 0.5  # inputs of rank width / 4
    fit_batches = [torch.randn(64, width // 4, generator=g) @ mix for _ in range(batches)]
    fit = lightning_clapping.FitBottlenecks([(x, torch.zeros(64, dtype=torch.long)) for x in fit_batches])
    L.seed_everything(0)
    model = BottleneckedMLP(width, blocks, momentum=0.0)
    if stages > 1:
        cuts = [f"blocks.{(every + 1) * s - 1}" for s in range(1, STAGES)]  # the bottlenecks
        strategy = lightning_clapping.ClappingStrategy(split_points=cuts, microbatches=1)
    else:  # the weights the stages materialize (a single-device eager build draws from another stream)
        strategy = "auto"
        with lightning_clapping.building_on_meta():
            model.configure_model()
        lightning_clapping.materialize_module(model)
    trainer = L.Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Before(), fit, After()])
    trainer.fit(model, synthetic_data(width))
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(row))


def launch(out: Path, name: str, width: int, blocks: int, batches: int, stages: int) -> list[dict]:
    from memory import run_worker

    return run_worker(str(Path(__file__).resolve()), out, name, [width, blocks, batches, stages], stages)


def largest_difference(out: Path, stages: int) -> float:
    """The largest difference between the two runs' fitted weights (each half from the rank that holds it)."""
    import torch

    one = torch.load(out / "one_rank0.pt", weights_only=True)
    staged: dict = {}
    for r in range(stages):
        staged.update(torch.load(out / f"stages_rank{r}.pt", weights_only=True))
    if set(one) != set(staged):
        raise SystemExit(f"the runs fitted different halves: {sorted(one)} against {sorted(staged)}")
    return max(float((one[k] - staged[k]).abs().max()) for k in one)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true")
    g.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*[Path(a) if i == 0 else a for i, a in enumerate(json.loads(args.worker))])
        return
    from _machine import describe

    mode = "quick" if args.quick else "tiny" if args.tiny else "full"
    width, blocks, batches = MODES[mode]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [{"run": "one process", **r} for r in launch(tmp, "one", width, blocks, batches, 1)]
        rows += [{"run": f"{STAGES} stages", **r} for r in launch(tmp, "stages", width, blocks, batches, STAGES)]
        difference = largest_difference(tmp, STAGES)
    model_bytes = rows[0]["model_bytes"]
    print(f"WideMLP {blocks} x Linear({width}, {width}) + 3 x Bottleneck({width}, {width // 16}): "
          f"{model_bytes / 1e9:.2f} GB fp32; fitted on {batches} batches of 64")
    print("run           rank  build peak  peak through the fit  fit s   (peaks above start / model size)")
    for r in rows:
        print(f"{r['run']:12s} {r['rank']:5d}  {r['build_peak'] / model_bytes:10.2f}  "
              f"{r['fit_peak'] / model_bytes:20.2f}  {r['fit_s']:5.1f}")
    kept_one, kept_staged = rows[0]["kept"], rows[1]["kept"]
    for k in kept_one:
        print(f"{k}: keeps {kept_one[k]:.4f} of its inputs' energy in one process, {kept_staged[k]:.4f} on the stages")
    worst = {run: max(r["fit_peak"] for r in rows if r["run"] == run) / model_bytes
             for run in ("one process", f"{STAGES} stages")}
    print(f"\nworst rank through the fit: {worst['one process']:.2f}x the model in one process, "
          f"{worst[f'{STAGES} stages']:.2f}x on {STAGES} stages; largest difference between the fitted weights: "
          f"{difference:.3g}")
    result = {"mode": mode, "machine": describe(), "width": width, "blocks": blocks, "batches": batches,
              "stages": STAGES, "model_bytes": model_bytes, "rows": rows, "worst_fit_peak": worst,
              "largest_weight_difference": difference,
              "command": "python benchmarks/bottleneck_fit.py" + ("" if mode == "full" else f" --{mode}")}
    (args.out / "bottleneck_fit.json").write_text(json.dumps(result, indent=1))
    print(f"saved {args.out / 'bottleneck_fit.json'}")


if __name__ == "__main__":
    main()
