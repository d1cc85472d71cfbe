"""benchmarks/entropy_coding.py runs in its tiny mode (scikit-learn digits, seconds) and reports consistent sizes."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_entropy_coding_benchmark_tiny_mode(tmp_path):
    pytest.importorskip("constriction", reason="pip install constriction==0.5.0")
    pytest.importorskip("sklearn", reason="the tiny mode trains on scikit-learn's digits")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "entropy_coding.py"), "--tiny", "--out",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"entropy_coding.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads((tmp_path / "entropy_coding.json").read_text())
    rows = result["rows"]
    assert {(r["kind"], r["codec"]) for r in rows} == {
        (k, c) for k in ("fc-forward", "fc-backward", "direct-forward", "direct-backward") for c in ("q4", "q8")}
    run = result["runs"][0]
    import torch

    from lightning_clapping.codecs import get_codec

    for r in rows:
        codec = get_codec(r["codec"])
        shape = run["message_shapes"][r["cut"]]
        # the packed size is the codec's own payload, for every micro-batch message of a step
        assert r["packed_bytes_per_step"] == codec.payload_nbytes(shape, torch.float32) * r["messages_per_step"]
        assert r["model_bytes_per_message"] == 4 * (codec.top_code + 1)
        # fc leaves out step 0 (sent in full); direct counts every step
        assert r["steps"] == run["steps"] - (1 if r["kind"].startswith("fc") else 0)
        assert r["fresh_steps"] + r["reuse_steps"] == r["steps"]
        # entropy is below the code width; rANS comes within a few percent of the entropy
        assert 0 < r["entropy_bits_per_value"] <= r["bits"]
        assert r["entropy_bits_per_value"] <= r["rans_code_bits_per_value"] < 1.05 * r["entropy_bits_per_value"] + 0.1
        assert r["ratio_best_mean"] >= max(1.0, r["ratio_mean"]) - 1e-9
        assert r["ratio_ideal_mean"] >= r["ratio_mean"]
        assert len(r["ratio_per_step"]) == r["steps"]
    t = result["timing"]
    assert t["values"] == 1 << 16 and min(t["copy_ms"], t["rans_encode_ms"], t["rans_decode_ms"]) > 0
    assert t["rans_over_copy"] == pytest.approx(t["rans_encode_decode_ms"] / t["copy_ms"])
    assert "rANS encode + decode" in proc.stdout
    with open(tmp_path / "entropy_coding.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
