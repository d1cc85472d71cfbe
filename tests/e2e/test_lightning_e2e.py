"""Lightning behaves as without the strategy: the same runs on 3 pipeline stages and on one device agree."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from _models import SequentialMLP
from conftest import launch_forked

CONFIGS = "base,accumulate,clip,earlystop,syncdist,metrics,resume_full,resume_first,resume_rest"
STAGES = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    # the launching process forked, its launcher starting the other stages as a user's run does: the module this
    # process passed to fit is the one test_launching_process_module_holds_the_full_trained_weights reads
    launch_forked("fit_run.py", "pipe", str(out), CONFIGS, ranks=None, cwd=out, timeout=600)
    launch_forked("fit_run.py", "single", str(out), CONFIGS, ranks=1, cwd=out, timeout=600)
    return out


def _result(out: Path, name: str, mode: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}_{mode}_rank{rank}.json").read_text())


def _weights(out: Path, name: str, mode: str) -> dict:
    return torch.load(out / f"weights_{name}_{mode}.pt")


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _assert_same_run(out: Path, name: str) -> None:
    single, pipe = _result(out, name, "single"), _result(out, name, "pipe")
    assert pipe["global_step"] == single["global_step"]
    assert pipe["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    _assert_same_weights(_weights(out, name, "pipe"), _weights(out, name, "single"))


def test_fit_matches_single_device_losses_metrics_and_weights(runs):
    _assert_same_run(runs, "base")
    single, pipe = _result(runs, "base", "single"), _result(runs, "base", "pipe")
    for key in ("val_loss", "val_acc"):
        assert pipe["callback_metrics"][key] == pytest.approx(single["callback_metrics"][key], rel=1e-5)


def test_smaller_last_batch_trains_and_validates_correctly(runs):
    # 70 training samples in batches of 16: every 5th step sees 6 samples; 30 validation samples: 16 + 14
    single, pipe = _result(runs, "base", "single"), _result(runs, "base", "pipe")
    assert len(pipe["losses"]) == 15
    last_batches = [4, 9, 14]
    assert [pipe["losses"][i] for i in last_batches] == pytest.approx(
        [single["losses"][i] for i in last_batches], rel=1e-5)
    assert pipe["callback_metrics"]["val_loss"] == pytest.approx(single["callback_metrics"]["val_loss"], rel=1e-5)


def test_gradient_accumulation_matches_single_device(runs):
    _assert_same_run(runs, "accumulate")
    assert _result(runs, "accumulate", "pipe")["global_step"] == 6  # 2 epochs x ceil(5 batches / 2)


def test_gradient_clipping_by_norm_uses_the_whole_model(runs):
    _assert_same_run(runs, "clip")


def test_logged_metrics_are_identical_on_every_rank(runs):
    metrics = [_result(runs, "base", "pipe", r)["callback_metrics"] for r in range(STAGES)]
    assert {"train_loss", "val_loss", "val_acc", "clapping/bytes"} <= metrics[0].keys()
    assert all(m == metrics[0] for m in metrics)


def test_rank0_loggers_receive_training_validation_and_byte_metrics(runs):
    pipe = _result(runs, "base", "pipe")
    with open(pipe["csv"]) as f:
        rows = list(csv.DictReader(f))
    columns = rows[0].keys()
    assert {"train_loss", "val_loss", "clapping/b0_fwd_bytes", "clapping/b1_bwd_bytes", "clapping/bytes"} <= columns
    train_rows = [r for r in rows if r["train_loss"]]
    assert len(train_rows) == 15  # log_every_n_steps=1, 15 steps
    single = _result(runs, "base", "single")
    assert [float(r["train_loss"]) for r in train_rows] == pytest.approx(single["losses"], rel=1e-5)
    assert list(Path(pipe["tb"]).glob("events.out.tfevents.*")), "no TensorBoard event file on rank 0"


def test_early_stopping_and_monitored_checkpoint_agree_with_single_device(runs):
    single = _result(runs, "earlystop", "single")
    for r in range(STAGES):
        pipe = _result(runs, "earlystop", "pipe", r)
        assert pipe["epochs_run"] == single["epochs_run"] < 20
        assert Path(pipe["best_model_path"]).name == Path(single["best_model_path"]).name
        assert pipe["best_model_score"] == pytest.approx(single["best_model_score"], rel=1e-5)
    assert Path(_result(runs, "earlystop", "pipe")["best_model_path"]).exists()


def test_sync_dist_logging_works(runs):
    single, pipe = _result(runs, "syncdist", "single"), _result(runs, "syncdist", "pipe")
    assert pipe["callback_metrics"]["val_loss"] == pytest.approx(single["callback_metrics"]["val_loss"], rel=1e-5)


def test_torchmetrics_objects_give_the_single_device_epoch_values_on_every_rank(runs):
    single = _result(runs, "metrics", "single")["callback_metrics"]
    for r in range(STAGES):
        metrics = _result(runs, "metrics", "pipe", r)["callback_metrics"]
        for key in ("train_acc", "val_acc"):
            assert metrics[key] == pytest.approx(single[key], rel=1e-6), (r, key)


def test_resume_from_mid_run_checkpoint_reproduces_the_uninterrupted_run(runs):
    full, rest = _result(runs, "resume_full", "pipe"), _result(runs, "resume_rest", "pipe")
    assert len(rest["losses"]) == 10
    assert rest["losses"] == pytest.approx(full["losses"][-10:], rel=1e-6, abs=1e-7)
    _assert_same_weights(_weights(runs, "resume_rest", "pipe"), _weights(runs, "resume_full", "pipe"))


def test_checkpoint_loads_into_the_plain_module_without_the_strategy(runs):
    pipe, single = _result(runs, "base", "pipe"), _result(runs, "base", "single")
    model = SequentialMLP.load_from_checkpoint(pipe["best_model_path"], map_location="cpu")
    reference = SequentialMLP.load_from_checkpoint(single["best_model_path"], map_location="cpu")
    _assert_same_weights(model.state_dict(), reference.state_dict())
    ckpt = torch.load(pipe["best_model_path"], weights_only=False)
    assert set(ckpt["state_dict"]) == set(reference.state_dict())
    assert len(ckpt["optimizer_states"][0]["state"]) == len(list(reference.parameters()))


def test_test_and_predict_match_single_device(runs):
    single = _result(runs, "base", "single")
    for r in range(STAGES):
        assert _result(runs, "base", "pipe", r)["test"][0]["test_acc"] == pytest.approx(single["test"][0]["test_acc"])
    assert torch.equal(torch.load(runs / "preds_base_pipe.pt"), torch.load(runs / "preds_base_single.pt"))


def test_launching_process_module_holds_the_full_trained_weights(runs):
    weights = _weights(runs, "base", "pipe")
    assert all(t.device.type == "cpu" for t in weights.values())
    _assert_same_weights(weights, _weights(runs, "base", "single"))
