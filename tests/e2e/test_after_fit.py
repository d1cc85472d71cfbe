"""After a pipelined run the launching process has a working model: the template project's test stage restores the
best checkpoint (``weights_only=False``), the module runs, and ``load_from_checkpoint`` rebuilds it from the network
kept in its hyperparameters. One 2-stage launch (tests/scripts/after_fit_run.py) serves every test here."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import SCRIPTS, has_minilm, launch_forked
from lightning_clapping.pipeline.materialize import building_on_meta, materialize_module

pytestmark = pytest.mark.skipif(not has_minilm(), reason="needs transformers (the test extras)")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("after_fit")
    launch_forked("after_fit_run.py", str(out), ranks=2, cwd=out, timeout=400)
    return out


def _script():
    spec = importlib.util.spec_from_file_location("after_fit_run", SCRIPTS / "after_fit_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_test_restores_the_best_checkpoint_with_weights_only_false(run):
    # the checkpoint's hyperparameters hold the network (a pickled module): weights_only=True cannot read it
    for rank in (0, 1):
        tested = json.loads((run / f"tested_rank{rank}.json").read_text())
        assert isinstance(tested, list), tested
        assert torch.isfinite(torch.tensor(tested[0]["test_loss"]))


def test_the_launching_process_module_runs_and_equals_the_checkpoint_it_saved(run):
    after = torch.load(run / "after.pt", weights_only=False)
    assert after["meta"] == []  # the first stage's non-persistent buffers (BERT's position_ids) came back
    assert torch.equal(after["position_ids"], torch.arange(16)[None])
    assert isinstance(after["output"], torch.Tensor), after["output"]
    assert isinstance(after["loaded"], torch.Tensor), after["loaded"]  # load_from_checkpoint of the full file
    assert torch.equal(after["output"], after["loaded"])


def test_each_stage_starts_from_the_one_process_model_with_huggingface_initialisation(run):
    script = _script()
    with building_on_meta():
        reference = script.Classifier(script.build_net())
    materialize_module(reference, seed=0)
    expected = dict(reference.named_parameters()) | dict(reference.named_buffers())
    stages = [torch.load(run / f"init_rank{r}.pt") for r in (1, 0)]  # rank 1 runs stage 0
    assert all(k.startswith(("net.embeddings.", "net.encoder.layer.0.")) for k in stages[0])  # only its own stage
    assert not any(k.startswith(("net.embeddings.", "net.encoder.layer.0.")) for k in stages[1])
    seen = {}
    for own in stages:
        seen.update(own)
    assert seen.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(seen[k], expected[k])] == []
    assert abs(float(seen["net.encoder.layer.1.output.dense.weight"].std()) - 0.02) < 0.005  # HF's _init_weights
