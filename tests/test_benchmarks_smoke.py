"""Every benchmark script runs in its tiniest mode, so none of them can rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_codec_speed_benchmark_runs_and_reports_ratios_to_memory_copy(tmp_path):
    _run("codec_speed.py", tmp_path)
    rows = json.loads((tmp_path / "codec_speed.json").read_text())
    text = json.dumps(rows)
    assert "q4" in text and "copy" in text
    assert (tmp_path / "codec_speed.csv").exists()


def test_overhead_benchmark_runs_all_three_methods(tmp_path):
    proc = _run("overhead.py", tmp_path)
    summary = json.loads((tmp_path / "overhead.json").read_text())
    assert set(summary["median_samples_per_s"]) == {"torch_pipelining", "bare_executor", "lightning"}
    assert all(v > 0 for v in summary["median_samples_per_s"].values())
    assert "lightning / torch_pipelining" in proc.stdout


def test_lazy_messages_benchmark_compares_thresholds_with_the_trigger_off(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from datasets import missing_reason

    if missing_reason("shakespeare"):
        pytest.skip(missing_reason("shakespeare"))
    _run("lazy_messages.py", tmp_path)
    summary = json.loads((tmp_path / "lazy_messages.json").read_text())
    thresholds = [r["threshold"] for r in summary["runs"]]
    assert thresholds[0] is None and len(thresholds) == 4
    assert summary["runs"][0]["bytes_saved_vs_off"] == 0
