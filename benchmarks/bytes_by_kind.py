"""Everything a replica's ranks send per step, by kind: pipeline messages, the tied gradient sum, the replicas' average.

    python benchmarks/bytes_by_kind.py [--steps 4] [--out benchmarks/results] [--tiny]

A Hugging Face Llama built from its config with tied input embedding and output head and a 32k vocabulary (hidden
256, 4 layers, batch 8 x 128 tokens), on 2 pipeline stages x 2 replicas (4 processes, Lightning's launcher), trained
uncompressed and with Clapping-FC q4/q8 (p = 1: every step fresh, so both send the same kinds each step), then with
the replica sync modes and a codec on the tied sum (``VARIANTS``; the DiLoCo rows run 32 steps, two or one outer
intervals). It reads ``trainer.strategy.byte_totals`` after ``fit`` and reports, per optimizer step and per
replica, the pipeline's messages (activations and gradients), the tied sum and the replicas' sync, and the ratio of
everything sent against uncompressed every-step training. Saves OUT/bytes_by_kind.json. The tokens are random: the
byte numbers do not depend on them, except LAG's (which tensors fire depends on the gradients).
``--tiny`` (the smoke test): vocabulary 100, hidden 16, two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _table import table
from lightning_clapping import DiLoCo

ROOT = Path(__file__).resolve().parent.parent
FC = {"variant": "clapping-fc", "forward_codec": "q4", "backward_codec": "q8"}
SPARSE = "topk:0.05+q4"  # the 5 % largest of each tensor in 4 bits, with positions (23.7x on the 32k x 256 table)
#: label -> (ClappingStrategy arguments, optimizer steps at least); the DiLoCo rows run 2 outer intervals
VARIANTS = {
    "uncompressed": ({}, 0),
    "clapping-fc q4/q8": (FC, 0),
    "clapping-fc q4/q8, lag": ({**FC, "replica_sync": "lag"}, 0),
    "clapping-fc q4/q8, diloco H=16": ({**FC, "replica_sync": DiLoCo(inner_steps=16)}, 32),
    f"clapping-fc q4/q8, tied {SPARSE}, diloco H=16 {SPARSE}": (
        {**FC, "tied_codec": SPARSE, "replica_sync": DiLoCo(inner_steps=16, codec=SPARSE)}, 32),
    f"clapping-fc q4/q8, tied topk:0.02+q4, diloco H=32 {SPARSE}": (
        {**FC, "tied_codec": "topk:0.02+q4", "replica_sync": DiLoCo(inner_steps=32, codec=SPARSE)}, 32),
    # the replica sync that stayed within tolerance on both quality tasks (benchmarks/replica_sync.py)
    f"clapping-fc q4/q8, tied {SPARSE}, diloco H=16 q4": (
        {**FC, "tied_codec": SPARSE, "replica_sync": DiLoCo(inner_steps=16, codec="q4")}, 32),
    "clapping-fc q4/q8, tied q4, diloco H=16 q4": (
        {**FC, "tied_codec": "q4", "replica_sync": DiLoCo(inner_steps=16, codec="q4")}, 32),
}
TINY_VARIANTS = ["uncompressed", "clapping-fc q4/q8"]


SIZES = {"full": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4),
         "tiny": dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2)}


def worker(variant: str, steps: int, out: str, size: str = "full") -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_clapping import ClappingStrategy

    class TiedLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(**SIZES[size], max_position_embeddings=128, tie_word_embeddings=True)
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    L.seed_everything(0)
    vocab = SIZES[size]["vocab_size"]
    data = TensorDataset(torch.randint(0, vocab, (8 * 2 * steps, 128), generator=torch.Generator().manual_seed(1)))
    strategy = ClappingStrategy(stages=2, microbatches=2, **VARIANTS[variant][0])
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = TiedLlama()
    trainer.fit(model, DataLoader(data, batch_size=8))
    if trainer.global_rank == 0:
        # what the replicas' average carries per step: every fp32 gradient of both stages and a presence flag each;
        # the tied tensor is one parameter of the model but a gradient on both stages, so its copy counts again
        params = list(model.parameters())
        grads = sum(p.numel() * 4 + 4 for p in params) + model.model.lm_head.weight.numel() * 4 + 4
        Path(out).write_text(json.dumps({**trainer.strategy.byte_totals, "gradient_bytes": grads}))


def table_of(rows: list[dict]) -> str:
    """Bytes per step of one replica (MB) by kind, and how many times fewer than the first row (uncompressed)."""
    return table([(r["variant"], r["pipeline_messages_per_step"] / 1e6, r["tied_bytes_per_step"] / 1e6,
                   r["replica_bytes_per_step"] / 1e6, r["bytes_per_step"] / 1e6, f"{r['fewer_bytes']:.3f}x")
                  for r in rows], ["per step, one replica (MB)", "pipeline msgs", "tied sum", "replica avg", "all",
                                   "fewer bytes"], floatfmt=".2f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tiny", action="store_true", help="a small model and two steps (the smoke test)")
    parser.add_argument("--variants", nargs="+", help="run only these rows; the others are kept from OUT's results")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2], args.worker[3])
        return
    size, steps = ("tiny", 2) if args.tiny else ("full", args.steps)  # the first step is sent in full (warm_start)
    rows = []
    kept = {}
    if args.variants and (Path(args.out) / "bytes_by_kind.json").exists():
        kept = {r["variant"]: r for r in json.loads((Path(args.out) / "bytes_by_kind.json").read_text())["rows"]}
    for variant in TINY_VARIANTS if args.tiny else VARIANTS:
        if variant in kept and variant not in args.variants:
            rows.append(kept[variant])
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "totals.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            runs = str(max(steps, VARIANTS[variant][1]))
            subprocess.run([sys.executable, __file__, "--worker", variant, runs, str(path), size], cwd=tmp,
                           env=env, check=True, timeout=3600)
            totals = json.loads(path.read_text())
        done = totals["steps"]
        per_step = {k: totals[k] / done for k in ("bytes", "tied_bytes", "replica_bytes")}
        per_step["pipeline_messages"] = per_step["bytes"] - per_step["tied_bytes"] - per_step["replica_bytes"]
        rows.append({"variant": variant, "steps": done, "gradient_bytes": totals["gradient_bytes"],
                     **{f"{k}_per_step": v for k, v in per_step.items()}})
    base = rows[0]["bytes_per_step"]
    for r in rows:
        r["fewer_bytes"] = base / r["bytes_per_step"]
    print(table_of(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ("Llama from config, tied, " + ("vocab 100, hidden 16, 2 layers" if args.tiny else
                                            "vocab 32k, hidden 256, 4 layers") + ", batch 8 x 128, 2 stages x 2 replicas")
    (out / "bytes_by_kind.json").write_text(json.dumps({"model": model, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
