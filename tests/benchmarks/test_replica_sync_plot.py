"""``benchmarks/replica_sync_plot.py`` draws the committed replica-sync rows: one panel per task, every row a point."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replica_sync_plot  # noqa: E402


def test_settings_are_grouped_by_mode():
    fam = replica_sync_plot.family
    assert [fam("every-step"), fam("lag, reference=average"), fam("diloco H=16"), fam("diloco H=16 q4"),
            fam("clapping-fc q4/q8 + diloco H=16 q4")] == [
        "every-step", "LAG", "DiLoCo", "DiLoCo, compressed", "Clapping-FC + DiLoCo"]


def test_the_committed_rows_are_drawn_one_point_each(tmp_path):
    pytest.importorskip("matplotlib")
    rows = json.loads((ROOT / "benchmarks" / "results" / "replica_sync.json").read_text())["rows"]
    drawn = replica_sync_plot.draw(rows, tmp_path / "plot.png")
    assert drawn == {task: sum(r["task"] == task for r in rows) for task in {r["task"] for r in rows}}
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    import matplotlib.pyplot as plt  # noqa: F401 - the figure was closed: nothing left open

    assert not plt.get_fignums()
