"""Data parallel x pipeline on loopback: 2 replicas x 2 stages against 1 x 4 stages and 4-process DDP.

    python benchmarks/replicas_throughput.py [--quick | --tiny] [--out benchmarks/results]

One model (the character transformer of ``examples/char_lm.py``: d=128, 4 blocks, context 128), the same global
batch (32 sequences per optimizer step) and 4 processes for every layout:

* ``pp 1x4``: ``ClappingStrategy()`` (one stage per process), 8 micro-batches;
* ``dp x pp 2x2``: ``ClappingStrategy(stages=2)``, 16 sequences per replica, 4 micro-batches;
* ``ddp 4x1``: Lightning's ``strategy="ddp"``, 8 sequences per process.

Uncompressed, random tokens (speed does not depend on them). Each layout is one ``python`` launch timed between
training steps (set-up and the first ``warmup`` steps excluded); the layouts alternate for ``rounds`` rounds, so the
ratios compare runs taken side by side, and the table reports medians. Saves ``replicas_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples"))

GLOBAL_BATCH, BLOCK, VOCAB = 32, 128, 65
LAYOUTS = {  # name: (strategy kind, stages, micro-batches)
    "pp 1x4": ("clapping", 4, 8),
    "dp x pp 2x2": ("clapping", 2, 4),
    "ddp 4x1": ("ddp", 1, 1),
}
MODES = {"full": (40, 5, 3), "quick": (20, 4, 2), "tiny": (3, 1, 1)}  # timed steps, warm-up steps, rounds


def worker(layout: str, steps: int, warmup: int, out: Path) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_clapping
    from char_lm import CharTransformer

    torch.set_num_threads(1)
    kind, stages, micro = LAYOUTS[layout]
    replicas = 4 // stages
    torch.manual_seed(0)
    n = GLOBAL_BATCH * (steps + warmup)
    tokens = torch.randint(0, VOCAB, (n, BLOCK + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // replicas)
    strategy = lightning_clapping.ClappingStrategy(stages=stages, microbatches=micro) if kind == "clapping" else "ddp"

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.marks.append(time.perf_counter())

    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps + warmup, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])
    trainer.fit(CharTransformer(VOCAB, block_size=BLOCK), data)
    if trainer.global_rank == 0:
        timed = clock.marks[warmup - 1:] if warmup else clock.marks
        seconds = (timed[-1] - timed[0]) / (len(timed) - 1)
        out.write_text(json.dumps({"layout": layout, "step_s": seconds, "samples_per_s": GLOBAL_BATCH / seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="mode")
    size.add_argument("--tiny", action="store_const", const="tiny", dest="mode")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--worker", nargs=4, metavar=("LAYOUT", "STEPS", "WARMUP", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        layout, steps, warmup, file = args.worker
        worker(layout, int(steps), int(warmup), Path(file))
        return
    mode = args.mode or "full"
    steps, warmup, rounds = MODES[mode]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]), OMP_NUM_THREADS="1")
    runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for r in range(rounds):
        for name in LAYOUTS:
            file = out / f".replicas_{r}.json"
            subprocess.run([sys.executable, __file__, "--worker", name, str(steps), str(warmup), str(file)],
                           env=env, check=True, capture_output=True, text=True, timeout=900)
            runs[name].append(json.loads(file.read_text())["samples_per_s"])
            file.unlink()
            print(f"round {r + 1}/{rounds}: {name:12s} {runs[name][-1]:8.1f} samples/s", flush=True)
    base = statistics.median(runs["pp 1x4"])
    table = {name: {"samples_per_s": statistics.median(v), "vs_pp_1x4": statistics.median(v) / base, "runs": v}
             for name, v in runs.items()}
    from _machine import describe
    from _table import table as text_table

    result = {"mode": mode, "timed_steps": steps, "warmup_steps": warmup, "rounds": rounds,
              "global_batch": GLOBAL_BATCH, "machine": describe(), "layouts": table,
              "command": "python benchmarks/replicas_throughput.py" + (f" --{mode}" if mode != "full" else "")}
    if mode != "tiny":
        (out / "replicas_throughput.json").write_text(json.dumps(result, indent=2))
    print()
    print(text_table([(name, row["samples_per_s"], row["vs_pp_1x4"]) for name, row in table.items()],
                     ["layout", "samples/s", "vs 1x4"], floatfmt=(None, ".1f", ".2f")))


if __name__ == "__main__":
    main()
