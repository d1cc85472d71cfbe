"""The bottleneck study's benchmark pieces: quality.py's widening settings build the schedule they name, and
cut_energy.py reports a spectrum's kept fractions and directions correctly and records every cut at every point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, script_env

ENV = script_env(ROOT, ROOT / "benchmarks")  # beside quality.py, as a user starts it

sys.path.insert(0, str(ROOT / "benchmarks"))
from _bottleneck_variants import OPT_IN_CONFIGS, VARIANT_BOTTLENECKS, WIDENING, variant_callbacks  # noqa: E402

from lightning_clapping import Bottleneck  # noqa: E402


def test_a_widening_setting_codes_its_earlier_width_then_the_full_rank_from_its_fraction_of_the_steps():
    model = torch.nn.Sequential(torch.nn.Linear(4, 128), Bottleneck(128, 64), torch.nn.Linear(128, 4),
                                Bottleneck(128, 64))
    [sched] = variant_callbacks("bn8-to-bn2 moderate", model, 480)
    assert WIDENING["bn8-to-bn2 moderate"] == (2, 8, 0.7) and VARIANT_BOTTLENECKS["bn8-to-bn2 moderate"][0] == 2
    assert sched.scheduling == {0: 16, 336: 64}
    assert variant_callbacks("bn8 residual q8", model, 480) == []
    assert {s for _, _, s in OPT_IN_CONFIGS} >= set(WIDENING)  # run only where --configs names them


def test_the_spectrum_summary_counts_kept_energy_and_directions():
    code = ("import json, torch\nfrom cut_energy import spectrum_summary\n"
            "values = torch.tensor([8.0, 4.0, 2.0, 1.0] + [0.0625] * 12, dtype=torch.float64)\n"
            "q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))\n"
            "print(json.dumps(spectrum_summary(q @ torch.diag(values) @ q.t())))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    total = 15.0 + 12 * 0.0625  # 15.75
    assert s["kept"]["d/16"] == pytest.approx(8 / total) and s["kept"]["d/4"] == pytest.approx(15 / total)
    assert s["kept"]["d/8"] == pytest.approx(12 / total) and s["kept"]["d/2"] == pytest.approx(15.25 / total)
    assert s["directions"] == {"90 %": 4, "95 %": 4, "99 %": 14}
    assert 1 < s["effective_rank"] < 16 and sum(s["eigenvalues"]) == pytest.approx(1.0)


def test_cut_energy_records_every_cut_at_step_0_and_each_point(tmp_path):
    out = tmp_path / "energy.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cut_energy.py"), "--tasks", "shakespeare",
                           "--steps-scale", "0.05", "--points", "2", "--out", str(out)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=600)
    if "Shakespeare" in proc.stderr and "install" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["shakespeare"]
    assert result["steps"] == 6 and [p["step"] for p in result["points"]] == [0, 3, 6]
    for point in result["points"]:
        assert list(point["cuts"]) == ["blocks.1", "blocks.2", "blocks.3"]
        for s in point["cuts"].values():
            kept = list(s["kept"].values())
            assert kept == sorted(kept) and 0 < kept[0] and kept[-1] <= 1 + 1e-9 and len(s["eigenvalues"]) == 128


def test_the_energy_ranks_share_out_the_uniform_budget_in_proportion_to_each_cut_s_directions():
    from _bottleneck_variants import shared_out, variant_model

    assert shared_out(96, [77, 67, 53]) == [37, 33, 26] and shared_out(96, [1, 1, 1]) == [32, 32, 32]
    assert sum(shared_out(72, [61, 51, 40])) == 72 and shared_out(10, [100, 1]) == [9, 1]
    assert shared_out(12, [100, 1, 1]) == [10, 1, 1]  # the minimum of 1 each taken back from the largest share
    model = torch.nn.Sequential(Bottleneck(128, 32), torch.nn.Linear(128, 128), Bottleneck(128, 32),
                                torch.nn.Linear(128, 128), Bottleneck(128, 32))
    variant_model("bn4 energy moderate", model, "shakespeare")  # from the committed results/cut_energy.json
    ranks = [m.rank for m in model if isinstance(m, Bottleneck)]
    assert sum(ranks) == 96 and ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]
