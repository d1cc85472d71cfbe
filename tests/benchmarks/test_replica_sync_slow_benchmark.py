"""``benchmarks/replica_sync_slow.py``'s options (its runs need root and minutes: the script's ``--tiny`` covers them):
every-step's own timing window, and a task per run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replica_sync_slow  # noqa: E402


def test_every_step_alone_takes_the_baseline_window_and_the_others_keep_three_intervals():
    args = replica_sync_slow.parse_args(["--task", "wordnet_minilm", "--steps", "64", "--baseline-steps", "6"])
    assert replica_sync_slow.timing_steps(args, "every-step") == (6, 2)
    assert replica_sync_slow.timing_steps(args, "diloco H=16 q4") == (48, 16)
    default = replica_sync_slow.parse_args([])
    assert replica_sync_slow.timing_steps(default, "every-step") == (48, 16)


def test_a_baseline_window_with_nothing_left_to_time_is_refused():
    with pytest.raises(SystemExit, match="--baseline-steps"):
        replica_sync_slow.parse_args(["--baseline-steps", "2"])


def test_the_task_sets_the_split_and_the_estimate():
    args = replica_sync_slow.parse_args(["--task", "wordnet_minilm", "--steps", "64"])
    assert replica_sync_slow.base_config(args)["split_points"] == ["encoder.encoder.layer.3"]
    assert replica_sync_slow.base_config(args)["task"] == "wordnet_minilm"
    link = replica_sync_slow.parse_link("25@25")
    tasks = replica_sync_slow.SLOW_TASKS
    every = {t: replica_sync_slow.estimate_step_s(tasks[t], "every-step", {}, link, "sites") for t in tasks}
    # 69 MB of averaging a step at 25 Mbit/s against 1.7 MB: the fine-tuning task's every-step is the slower by far
    assert every["wordnet_minilm"] > 10 * every["shakespeare"]


def test_plain_averaging_settings_carry_outer_lr_one_and_no_momentum():
    settings = replica_sync_slow.make_settings(16)
    sync = settings["clapping-fc q4/q8 + diloco H=16 avg q4"]["replica_sync"]
    assert sync == {"mode": "diloco", "inner_steps": 16, "codec": "q4", "outer_lr": 1.0, "momentum": 0.0}
    from lightning_clapping.sync.config import resolve

    assert resolve(sync).momentum == 0.0
