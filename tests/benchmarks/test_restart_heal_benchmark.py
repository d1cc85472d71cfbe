"""benchmarks/restart_heal.py's quick mode: one torchrun trial healed and measured (a smoke test of the script)."""

from __future__ import annotations

import json
import sys

def test_restart_heal_benchmark_quick_mode_heals_one_torchrun_trial_and_measures_it(tmp_path):
    import os
    import subprocess

    from conftest import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "restart_heal.py"), "--quick", "--out",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    arm = json.loads((tmp_path / "restart_heal_quick.json").read_text())["arms"]["clapping"]
    assert (arm["summary"]["trials"], arm["summary"]["healed"], arm["summary"]["bit_equal"]) == (1, 1, 1)
    row = arm["rows"][0]
    assert row["steps_lost"] == 3  # steps 7, 8 and 9 ran before the kill; the checkpoint of step 6 is resumed
    assert row["rounds"] == 2 and 0 < row["median_step_s"] < row["seconds_paused"]
    parts = row["down_s"] + row["start_s"] + row["resume_s"]
    assert parts - 0.01 <= row["seconds_paused"] + row["median_step_s"] <= parts + 0.01
    assert "clapping         healed 1/1, bit-equal 1/1" in proc.stdout
