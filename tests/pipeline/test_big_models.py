"""Models larger than one process: built on the meta device, each rank materializes, saves and loads only its stage."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import lightning_clapping
from conftest import ROOT, launch_forked
from examples.big_model import WideMLP
from lightning_clapping.checkpoint.state import check_model_keys
from lightning_clapping.pipeline.materialize import MaterializeError, materialize, materialize_module

SMALL = {"BIG_WIDTH": "1024", "BIG_LAYERS": "4"}  # the checkpoint runs: 4 blocks + head, one block per stage


def _rows(out, name, ranks):
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """4 stages train 3 steps and save a sharded checkpoint; 2 stages resume it for one more step."""
    out = tmp_path_factory.mktemp("big")
    launch_forked("bigmodel_run.py", str(out), "a", "4", "3", ranks=4, cwd=out, env=SMALL)
    launch_forked("bigmodel_run.py", str(out), "b", "2", "4", "--resume", str(out / "a.ckpt"), ranks=2, cwd=out,
                  env=SMALL)
    return out


def _owner_stage(name: str) -> int:
    return 3 if name.startswith("head.") else int(name.split(".")[1])


def test_configure_model_ranks_materialize_only_their_own_stage(sharded_runs):
    for row in _rows(sharded_runs, "a", 4):
        assert set(row["devices"]) == {n for n, _ in WideMLP(1024, 4, eager=True).named_parameters()}
        for name, device in row["devices"].items():
            assert device == ("cpu" if _owner_stage(name) == row["stage"] else "meta"), (row["stage"], name)


def test_a_model_built_under_init_module_empty_init_materializes_only_each_stage(tmp_path):
    launch_forked("bigmodel_run.py", str(tmp_path), "i", "4", "1", "--init-module", "--memory-only", ranks=4,
                  cwd=tmp_path, env=SMALL)
    for row in _rows(tmp_path, "i", 4):
        for name, device in row["devices"].items():
            assert device == ("cpu" if _owner_stage(name) == row["stage"] else "meta"), (row["stage"], name)


def test_peak_memory_per_rank_stays_below_the_model_size():
    # 8 blocks of 4096x4096 (537 MB fp32) on 4 stages, plain SGD: a rank holds a quarter of the parameters, their
    # gradients and one micro-batch's gradient of one block while it is accumulated (0.625x); a rank that built
    # the whole model would start at 1.0x. (Tensors this size are mmapped by glibc, so RSS follows what is held.)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {"BIG_WIDTH": "4096", "BIG_LAYERS": "8", "BIG_MOMENTUM": "0"}
        # forked ranks: a fork starts with its peak RSS reset to what it holds, and tensors of a block are mmapped
        launch_forked("bigmodel_run.py", str(out), "m", "4", "2", "--memory-only", ranks=4, cwd=out, env=env)
        rows = _rows(out, "m", 4)
    for row in rows:
        assert row["train_peak_above_start"] < 0.8 * row["model_bytes"], row


def test_initial_weights_are_the_same_whatever_the_number_of_stages(sharded_runs):
    with torch.device("meta"):
        reference = WideMLP(1024, 4)
        reference.configure_model()
    reference = materialize_module(reference, "cpu", seed=0).state_dict()
    seen = 0
    for r in range(4):
        for name, tensor in torch.load(sharded_runs / f"a_init_rank{r}.pt").items():
            assert torch.equal(tensor, reference[name]), name
            seen += 1
    assert seen == len(reference)


def _consolidate(folder, output):
    import runpy

    sys.argv = ["consolidate_checkpoint", str(folder), "--output_file", str(output)]
    runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")


def test_sharded_checkpoint_consolidates_into_a_file_that_loads_without_the_package(sharded_runs, tmp_path):
    folder = sharded_runs / "a.ckpt"
    assert (folder / "meta.pt").is_file() and len(list(folder.glob("*.distcp"))) == 4  # one shard per stage
    single = tmp_path / "single.ckpt"
    launch_forked(_consolidate, folder, single, ranks=1, cwd=ROOT)  # `python -m ...consolidate_checkpoint`
    loaded = WideMLP.load_from_checkpoint(single).state_dict()
    trained = {}
    for r in range(4):
        trained.update(torch.load(sharded_runs / f"a_own_rank{r}.pt"))
    assert trained.keys() == loaded.keys()
    for name in trained:
        assert torch.equal(trained[name], loaded[name]), name


def test_sharded_checkpoint_resumes_on_fewer_stages_with_the_same_optimizer_state(sharded_runs):
    saved = {}
    for row in _rows(sharded_runs, "a", 4):
        assert row["end_step"] == 3
        saved.update(row["end_sums"])
    resumed = {}
    for row in _rows(sharded_runs, "b", 2):
        assert row["start_step"] == 3 and row["end_step"] == 4
        resumed.update(row["start_sums"])
    # every parameter and its momentum buffer, as saved by 4 stages, read back by 2
    assert resumed.keys() == saved.keys() and sum(k.startswith("momentum/") for k in saved) == 10
    assert resumed == saved


def test_a_sharded_checkpoint_of_another_model_is_refused_with_the_names(sharded_runs, tmp_path):
    env = {**SMALL, "BIG_LAYERS": "5"}
    proc = launch_forked("bigmodel_run.py", str(tmp_path), "c", "2", "4", "--resume", str(sharded_runs / "a.ckpt"),
                         ranks=2, cwd=tmp_path, env=env, expect_ok=False, timeout=240)
    assert proc.returncode != 0
    assert "does not match the model: missing 2 keys (first: ['blocks.4.0.weight', 'blocks.4.0.bias'])" in proc.stderr


def test_check_model_keys_names_missing_and_unexpected(tmp_path):
    with pytest.raises(KeyError, match=r"missing 1 keys \(first: \['b'\]\), unexpected 1 keys \(first: \['c'\]\)"):
        check_model_keys({"a", "c"}, ["a", "b"], tmp_path)
    check_model_keys({"a", "b"}, ["a", "b"], tmp_path)


# ---------------------------------------------------------------------------------------------- materialization
class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _ForgetsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("table", torch.arange(3.0))

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def test_a_module_without_reset_parameters_is_named_with_the_fix():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), _Scale())
    with pytest.raises(MaterializeError, match=r"module '1' \(_Scale\).*holds scale.*def reset_parameters"):
        materialize(model.named_modules(), "cpu")


def test_a_tensor_that_reset_parameters_leaves_uninitialised_is_named():
    with torch.device("meta"):
        model = nn.Sequential(_ForgetsBuffer())
    with pytest.raises(MaterializeError, match=r"'0.table' is still uninitialised after _ForgetsBuffer.reset_param"):
        materialize(model.named_modules(), "cpu")


def test_materialize_follows_eager_initialisation_order_and_keeps_the_global_rng():
    # nn.MultiheadAttention zeroes its output projection's bias after that child initialised it, as in eager mode
    with torch.device("meta"):
        attn = nn.MultiheadAttention(8, 2)
    state = torch.random.get_rng_state()
    materialize_module(attn, "cpu", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.count_nonzero(attn.out_proj.bias) == 0 and torch.isfinite(attn.in_proj_weight).all()


def test_state_dict_type_is_checked():
    with pytest.raises(ValueError, match="state_dict_type must be 'full'.*or 'sharded'.*got 'shards'"):
        lightning_clapping.ClappingStrategy(state_dict_type="shards")
