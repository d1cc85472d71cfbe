"""The watchdog benchmark runs in its quick mode and reports what it promises (marked ``bench``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and pidfds")


def test_watchdog_scale_quick_compares_both_schemes_and_finds_the_stopped_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "watchdog_scale.py"), "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "watchdog_scale_quick.json").read_text())
    ranks, before, after = result["settings"]["ranks"], result["before"], result["after"]
    assert before["store_calls_per_rank_per_interval"] > ranks - 1  # every rank read every other
    assert after["store_calls_per_rank_per_interval"] < 3.5  # beat, news, heartbeats
    assert after["false_declarations"] == 0, after
    found = result["detection"]["8 consecutive ranks"]["all declared by rank 0 after_s"]
    assert found is not None and found < 2 * result["settings"]["bound_s"], result["detection"]
