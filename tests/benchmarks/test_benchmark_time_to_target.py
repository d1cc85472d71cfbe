"""Time to target against bandwidth (benchmarks/time_to_target.py): how step times measured on each link and loss
trajectories measured once on loopback combine. Pure: hand-made slow_network records, no process is started."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import time_to_target as ttt  # noqa: E402

FC, FU, AUTO = "clapping-fc p=0.5", "clapping-fu p=0.5", "auto p=0.5"


def _args():
    return ttt.parse_args([])


def _timing(rate, variant, kind, mean, median=None, choice=None, error=None):
    """One short run on a shaped link, as slow_network's JSON holds it."""
    return {"link": f"{rate:g} Mbit/s 25 ms", "rate_mbit": rate, "delay_ms": 25.0, "variant": variant, "kind": kind,
            "error": error, "mean_step_s": mean, "median_step_s": median if median is not None else mean,
            "steps": 25, "autotune_choice": choice, "other_cores": 0.0}


def _trajectory(variant, kind, losses, every=10):
    """One full-length run on loopback: a validation every ``every`` steps."""
    vals = [{"step": every * (i + 1), "val_loss": x} for i, x in enumerate(losses)]
    return {"link": "loopback", "rate_mbit": None, "variant": variant, "kind": kind, "error": None,
            "steps": every * len(losses), "vals": vals, "final_val_loss": losses[-1], "other_cores": 0.0}


def _uniform(fwd, bwd, boundaries=3):
    return {str(b): {"fwd": fwd, "bwd": bwd} for b in range(boundaries)}


TRAJECTORIES = [
    _trajectory("uncompressed", "uncompressed", [3.0, 2.6, 2.5]),  # target 2.5, at step 30
    _trajectory("direct", "direct", [3.1, 2.8, 2.7, 2.6, 2.55, 2.52]),  # never gets there
    _trajectory(FC, "clapping-fc", [3.0, 2.7, 2.55, 2.5, 2.4]),  # step 40 (at the target counts)
    _trajectory(f"{FC} bf16/q8", "clapping-fc", [3.0, 2.6, 2.45]),  # step 30
    _trajectory(FU, "clapping-fu", [3.0, 2.65, 2.49]),  # step 30
]


def _by(result, link_rate, setting):
    return next(r for r in result["rows"] if r["rate_mbit"] == link_rate and r["setting"] == setting)


def test_steps_to_target_is_the_first_validation_at_or_below_the_target():
    vals = [{"step": 10, "val_loss": 3.0}, {"step": 20, "val_loss": 2.5}, {"step": 30, "val_loss": 2.4},
            {"step": 40, "val_loss": 2.3}]
    assert ttt.steps_to_target(vals, 2.5) == 20  # equal to the target is reached
    assert ttt.steps_to_target(vals, 2.45) == 30  # the first one below, not a later one
    assert ttt.steps_to_target(vals, 2.0) is None
    assert ttt.steps_to_target([{"step": 5, "val_loss": None}, *vals], 3.5) == 10  # a missing loss is skipped


def test_the_target_is_uncompresseds_loss_at_its_last_step():
    result = ttt.combine([_timing(10, "uncompressed", "uncompressed", 5.0)], TRAJECTORIES, _args())
    assert result["target_val_loss"] == 2.5
    assert _by(result, 10, "uncompressed")["steps_to_target"] == 30
    # its last loss, not its best: a noisy run that dipped below earlier reaches its own target there
    noisy = [_trajectory("uncompressed", "uncompressed", [3.0, 2.45, 2.6, 2.5]), *TRAJECTORIES[1:]]
    result = ttt.combine([_timing(10, "uncompressed", "uncompressed", 5.0)], noisy, _args())
    assert result["target_val_loss"] == 2.5
    assert _by(result, 10, "uncompressed")["steps_to_target"] == 20


def test_time_to_target_is_steps_times_the_mean_step_time_on_that_link():
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0, median=4.0),
            _timing(10, FU, "clapping-fu", 3.0, median=1.0),  # fresh steps slow, reuse steps fast: the mean counts
            _timing(100, "uncompressed", "uncompressed", 0.7),
            _timing(100, FU, "clapping-fu", 0.6)]
    result = ttt.combine(runs, TRAJECTORIES, _args())
    assert _by(result, 10, "uncompressed")["time_to_target_s"] == pytest.approx(30 * 5.0)
    assert _by(result, 10, FU)["time_to_target_s"] == pytest.approx(30 * 3.0)
    assert _by(result, 100, FU)["time_to_target_s"] == pytest.approx(30 * 0.6)
    assert _by(result, 10, FU)["x_uncompressed"] == pytest.approx(5.0 / 3.0)
    assert _by(result, 100, FU)["x_uncompressed"] == pytest.approx(0.7 / 0.6)


def test_a_setting_that_never_reaches_the_target_is_reported_as_such_not_as_a_number(tmp_path, capsys):
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, "direct", "direct", 0.5)]
    result = ttt.combine(runs, TRAJECTORIES, _args())
    direct = _by(result, 10, "direct")
    assert direct["steps_to_target"] is None and direct["time_to_target_s"] is None
    assert direct["x_uncompressed"] is None and not direct["first"]
    assert direct["status"] == "not reached in 60 steps"
    assert result["first"]["10 Mbit/s 25 ms"] == "uncompressed"  # the fastest per step, but it never got there
    ttt.print_table(result)
    line = next(x for x in capsys.readouterr().out.splitlines() if "direct" in [c.strip() for c in x.split("|")])
    assert "not reached in 60 steps" in line
    ttt.write_results(result, tmp_path, "t")
    row = next(r for r in csv.DictReader(open(tmp_path / "t.csv")) if r["setting"] == "direct")
    assert row["time_to_target_s"] == "" and row["status"] == "not reached in 60 steps"


def test_auto_takes_the_trajectory_of_its_own_choice_on_each_link():
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, AUTO, "clapping-fc", 1.0,
                                                                      choice=_uniform("q4", "q8")),
            _timing(100, "uncompressed", "uncompressed", 0.7), _timing(100, AUTO, "clapping-fc", 0.6,
                                                                       choice=_uniform("bf16", "q8"))]
    result = ttt.combine(runs, TRAJECTORIES, _args())
    slow, fast = _by(result, 10, AUTO), _by(result, 100, AUTO)
    assert (slow["trajectory"], slow["steps_to_target"], slow["auto_choice"]) == (FC, 40, "q4/q8")
    assert (fast["trajectory"], fast["steps_to_target"]) == (f"{FC} bf16/q8", 30)
    assert fast["time_to_target_s"] == pytest.approx(30 * 0.6)
    # only the choice that is not the main clapping-fc needs a run of its own
    assert ttt.auto_pairs(runs, _args()) == ["bf16/q8"]


def test_auto_without_a_recorded_choice_or_a_run_of_it_gets_no_number():
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, AUTO, "clapping-fc", 1.0),
            _timing(25, "uncompressed", "uncompressed", 2.0), _timing(25, AUTO, "clapping-fc", 1.0,
                                                                      choice=_uniform("q8", "q8"))]
    result = ttt.combine(runs, TRAJECTORIES, _args())
    assert _by(result, 10, AUTO)["status"] == "auto recorded no choice"
    missing = _by(result, 25, AUTO)
    assert missing["time_to_target_s"] is None and missing["status"].startswith("no trajectory")


def test_a_choice_that_differs_per_boundary_is_passed_on_as_per_boundary_codecs():
    mixed = {"0": {"fwd": "uncompressed", "bwd": "uncompressed"}, "1": {"fwd": "q4", "bwd": "q8"},
             "2": {"fwd": "uncompressed", "bwd": "uncompressed"}}
    assert ttt.choice_pair(mixed) == "-,q4,-/-,q8,-"
    assert ttt.choice_pair(_uniform("bf16", "q8")) == "bf16/q8"
    assert ttt.choice_pair(_uniform("uncompressed", "q8")) == "-,-,-/q8"
    # boundaries in their order, whatever order the JSON kept
    assert ttt.codec_string({"10": {"fwd": "q4"}, "2": {"fwd": "q8"}}, "fwd") == "q8,q4"
    command = ttt.trajectory_command(_args(), ["-,q4,-/-,q8,-"])
    assert command[command.index("--fc-extra") + 1] == "-,q4,-/-,q8,-"
    runs = [_timing(10, AUTO, "clapping-fc", 1.0, choice=mixed)]
    assert ttt.combine(runs, TRAJECTORIES, _args())["rows"][0]["trajectory"] == f"{FC} -,q4,-/-,q8,-"


def test_the_fastest_setting_per_link_is_named():
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, FC, "clapping-fc", 1.0),
            _timing(10, FU, "clapping-fu", 2.0),  # 30 x 2.0 = 60 s against clapping-fc's 40 x 1.0 = 40 s
            _timing(100, "uncompressed", "uncompressed", 0.5), _timing(100, FC, "clapping-fc", 0.45),
            _timing(100, FU, "clapping-fu", 0.55)]  # 15 s, against 18 and 16.5
    result = ttt.combine(runs, TRAJECTORIES, _args())
    assert result["first"] == {"10 Mbit/s 25 ms": FC, "100 Mbit/s 25 ms": "uncompressed"}
    assert [r["setting"] for r in result["rows"] if r["first"]] == [FC, "uncompressed"]


def test_a_failed_step_time_run_is_reported_and_ranks_nowhere():
    runs = [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, FC, "clapping-fc", None, error="boom")]
    result = ttt.combine(runs, TRAJECTORIES, _args())
    failed = _by(result, 10, FC)
    assert failed["time_to_target_s"] is None and failed["status"] == "step-time run failed: boom"
    assert result["first"]["10 Mbit/s 25 ms"] == "uncompressed"


def test_from_json_recombines_saved_results_without_running_anything(tmp_path):
    steps = {"settings": {"command": "slow_network.py --links 10@25", "schedule": "gpipe", "steps": 25, "skip": 5},
             "machine": {"cpu": "test"}, "links": [{"link": "10 Mbit/s 25 ms", "verdict": "ok"}],
             "runs": [_timing(10, "uncompressed", "uncompressed", 5.0), _timing(10, FC, "clapping-fc", 1.0)]}
    trajectories = {"settings": {"command": "slow_network.py --loopback-only", "steps": 30, "budget": 1.6,
                                 "val_every": 10, "val_batches": 4}, "machine": {"cpu": "test"},
                    "runs": TRAJECTORIES}
    (tmp_path / "a.json").write_text(json.dumps(steps))
    (tmp_path / "b.json").write_text(json.dumps(trajectories))
    assert ttt.main(["--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path),
                     "--stem", "r"]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["first"] == {"10 Mbit/s 25 ms": FC}
    assert saved["commands"] == {"step_times": "slow_network.py --links 10@25",
                                 "trajectories": "slow_network.py --loopback-only"}
    assert saved["link_checks"] == steps["links"] and saved["machine"]["step_times"] == {"cpu": "test"}
    assert (tmp_path / "r.csv").exists() and (tmp_path / "r.png").exists()


def test_per_boundary_codecs_that_an_older_slow_network_refuses_are_left_out_of_the_retry():
    # argparse reads a separate argument that begins with "-" as an unknown option
    assert ttt.runnable_pairs(["bf16/q8", "-,q4,-/-,q8,-", "q8/-,-,-"]) == ["bf16/q8", "q8/-,-,-"]


def test_the_default_run_is_estimated_to_fit_in_40_minutes():
    timing, trajectories = ttt.estimate_seconds(_args(), auto_extra=2)  # auto: two choices besides q4/q8
    assert timing + trajectories < 40 * 60
    # and the estimate grows with what is asked (it is not a constant)
    longer = ttt.parse_args(["--timing-steps", "60", "--steps", "500"])
    assert sum(ttt.estimate_seconds(longer, auto_extra=2)) > timing + trajectories + 10 * 60


def test_fu_and_auto_can_be_left_out_of_both_phases():
    default = ttt.parse_args([])
    assert ttt.timing_command(default)[ttt.timing_command(default).index("--fu-p") + 1] == "0.5"
    assert "--no-auto" not in ttt.timing_command(default)
    args = ttt.parse_args(["--no-fu", "--no-auto"])
    for cmd in (ttt.timing_command(args), ttt.trajectory_command(args, [])):
        after = cmd[cmd.index("--fu-p") + 1]
        assert after.startswith("--"), cmd  # --fu-p without values: slow_network runs no clapping-fu
        assert "--no-auto" in cmd
