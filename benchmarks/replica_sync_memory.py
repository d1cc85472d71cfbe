"""Peak memory per rank with each replica sync mode, against every-step averaging.

    python benchmarks/replica_sync_memory.py [--steps 20] [--modes LABEL ...] [--mmap-threshold BYTES]
                                             [--no-repeat] [--out benchmarks/results] [--tiny]

The model is bytes_by_kind.py's Hugging Face Llama built from its config, with tied input embedding and output head
and a 32k vocabulary (hidden 256, 4 layers: 11.4 M parameters, about 39 MB of fp32 per stage, most of it the
embedding table, which both stages hold). It runs on 2 pipeline stages x 2 replicas (4 processes, gloo on CPU,
Lightning's launcher), with plain SGD (no optimizer state, so whatever a mode adds shows alone), batch 4 x 32
tokens in 2 micro-batches (small activations: what a mode adds is copies of the parameters, and the compute is
kept short), for 20 steps: DiLoCo's outer step runs after step 16 and once more at the fit's end (step 20), with
its momentum then held; ``fragments=4`` syncs a quarter of the tensors every 4 steps; LAG's buffers exist from the
first step. Checkpoints are "sharded" so that rank 0 does not gather the whole model at the end of the fit.

Every mode runs in a launch of its own, so the peaks do not mix; every-step runs once more at the end, and how far
its two runs differ on a rank is the noise floor. Peak memory is the kernel's resident high-water mark (ru_maxrss,
as in memory.py), read after ``fit`` returns, so it covers the fit's end (DiLoCo's last outer step) and teardown.
Reported per rank: the peak, the peak minus every-step's peak on the same rank, the mode's counted extra memory
(``state_bytes()`` of the sync object the step driver holds, ``trainer.strategy._steps.sync``, read after the
fit) and the stage's parameter bytes; also the optimizer step after which the high-water mark was reached (or
``end``: during the fit's end or teardown), and the high-water mark after every step. Saves
OUT/replica_sync_memory.json and prints the table.

``--mmap-threshold BYTES`` launches the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_`` set: every allocation of at
least that size is mapped on its own and unmapped when freed, so the resident set follows the live tensors and
what the allocator keeps from freed ones (which varies from launch to launch) drops out. Its results go to
OUT/replica_sync_memory_mmap.json.

``--tiny`` (the smoke test): a 2-layer Llama of hidden 128 (still a 32k vocabulary: 16 MB per stage, enough to see
a copy of the stage's parameters), batch 4 x 16 tokens, 16 steps, modes every-step, LAG() and DiLoCo(inner_steps=16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from lightning_clapping import LAG, DiLoCo  # noqa: E402

#: label -> replica_sync argument (strings are built here, in each launched process, by ``mode_of``)
MODES = {
    "every-step": "every-step",
    "LAG()": LAG(),
    'LAG(reference="average")': LAG(reference="average"),
    "DiLoCo(H=16)": DiLoCo(inner_steps=16),
    'DiLoCo(H=16, codec="q4")': DiLoCo(inner_steps=16, codec="q4"),
    "DiLoCo(H=16, fragments=4)": DiLoCo(inner_steps=16, fragments=4),
}
TINY_MODES = ["every-step", "LAG()", "DiLoCo(H=16)"]
BASELINE = "every-step"
REPEAT = "every-step (again)"  # the baseline's second launch: the noise floor

SIZES = {
    "full": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4),
    "tiny": dict(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2),
}
#: batch size, sequence length, micro-batches, steps
RUNS = {"full": (4, 32, 2, 20), "tiny": (4, 16, 2, 16)}
MB = 1 << 20


def mode_of(label: str):
    return MODES[BASELINE if label == REPEAT else label]


def worker(out: Path, name: str, label: str, size: str, steps: int) -> None:
    """One launch (every rank runs this: Lightning's launcher re-runs the script)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_clapping import ClappingStrategy
    from memory import peak, rss

    torch.set_num_threads(1)
    batch, seq, microbatches, _ = RUNS[size]

    class TiedLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(**SIZES[size], max_position_embeddings=seq, tie_word_embeddings=True)
            self.model = LlamaForCausalLM(config)

        def training_step(self, b, batch_idx):
            (ids,) = b
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    row: dict = {}
    seen: dict = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["driver"] = trainer.strategy._steps  # the step driver; its .sync is the mode (None: one replica)
            row.update(build_peak=peak(), stage=trainer.strategy.stage, replica=trainer.strategy.replica)
            row["peaks"] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
            row["peaks"].append(peak())  # the high-water mark after each optimizer step (and the mode's sync)

    start = rss()  # after the imports, before the model exists
    L.seed_everything(0)
    vocab = SIZES[size]["vocab_size"]
    data = TensorDataset(torch.randint(0, vocab, (batch * 2 * steps, seq), generator=torch.Generator().manual_seed(1)))
    strategy = ClappingStrategy(stages=2, microbatches=microbatches, state_dict_type="sharded",
                                replica_sync=mode_of(label))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()])
    trainer.fit(TiedLlama(), DataLoader(data, batch_size=batch))
    high = peak()
    driver = seen["driver"]
    sync = driver.sync
    params = driver._stage_params
    reached = next((i + 1 for i, p in enumerate(row["peaks"]) if p == high), "end")
    row["high_water_by_step"] = row.pop("peaks")
    info: dict = {}
    if hasattr(sync, "outer_steps"):
        info["outer_steps"] = sync.outer_steps
    if hasattr(sync, "stale"):
        info["lag_tensors"] = len(sync.stale)
    row.update(mode=label, start_rss=start, peak=high, peak_reached=reached, steps=trainer.global_step,
               state_bytes=sync.state_bytes() if sync is not None else 0, sync=type(sync).__name__,
               param_bytes=sum(p.numel() * p.element_size() for p in params), param_tensors=len(params), **info)
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(row))


def add_deltas(rows: list[dict]) -> None:
    """Each row's peak minus every-step's peak on the same rank; the baseline's own repeat gives the noise."""
    base = {r["rank"]: r["peak"] for r in rows if r["mode"] == BASELINE}
    for r in rows:
        r["extra"] = r["peak"] - base[r["rank"]]
        r["extra_over_params"] = r["extra"] / r["param_bytes"]
        r["counted_over_params"] = r["state_bytes"] / r["param_bytes"]


def table_of(rows: list[dict]) -> str:
    from _table import table

    return table([(r["mode"], r["rank"], r["stage"], r["replica"], r["peak"] / MB, r["extra"] / MB,
                   r["state_bytes"] / MB, r["param_bytes"] / MB, f"{r['extra_over_params']:+.2f}",
                   f"{r['counted_over_params']:.2f}", str(r["peak_reached"])) for r in rows],
                 ["mode", "rank", "stage", "replica", "peak MB", "vs every-step MB", "counted MB", "stage params MB",
                  "measured/params", "counted/params", "peak after step"],
                 floatfmt=(None, None, None, None, ".1f", "+.1f", ".1f", ".1f"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 20; 16 with --tiny)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="run only these modes (every-step always runs)")
    p.add_argument("--no-repeat", action="store_true", help="skip every-step's second launch (the noise floor)")
    p.add_argument("--mmap-threshold", type=int, help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks (bytes)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--tiny", action="store_true", help="a smaller model, 16 steps, 3 modes (the smoke test)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        out, name, label, size, steps = json.loads(args.worker)
        worker(Path(out), name, label, size, int(steps))
        return
    from _machine import describe
    from memory import run_worker

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.mmap_threshold is not None:  # read by each rank's allocator at its start (not by this process's)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    size = "tiny" if args.tiny else "full"
    batch, seq, microbatches, default_steps = RUNS[size]
    steps = args.steps or default_steps
    labels = args.modes or (TINY_MODES if args.tiny else list(MODES))
    labels = [BASELINE] + [m for m in labels if m != BASELINE] + ([] if args.no_repeat else [REPEAT])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, label in enumerate(labels):
            print(f"running {label} ...", flush=True)
            ranks = run_worker(str(Path(__file__).resolve()), Path(tmp), f"run{n}", [label, size, steps], 4)
            rows += [{"rank": rank, **r} for rank, r in enumerate(ranks)]
    add_deltas(rows)
    repeat = [r for r in rows if r["mode"] == REPEAT]
    noise = max((abs(r["extra"]) for r in repeat), default=None)
    print(f"Tied Llama {SIZES[size]}, 2 stages x 2 replicas, SGD, batch {batch} x {seq} in {microbatches} "
          f"micro-batches, {steps} steps; peak = resident high-water mark (MiB)"
          + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else ""))
    print(table_of(rows))
    if noise is not None:
        print(f"noise floor (every-step launched twice, largest difference on a rank): {noise / MB:.1f} MiB")
    settings = {"model": "Hugging Face Llama from config, tied embedding and head", "config": SIZES[size],
                "layout": "2 stages x 2 replicas (4 processes, gloo on CPU)", "optimizer": "SGD lr=0.01",
                "batch": batch, "sequence": seq, "microbatches": microbatches, "steps": steps,
                "state_dict_type": "sharded", "peak": "ru_maxrss after fit (bytes)",
                "malloc_mmap_threshold": args.mmap_threshold,
                "modes": {label: repr(mode_of(label)) for label in labels}}
    result = {"mode": size, "machine": describe(), "settings": settings, "noise_bytes": noise, "rows": rows,
              "command": "python benchmarks/replica_sync_memory.py" + (" --tiny" if args.tiny else "")
              + (f" --steps {steps}" if args.steps else "")
              + (f" --mmap-threshold {args.mmap_threshold}" if args.mmap_threshold is not None else "")
              + (" --no-repeat" if args.no_repeat else "")}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("replica_sync_memory_mmap.json" if args.mmap_threshold is not None else
                       "replica_sync_memory.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
