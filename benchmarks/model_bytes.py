"""Bytes per step of real models on 4 stages: activations, values crossing cuts, and the tied gradient sum.

    python benchmarks/model_bytes.py [--steps 10] [--out benchmarks/results]

Runs examples/llama_lm.py (a Hugging Face Llama from its config, tied input embedding and output head, Shakespeare
characters, 4 stages, automatic balance) uncompressed and with Clapping-FC + lazy sampling, and Lightning's own
nn.Transformer demo (``--model demo``) uncompressed. For each it reports the uncompressed bytes per training step of
the boundary messages (activations forward, gradients backward) split into the cut modules' inputs and the values
that cross cuts besides them, the tied gradient sum, and what was sent. Saves OUT/model_bytes.json.
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

ROOT = Path(__file__).resolve().parent.parent

RUNS = [  # name, example arguments
    ("llama, uncompressed", ["--model", "llama", "--variant", "uncompressed"]),
    ("llama, clapping-fc", ["--model", "llama", "--variant", "clapping-fc"]),
    ("nn.Transformer demo, uncompressed", ["--model", "demo", "--variant", "uncompressed"]),
]


def run(args: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bytes.json"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "llama_lm.py"), "--stages", "4", "--steps",
                               str(steps), "--results", str(out), *args], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"llama_lm.py {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def row(name: str, report: dict) -> dict:
    per = report["per_step"]
    tied_raw = per["tied_bytes"] if report["variant"] == "uncompressed" else None
    boundary_raw = per["raw_bytes"] - per["control_bytes"] - (tied_raw or 0.0)
    if tied_raw is None:  # compressed: the tied sum is sent uncompressed too (no tied_codec), so it is its raw size
        tied_raw = per["tied_bytes"]
        boundary_raw = per["raw_bytes"] - per["control_bytes"] - tied_raw
    return {"run": name, "steps": report["steps"], "val_loss": report["val_loss"],
            "cut_inputs_raw": boundary_raw - per["crossing_raw_bytes"], "crossing_raw": per["crossing_raw_bytes"],
            "tied_raw": tied_raw, "sent": per["bytes"]}


def table_of(rows: list[dict]) -> str:
    return table([(r["run"], r["cut_inputs_raw"] / 1e3, r["crossing_raw"] / 1e3, r["tied_raw"] / 1e3, r["sent"] / 1e3)
                  for r in rows], ["run", "cut inputs kB", "crossing kB", "tied sum kB", "sent kB"], floatfmt=".1f")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    rows = [row(name, run(extra, args.steps)) for name, extra in RUNS]
    print(table_of(rows))
    print("per training step, uncompressed (fp32) except 'sent'; 4 stages, batch 16 x 64 characters, 4 micro-batches")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "model_bytes.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
