"""Patterns of real Lightning projects behave under the strategy as in one process (Lightning's defaults)."""

from __future__ import annotations

import json
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import SCRIPTS, launch_forked

sys.path.insert(0, str(SCRIPTS))


def _row(out, case, mode, rank=0):
    return json.loads((out / f"{case}_{mode}_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases that train to the end, in one launch on 2 stages and one on a single device; each test reads its
    own case (and the batchnorm test the pipeline launch's stderr)."""
    out = tmp_path_factory.mktemp("fidelity")
    pipe = launch_forked("fidelity_run.py", str(out), "rng,batchnorm,hparams,epochend", "pipe", ranks=2, cwd=out,
                         timeout=600)
    launch_forked("fidelity_run.py", str(out), "hparams,epochend", "single", ranks=1, cwd=out, timeout=300)
    return SimpleNamespace(out=out, pipe_stderr=pipe.stderr)


def test_stages_train_on_the_same_batches_when_they_consume_the_global_rng_differently(runs):
    last, first = _row(runs.out, "rng", "pipe", 0)["labels"], _row(runs.out, "rng", "pipe", 1)["labels"]
    assert len(last) > 12  # 3 lazy epochs of 4 fresh batches each (and reuse steps)
    assert last == first
    assert len({tuple(b) for b in last}) > 4  # reshuffled between epochs


def test_a_stage_fed_other_data_stops_the_run_with_the_reason(tmp_path):
    proc = launch_forked("fidelity_run.py", str(tmp_path), "otherdata", "pipe", ranks=2, cwd=tmp_path, expect_ok=False,
                         timeout=240)
    assert proc.returncode != 0
    assert "trained on another batch than the last stage at step 0" in proc.stderr


def test_batchnorm_with_micro_batches_is_warned_about(runs):
    assert "1 BatchNorm layers (net.1) see one micro-batch at a time" in runs.pipe_stderr


def test_hyperparameters_holding_the_network_checkpoint_as_in_one_process(runs):
    from fidelity_run import NetHolder

    out = runs.out
    trained = torch.load(out / "hparams_pipe_weights.pt")
    single = torch.load(out / "hparams_single_weights.pt")
    loaded = NetHolder.load_from_checkpoint(_row(out, "hparams", "pipe")["checkpoint"], weights_only=False)
    assert isinstance(loaded.hparams.net, torch.nn.Sequential)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
        torch.testing.assert_close(tensor, single[name], rtol=1e-5, atol=1e-6)
    # the network saved in the hyperparameters is whole as well (it is what load_from_checkpoint rebuilds from)
    saved = torch.load(_row(out, "hparams", "pipe")["checkpoint"], weights_only=False)["hyper_parameters"]
    for name, tensor in saved["net"].state_dict().items():
        assert torch.equal(tensor, trained[f"net.{name}"]), name


def test_epoch_end_hooks_on_collected_step_outputs_log_as_in_one_process_and_every_rank_gets_predictions(runs):
    single = _row(runs.out, "epochend", "single")
    for rank in (0, 1):
        pipe = _row(runs.out, "epochend", "pipe", rank)
        for key in ("train_epoch_loss", "val_acc"):  # sync_dist=True: not divided by the number of stages
            assert pipe["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5), (rank, key)
        assert pipe["checkpoint"].endswith(single["checkpoint"].rpartition("/")[2])  # monitored val_acc
        torch.testing.assert_close(torch.tensor(pipe["predictions"]), torch.tensor(single["predictions"]))


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout": 60}, "timeout must be a positive datetime.timedelta"),
    ({"max_skips": -1}, "max_skips must be a non-negative integer"),
    ({"max_skips": 1.5}, "max_skips must be a non-negative integer"),
    ({"lazy_messages": float("inf")}, "lazy_messages must be a positive finite threshold"),
    ({"split_points": []}, r"split_points=\[\] makes one stage"),
    ({"fresh_codec": "q8"}, "fresh_codec applies to the error-feedback variants"),
    ({"autotune": True}, "autotune=True chooses codecs for a compressed variant"),
    ({"schedule": "auto", "variant": "clapping-fc"}, "schedule='auto' lets autotune choose the schedule"),
    ({"liveness": 30}, "liveness must be a datetime.timedelta"),
    ({"forward_codec": {-1: "q4"}}, "forward_codec: keys are boundary indices"),
    ({"backward_codec": {0: "q99"}}, "q99"),
    ({"recheck_every": 0}, "recheck_every must be a positive number of training steps, or None"),
])
def test_arguments_are_checked_when_the_strategy_is_built(kwargs, match):
    import lightning_clapping

    with pytest.raises(ValueError, match=match):
        lightning_clapping.ClappingStrategy(**kwargs)


def test_parameters_on_the_lightning_module_are_trained_and_saved_by_the_stage_that_uses_them(tmp_path):
    for mode, ranks in (("pipe", 3), ("single", 1)):
        launch_forked("root_params_run.py", str(tmp_path), "owned", mode, ranks=ranks, cwd=tmp_path)
    pipe, single = (torch.load(tmp_path / f"owned_{m}.pt") for m in ("pipe", "single"))
    assert json.loads((tmp_path / "owned_pipe.json").read_text())["losses"] == pytest.approx(
        json.loads((tmp_path / "owned_single.json").read_text())["losses"], abs=1e-5)
    for part in ("weights", "checkpoint"):  # pos: stage 0 of 3; out_scale: the last stage
        assert pipe[part].keys() == single[part].keys()
        for key, value in single[part].items():
            torch.testing.assert_close(pipe[part][key], value, atol=1e-5, rtol=0, msg=f"{part} {key}")


def test_a_parameter_on_the_lightning_module_used_by_two_stages_is_refused_with_the_reason(tmp_path):
    proc = launch_forked("root_params_run.py", str(tmp_path), "twice", "pipe", ranks=3, cwd=tmp_path, expect_ok=False,
                         timeout=240)
    assert proc.returncode != 0
    assert "'pos' sits directly on a module whose forward runs on several stages, and stages 0 and 2 both use it" \
        in proc.stderr



def test_split_points_that_leave_a_stage_without_parameters_are_warned_about():
    from _models import SequentialMLP

    import lightning_clapping
    from lightning_clapping.pipeline.partition import build_partition
    from lightning_clapping.stage_setup import warn_empty_stages

    strategy = lightning_clapping.ClappingStrategy(split_points=["net.1", "net.2"])
    strategy.parallel_devices = [torch.device("cpu")] * 3
    strategy.partition = build_partition(SequentialMLP(), 3, ["net.1", "net.2"])  # stage 1 is net.1, a Tanh
    with pytest.warns(UserWarning, match=r"stage\(s\) 1 \(from 'net.1'\) hold no parameters"):
        warn_empty_stages(strategy.partition, strategy.num_stages)
    strategy.partition = build_partition(SequentialMLP(), 3, ["net.2", "net.4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_empty_stages(strategy.partition, strategy.num_stages)


def test_feedback_buffers_from_other_cut_points_restart_empty_with_a_warning():
    from types import SimpleNamespace

    from _models import SequentialMLP

    import lightning_clapping
    from lightning_clapping.pipeline.partition import build_partition

    loaded = []
    rule = SimpleNamespace(load_state=lambda state, device: loaded.append(state))
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.2", "net.4"])
    strategy.parallel_devices = [torch.device("cpu")] * 3
    strategy.partition = build_partition(SequentialMLP(), 3, ["net.2", "net.4"])
    strategy.executor = SimpleNamespace(rules={"bwd_in": rule})
    buffers = {f"stage{strategy.stage}": {"bwd_in": {"slot0": torch.ones(2)}}}
    with pytest.warns(UserWarning, match=r"cut at \['net.4'\] and this run at \['net.2', 'net.4'\].*restart empty"):
        strategy._restore_feedback({"clapping": {"cut_points": ["net.4"]}, "clapping_feedback": buffers})
    assert loaded == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._restore_feedback({"clapping": {"cut_points": ["net.2", "net.4"]}, "clapping_feedback": buffers})
    assert len(loaded) == 1 and torch.equal(loaded[0]["slot0"], torch.ones(2))


def test_a_codec_map_naming_a_boundary_the_model_lacks_is_refused_at_setup():
    import lightning_clapping

    strategy = lightning_clapping.ClappingStrategy(variant="clapping-fc", forward_codec={0: "q4", 5: "q4"})
    strategy.parallel_devices = [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match=r"forward_codec names boundaries \[5\], but 3 stages have boundaries 0 .. 1"):
        strategy.options.check_codec_boundaries(strategy.num_stages)
    strategy.forward_codec = {1: strategy.forward_codec[0]}
    strategy.options.check_codec_boundaries(strategy.num_stages)
