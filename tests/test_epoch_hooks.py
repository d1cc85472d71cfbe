"""The LightningModule's epoch-end hooks run on the last stage only: what needs every process either works from
inside them or raises at once, naming the hook and the rule (see lightning_clapping/hooks.py)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_clapping.hooks import recording_world_calls
from conftest import launch_forked


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("epoch_hooks")
    launch_forked("epoch_hooks_run.py", "save", str(out), ranks=2, cwd=out, timeout=240)
    return out


@pytest.mark.parametrize("epoch", [0, 1])
def test_save_checkpoint_in_on_train_epoch_end_saves_what_model_checkpoint_saves_there(saved, epoch):
    from _models import SequentialMLP

    hook = torch.load(saved / f"hook-epoch={epoch}.ckpt")  # torch's safe default
    mc = torch.load(saved / "mc" / f"mc-epoch={epoch}.ckpt")
    assert (hook["epoch"], hook["global_step"]) == (mc["epoch"], mc["global_step"]) == (epoch, 4 * (epoch + 1))
    assert hook["state_dict"].keys() == mc["state_dict"].keys()  # the whole model: both stages
    assert all(torch.equal(hook["state_dict"][k], mc["state_dict"][k]) for k in mc["state_dict"])
    assert str(hook["optimizer_states"]) == str(mc["optimizer_states"])
    model = SequentialMLP.load_from_checkpoint(saved / f"hook-epoch={epoch}.ckpt")
    assert all(torch.equal(v, mc["state_dict"][k]) for k, v in model.state_dict().items())


def test_values_logged_with_sync_dist_in_an_epoch_end_hook_reach_every_rank(saved):
    for rank in (0, 1):
        assert json.loads((saved / f"save_rank{rank}.json").read_text())["hook_value"] == 11.0


def test_should_stop_set_in_an_epoch_end_hook_stops_every_stage(saved):
    # the stage that did not run the hook stops with the one that did (else it would wait for a step forever)
    for rank in (0, 1):
        assert json.loads((saved / f"save_rank{rank}.json").read_text())["stopped_after"] == 1


def test_a_barrier_in_an_epoch_end_hook_raises_at_once_with_the_hook_and_the_rule(tmp_path):
    started = time.monotonic()
    proc = launch_forked("epoch_hooks_run.py", "barrier", str(tmp_path), ranks=2, cwd=tmp_path, timeout=120,
                         expect_ok=False)
    elapsed = time.monotonic() - started
    assert not proc.timed_out and all(code != 0 for code in proc.returncodes), proc.returncodes
    assert "on_validation_epoch_end called strategy.barrier()" in proc.stderr
    assert "run on the last pipeline stage only" in proc.stderr and "Callback's on_validation_epoch_end" in proc.stderr
    # the other stage learned of it from the message after the hook, not from a timeout (30 s)
    assert "on_validation_epoch_end raised on global rank 0" in proc.stderr
    assert "Timed out" not in proc.stderr
    assert elapsed < 30, f"took {elapsed:.0f} s: a rank waited for the timeout"


def test_inside_the_hook_world_collectives_raise_and_save_checkpoint_is_recorded():
    strategy = SimpleNamespace(barrier=None, broadcast=None, reduce_boolean_decision=None)
    trainer = SimpleNamespace(strategy=strategy, save_checkpoint=None)
    calls = []
    with recording_world_calls("on_test_epoch_end", trainer, calls):
        for name, args in (("barrier", ()), ("broadcast", ("x",)), ("reduce_boolean_decision", (True,))):
            with pytest.raises(RuntimeError, match=rf"on_test_epoch_end called strategy\.{name}\(\).*last pipeline"):
                getattr(trainer.strategy, name)(*args)
        trainer.save_checkpoint("a.ckpt", weights_only=True)
        with pytest.raises(TypeError, match="storage_options to be JSON data"):
            trainer.save_checkpoint("b.ckpt", storage_options=object())
    assert calls == [{"filepath": "a.ckpt", "weights_only": True, "storage_options": None}]
    assert trainer.save_checkpoint is None and strategy.barrier is None  # put back after the hook
