"""FitBottlenecks: the bottlenecks' start fitted from data at the start of training, in one process or on the
pipeline's stages (where no process holds the whole model), with the same result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import launch_forked

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

RANKS = {"single": 1, "noisy": 1, "plain": 1, "pipe": 3, "replicas": 4, "late": 3, "resume": 1, "resume_plain": 1,
         "tuner": 1, "bf16": 3, "bf16single": 1, "lopsided": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit_bottlenecks")
    for mode, ranks in RANKS.items():  # resume and resume_plain read single's and plain's checkpoints
        launch_forked("fit_bottlenecks_run.py", str(out), mode, ranks=ranks, cwd=out)
    return out


def _ranks(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"fit_{mode}_{r}.json").read_text()) for r in range(RANKS[mode])]


def _held(out: Path, mode: str) -> dict[str, torch.Tensor]:
    """Every bottleneck half, from the rank that holds it (each is held by one rank of a pipeline)."""
    held: dict[str, torch.Tensor] = {}
    for rank in _ranks(out, mode):
        for k, v in rank["held"].items():
            if k in held:
                torch.testing.assert_close(torch.tensor(v), held[k], rtol=0, atol=0)  # replicas hold the same
            held[k] = torch.tensor(v)
    return held


def test_the_callback_in_one_process_gives_fit_bottlenecks_weights(runs):
    from fit_bottlenecks_run import FitMLP, batches

    import lightning as L

    from lightning_clapping import fit_bottlenecks

    L.seed_everything(0, verbose=False)
    model = FitMLP()
    kept = fit_bottlenecks(model, batches(), run=lambda b: model.net(b[0]), positions=lambda b: b[1])
    single = _ranks(runs, "single")[0]
    assert single["kept"] == pytest.approx(kept, rel=1e-12)
    held = _held(runs, "single")
    state = model.state_dict()
    assert set(held) == {f"net.{i}.{h}.weight" for i in (2, 5) for h in ("down", "up")}
    for k, v in held.items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_the_stages_fit_the_same_weights_as_one_process(runs):
    single = _held(runs, "single")
    pipe = _held(runs, "pipe")
    assert set(pipe) == set(single)
    for k in single:
        torch.testing.assert_close(pipe[k], single[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    kept = _ranks(runs, "single")[0]["kept"]
    for rank in _ranks(runs, "pipe"):  # every rank knows every kept fraction
        assert rank["kept"] == pytest.approx(kept, rel=1e-9)


def test_no_rank_of_the_pipeline_holds_another_stage_s_half(runs):
    holders = [set(r["held"]) for r in _ranks(runs, "pipe")]
    assert sorted(map(sorted, holders)) == sorted([["net.2.down.weight"], ["net.2.up.weight", "net.5.down.weight"],
                                                   ["net.5.up.weight"]])


def test_stages_fit_bottlenecks_that_start_past_the_first_stage_or_share_one(runs):
    # stage 1 holds all of net.2 (both halves) and net.5's down; stage 0 holds no bottleneck
    single, late = _held(runs, "single"), _held(runs, "late")
    for k in single:
        torch.testing.assert_close(late[k], single[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    holders = [set(r["held"]) for r in _ranks(runs, "late")]
    assert sorted(map(sorted, holders)) == sorted([[], ["net.2.down.weight", "net.2.up.weight", "net.5.down.weight"],
                                                   ["net.5.up.weight"]])


def test_stages_fit_a_bf16_model_as_one_process_does(runs):
    single, bf16 = _held(runs, "bf16single"), _held(runs, "bf16")
    assert set(bf16) == set(single)
    for k in single:
        torch.testing.assert_close(bf16[k], single[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    assert _ranks(runs, "bf16")[0]["kept"] == pytest.approx(_ranks(runs, "bf16single")[0]["kept"], rel=1e-9)


@pytest.mark.parametrize("mode, fitted", [("replicas", slice(0, 4)), ("lopsided", slice(0, 2))])
def test_replicas_fit_on_all_their_batches_and_start_from_the_same_weights(runs, mode, fitted):
    from fit_bottlenecks_run import FitMLP, batches

    import lightning as L

    from lightning_clapping import fit_bottlenecks

    L.seed_everything(0, verbose=False)
    model = FitMLP()
    fit_bottlenecks(model, batches(n=4)[fitted], run=lambda b: model.net(b[0]), positions=lambda b: b[1])
    replicas = _held(runs, mode)  # also checks that both replicas hold identical halves
    state = model.state_dict()
    for k, v in replicas.items():  # replicas: each saw two of the four batches; lopsided: replica 1 saw none
        torch.testing.assert_close(v, state[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_pipeline_started_from_fitted_bottlenecks_trains_as_one_process(runs):
    single = _ranks(runs, "single")[0]["losses"]
    for rank in _ranks(runs, "pipe"):
        assert len(rank["losses"]) == 3 and rank["losses"] == pytest.approx(single, rel=0, abs=1e-5)


def test_training_draws_the_same_random_numbers_with_and_without_the_fit(runs):
    fitted, plain = _ranks(runs, "noisy")[0], _ranks(runs, "plain")[0]
    assert fitted["rng"] == plain["rng"]
    assert fitted["losses"] != plain["losses"]  # the fit did change the start


@pytest.mark.parametrize("mode, source", [("resume", "single"), ("resume_plain", "plain")])
def test_a_resumed_run_keeps_the_checkpoint_s_weights_instead_of_fitting_again(runs, mode, source):
    # resume: the callback's state says it fitted; resume_plain: a checkpoint of a run without the callback
    resumed = _ranks(runs, mode)[0]
    state = torch.load(runs / f"fit_{source}.ckpt", weights_only=True)["state_dict"]
    assert resumed["held"]
    for k, v in resumed["held"].items():
        torch.testing.assert_close(torch.tensor(v), state[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_a_resumed_run_keeps_the_callback_s_kept_fractions(runs):
    assert _ranks(runs, "resume")[0]["kept"] == _ranks(runs, "single")[0]["kept"]


def test_the_fit_runs_after_a_learning_rate_finder_put_the_start_back(runs):
    tuned, single = _held(runs, "tuner"), _held(runs, "single")
    for k in single:
        torch.testing.assert_close(tuned[k], single[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("mode, message", [
    ("mask", "positions(batch) must be a bool tensor shaped like the leading dimensions"),
    ("differ", "the stages of a pipeline got different batches"),
    ("nopos", "no position reaching net.2 counted on these batches"),
    ("nopos", "stage 0 could not fit net.2 (no position counted"),  # what the other stages raise
    ("small", "microbatches=2 is larger than the batch (1 samples)"),  # the fit's batches are not training's
])
def test_the_stages_refuse_what_they_cannot_fit_with_the_reason(tmp_path, mode, message):
    proc = launch_forked("fit_bottlenecks_run.py", str(tmp_path), mode, ranks=3, cwd=tmp_path, expect_ok=False,
                         timeout=120)
    assert proc.returncode != 0 and not proc.timed_out
    assert message in proc.stderr
    assert not list(tmp_path.glob("fit_*.json"))  # no rank finished training


def test_the_callback_refuses_an_iterator_of_batches():
    from lightning_clapping import FitBottlenecks

    with pytest.raises(ValueError, match="iterated more than once"):
        FitBottlenecks(iter([torch.zeros(2, 3)]))


def test_the_callback_refuses_a_strategy_that_shards_the_weights_at_setup():
    from types import SimpleNamespace

    from fit_bottlenecks_run import FitMLP, batches
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from lightning_clapping import FitBottlenecks

    fit = FitBottlenecks(batches())
    with pytest.raises(ValueError, match="FSDPStrategy shards or wraps the model's weights"):
        fit.setup(SimpleNamespace(strategy=FSDPStrategy()), FitMLP(), "fit")
    for accepted in (SingleDeviceStrategy("cpu"), DDPStrategy()):
        fit.setup(SimpleNamespace(strategy=accepted), FitMLP(), "fit")
