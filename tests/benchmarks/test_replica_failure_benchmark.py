"""benchmarks/replica_failure.py's quick mode: one failure under torchrun, measured (a smoke test of the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

def test_replica_failure_benchmark_measures_one_failure_under_torchrun(tmp_path):
    """The benchmark's quick mode: the documented recipe (a lighthouse, one torchrun per group) with one SIGKILL."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "replica_failure.py"), "--quick", "--out",
                           str(tmp_path), "--work", str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "replica_failure.json").read_text())
    (result,) = report["trials"]
    assert result["killed"] and result["survivor_processes"] == 2, result
    assert result["rejoined"] and result["bit_equal"], result
    assert result["steps_lost_survivors"] <= 1, result
    # How long the survivors paused is a figure the benchmark measures and reports (its full run holds the bound);
    # a smoke test on a loaded machine cannot hold a wall-clock bound, it checks that the pause was measured.
    assert result["seconds_paused"] > 0 and result["median_step_s"] > 0, result
