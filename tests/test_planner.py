"""The planner (lightning_clapping.planner): its bytes against a measured run, and what each argument may change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_clapping.planner import PRESETS, plan
from lightning_clapping.sync.config import DiLoCo

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "bytes_by_kind.json"
#: the layout of benchmarks/bytes_by_kind.py: 2 stages x 2 replicas, batch 8 x 128 tokens, 2 micro-batches
LAYOUT = dict(stages=2, replicas=2, tokens_per_step=8 * 128, microbatches=2)
KEYS = {"activations": "pipeline_messages_per_step", "tied": "tied_bytes_per_step",
        "replica": "replica_bytes_per_step", "total": "bytes_per_step"}


@pytest.mark.parametrize("variant, codecs, warm_start", [
    ("uncompressed", {}, False),
    ("clapping-fc q4/q8", {"forward_codec": "q4", "backward_codec": "q8"}, True),
])
def test_tied_llama_plan_reproduces_the_measured_bytes(variant, codecs, warm_start):
    row = next(r for r in json.loads(MEASURED.read_text())["rows"] if r["variant"] == variant)
    predicted = plan("tied-llama-32k", **LAYOUT, **codecs).mean_over(row["steps"], warm_start=warm_start)
    for kind, key in KEYS.items():
        assert predicted[kind] == pytest.approx(row[key], rel=0.05), kind


def test_diloco_every_4_steps_sends_a_quarter_of_every_step():
    every = plan("tied-llama-32k", **LAYOUT)
    diloco = plan("tied-llama-32k", **LAYOUT, replica_sync=DiLoCo(inner_steps=4))
    # every-step also sends a 4-byte presence flag per tensor, DiLoCo's all-reduce does not: equal to 1e-5
    assert diloco.replica == pytest.approx(every.replica / 4, rel=1e-5)
    assert diloco.replica == sum(every.stage_param_bytes) / 4  # 2 replicas: a rank sends its buffer once
    assert diloco.raw_replica == every.raw_replica  # the reference stays uncompressed every-step training
    assert (diloco.activations, diloco.tied) == (every.activations, every.tied)


def test_a_codec_on_the_activations_changes_only_the_activations():
    plain = plan("tied-llama-32k", **LAYOUT)
    coded = plan("tied-llama-32k", **LAYOUT, forward_codec="q4", backward_codec="q8")
    assert coded.activations < plain.activations / 4
    assert (coded.tied, coded.replica) == (plain.tied, plain.replica)
    raw = ("raw_activations", "raw_tied", "raw_replica", "stage_param_bytes")
    assert [getattr(coded, k) for k in raw] == [getattr(plain, k) for k in raw]
    assert coded.total == coded.activations + plain.tied + plain.replica
    assert coded.ratio > plain.ratio == 1.0


def test_only_the_tied_presets_sum_tied_copies():
    kwargs = dict(stages=4, replicas=2, tokens_per_step=16384, microbatches=4, seq_len=2048)
    untied = plan("llama-3.1-8b", **kwargs)
    assert untied.tied == untied.raw_tied == 0
    assert untied.stage_param_bytes[0] > 4e9  # the 8B model was really built (on meta): ~8 GB fp32 per stage
    tied = plan("llama-3.2-1b", **kwargs)
    embedding = 4 * PRESETS["llama-3.2-1b"]["vocab_size"] * PRESETS["llama-3.2-1b"]["hidden_size"]
    assert tied.tied == 2 * embedding  # two copies, each sends its gradient to the other


def test_the_command_prints_the_table():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "lightning_clapping.planner", "--hf-config", "tied-llama-32k",
                           "--stages", "2", "--replicas", "2", "--tokens", "1024", "--microbatches", "2",
                           "--forward-codec", "q4", "--backward-codec", "q8", "--link-mbit", "100",
                           "--delay-ms", "25"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = plan("tied-llama-32k", **LAYOUT, forward_codec="q4", backward_codec="q8")
    lines = {line.split("  ")[0].strip(): line.split() for line in done.stdout.splitlines()}
    assert float(lines["total"][1]) == pytest.approx(expected.total / 1e6, abs=1e-3)
    assert lines["replica sync (every-step)"] and "step time" in done.stdout
