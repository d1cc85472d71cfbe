"""Peak memory per rank against model size: a model bigger than one process, built eagerly or in configure_model().

    python benchmarks/memory.py [--quick | --tiny] [--out benchmarks/results]

The model is examples/big_model.py's WideMLP (blocks of Linear(width, width) + Tanh): 16 blocks of 4096 (1.07 GB of
fp32 weights) by default, trained with plain SGD for 3 steps on 1, 2 and 4 stages. "eager" builds every layer in
``__init__`` (each process holds the whole model before it is cut); "configure_model" builds them in the hook, on
the meta device, and each rank materializes only its stage. On 4 stages, a configure_model run also saves a sharded
checkpoint and a second run resumes it. Reported per rank, above the resident memory the process had before the
model was built: the peak while building (and loading), the peak while training, and the peak sampled during the
sharded save. Memory is the kernel's resident set (VmRSS / ru_maxrss), so it counts what the process really holds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = {  # width, blocks, stage counts, steps
    "full": (4096, 16, [1, 2, 4], 3),
    "quick": (2048, 16, [1, 2, 4], 3),
    "tiny": (256, 4, [2], 2),
}


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Sampler:
    """The highest VmRSS seen while the block runs (sampled every 2 ms from a thread)."""

    def __enter__(self):
        self.high, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.high = max(self.high, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.high = max(self.high, rss())


def worker(out: Path, name: str, width: int, blocks: int, stages: int, steps: int, build: str,
           save: str | None, resume: str | None) -> None:
    """One run (every rank executes this: Lightning's launcher re-runs the script)."""
    import lightning as L

    import lightning_clapping
    from examples.big_model import WideMLP, synthetic_data

    start = rss()  # after the imports: what a process holds before any model exists
    row: dict = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            row["build_peak"] = peak() - start

        def on_train_end(self, trainer, pl_module):
            own = [p for p in pl_module.parameters() if not p.is_meta]
            row.update(train_peak=peak() - start, stage=trainer.strategy.stage,
                       model_bytes=sum(p.numel() * 4 for p in pl_module.parameters()),
                       own_bytes=sum(p.numel() * 4 for p in own),
                       largest_own_tensor=max((p.numel() * 4 for p in own), default=0))

    L.seed_everything(0)
    model = WideMLP(width, blocks, momentum=0.0, eager=build == "eager")
    strategy = lightning_clapping.ClappingStrategy(microbatches=2, state_dict_type="sharded")
    trainer = L.Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()])
    trainer.fit(model, synthetic_data(width), ckpt_path=resume)
    if save:
        with _Sampler() as s:
            trainer.save_checkpoint(save)
        row["save_peak"] = s.high - start
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(row))


def run_worker(script: str, out: Path, name: str, worker_args: list, ranks: int) -> list[dict]:
    """``script --worker ARGS`` as a fresh launch (Lightning's launcher starts its other ranks), with the repository
    and benchmarks/ importable; returns what each rank wrote to OUT/NAME_rankR.json."""
    args = [sys.executable, script, "--worker", json.dumps([str(out), name, *worker_args])]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(args, cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(ranks)]


def launch(out: Path, name: str, width: int, blocks: int, stages: int, steps: int, build: str,
           save: str | None = None, resume: str | None = None) -> list[dict]:
    return run_worker(str(Path(__file__).resolve()), out, name, [width, blocks, stages, steps, build, save, resume],
                      stages)


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
    width, blocks, stage_counts, steps = MODES[mode]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for stages in stage_counts:
            for build in ("eager", "configure_model"):
                for rank, r in enumerate(launch(tmp, f"{build}{stages}", width, blocks, stages, steps, build)):
                    rows.append({"build": build, "stages": stages, "rank": rank, **r})
        last = stage_counts[-1]
        ckpt = str(tmp / "sharded.ckpt")
        saved = launch(tmp, "save", width, blocks, last, steps, "configure_model", save=ckpt)
        resumed = launch(tmp, "resume", width, blocks, last, steps + 1, "configure_model", resume=ckpt)
        for rank, (s, r) in enumerate(zip(saved, resumed)):
            rows.append({"build": "configure_model+save", "stages": last, "rank": rank, **s})
            rows.append({"build": "resume", "stages": last, "rank": rank, **r})
    model_bytes = rows[0]["model_bytes"]
    print(f"WideMLP {blocks} x Linear({width}, {width}): {model_bytes / 1e9:.2f} GB fp32, SGD, {steps} steps")
    print("build                 stages  rank  stage  build/load  train  save   (peak above start / model size)")
    for r in rows:
        save = f"{r['save_peak'] / model_bytes:5.2f}" if "save_peak" in r else "    -"
        print(f"{r['build']:22s} {r['stages']:5d} {r['rank']:5d} {r['stage']:6d}  {r['build_peak'] / model_bytes:9.2f}"
              f"  {r['train_peak'] / model_bytes:5.2f}  {save}")
    four = [r for r in rows if r["build"] == "configure_model" and r["stages"] == stage_counts[-1]]
    worst = max(four, key=lambda r: r["train_peak"])
    budget = {k: worst[k] / model_bytes for k in ("own_bytes", "largest_own_tensor")}
    rest = worst["train_peak"] / model_bytes - 2 * budget["own_bytes"] - budget["largest_own_tensor"]
    verdict = "met" if worst["train_peak"] <= 0.8 * model_bytes else "not met"  # the target is for 4 stages
    print(f"\n{stage_counts[-1]} stages, configure_model: worst rank {worst['train_peak'] / model_bytes:.2f}x the model "
          f"(target <= 0.8x: {verdict}) = parameters {budget['own_bytes']:.2f} + gradients {budget['own_bytes']:.2f} "
          f"+ one micro-batch's gradient of the largest tensor {budget['largest_own_tensor']:.2f} + rest {rest:.2f}")
    result = {"mode": mode, "machine": describe(), "width": width, "blocks": blocks, "steps": steps,
              "model_bytes": model_bytes, "rows": rows, "target": verdict,
              "command": "python benchmarks/memory.py" + ("" if mode == "full" else f" --{mode}")}
    (args.out / "memory.json").write_text(json.dumps(result, indent=1))
    print(f"saved {args.out / 'memory.json'}")


if __name__ == "__main__":
    main()
