"""Precision under the pipeline: bf16 (mixed and true) trains like one device, and under 16-mixed every stage takes
the same loss-scale decision."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from conftest import launch_forked, run_gloo_ranks
from lightning_clapping import ClappingStrategy
from lightning_clapping.precision import SharedLossScale, scale_loss_weights


def _fp16_plugin(**kw) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **kw))


# ---------------------------------------------------------------------------------------------- the shared decision
def _scaler_worker(rank, port, out):
    """Three steps on two ranks: (0) rank 1's gradient holds inf, (1) both clean, (2) rank 0 has no gradients at
    all and rank 1 overflows again. Reports, per step, whether this rank's weights changed and its scale after."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    plugin = _fp16_plugin(init_scale=1024.0, growth_interval=1)
    scaler = plugin.scaler
    report = []
    for step, (overflowing, without_grads) in enumerate([({1}, set()), (set(), set()), ({1}, {0})]):
        opt.zero_grad(set_to_none=True)
        (weight,) = scale_loss_weights(plugin, [1.0], torch.device("cpu"), [opt])
        if rank not in without_grads:
            (lin(torch.ones(1, 3)).sum() * weight).backward()
        if rank in overflowing:
            lin.weight.grad[0, 0] = math.inf
        before = [p.detach().clone() for p in lin.parameters()]
        scaler.unscale_(opt)  # what MixedPrecision.optimizer_step calls before clipping and the step
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(b, p) for b, p in zip(before, lin.parameters()))
        report.append((changed, scaler.get_scale()))
    out.put((rank, report))
    dist.destroy_process_group()


def test_one_rank_overflowing_makes_every_rank_skip_the_step_and_halve_the_scale():
    items, codes = run_gloo_ranks(_scaler_worker, expected=2)
    assert codes == [0, 0] and len(items) == 2, f"workers failed: exit codes {codes}"
    reports = dict(items)
    for rank in (0, 1):
        (skip0, scale0), (step1, scale1), (skip2, scale2) = reports[rank]
        assert not skip0 and scale0 == 512.0, f"rank {rank}: step 0 (rank 1 overflowed) must skip and halve"
        assert step1 and scale1 == 1024.0, f"rank {rank}: a clean step steps on every rank and grows the scale"
        assert not skip2 and scale2 == 512.0, f"rank {rank}: step 2 (rank 1 overflowed, rank 0 had no gradients)"


def test_the_shared_decision_is_installed_once_and_the_loss_weights_carry_the_scale():
    plugin = _fp16_plugin(init_scale=256.0)
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert scale_loss_weights(plugin, [0.25, 0.75], torch.device("cpu"), [opt]) == [64.0, 192.0]
    hook = plugin.scaler.unscale_
    scale_loss_weights(plugin, [1.0], torch.device("cpu"), [opt])
    assert plugin.scaler.unscale_ is hook and isinstance(hook.shared_loss_scale, SharedLossScale)
    weights = [0.5, 0.5]
    assert scale_loss_weights(MixedPrecision("bf16-mixed", "cpu"), weights, torch.device("cpu"), [opt]) is weights


def test_fused_optimizer_under_16_mixed_is_refused():
    plugin = _fp16_plugin()
    opt = torch.optim.Adam(nn.Linear(2, 2).parameters(), fused=True)
    with pytest.raises(ValueError, match="fused=False"):
        scale_loss_weights(plugin, [1.0], torch.device("cpu"), [opt])


def test_16_mixed_with_a_compressed_variant_or_without_a_scaler_is_refused():
    class NoScaler(Precision):
        precision = "16-mixed"

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bf16-mixed"):
        ClappingStrategy(variant="ef21", precision_plugin=_fp16_plugin()).check_model(_module(model), partition=False)
    with pytest.raises(ValueError, match="needs a gradient scaler"):
        ClappingStrategy(precision_plugin=NoScaler()).check_model(_module(model), partition=False)
    ClappingStrategy(precision_plugin=_fp16_plugin()).check_model(_module(model), partition=False)


def _module(net):
    import lightning as L

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

    return M()


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    launch_forked("precision_run.py", "single", str(out), "bf16mixed,bf16true,fp16", ranks=1, cwd=out, timeout=600)
    launch_forked("precision_run.py", "pipe", str(out), "bf16mixed,bf16true,bf16true_fc,fp16", ranks=2, cwd=out,
                  timeout=600)
    return out


def _result(out, name, mode, rank=0):
    return json.loads((out / f"{name}_{mode}_rank{rank}.json").read_text())


def _close_weights(out, name, other, atol):
    ours, theirs = torch.load(out / f"{name}_pipe.pt"), torch.load(out / f"{other}.pt")
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=atol, msg=lambda m: f"{key}: {m}")


def test_bf16_mixed_pipeline_trains_like_one_device_in_bf16_mixed(runs):
    pipe, single = _result(runs, "bf16mixed", "pipe"), _result(runs, "bf16mixed", "single")
    assert _result(runs, "bf16mixed", "pipe", 1)["sent_dtypes"] == {"fwd_out": ["torch.bfloat16"]}  # autocast
    assert pipe["param_dtypes"] == ["torch.float32"]
    assert pipe["wire_ratio"] < 0.6, "bf16 messages must cross the wire in 2 bytes a value, not 4"
    # bf16 keeps 8 bits of mantissa; micro-batches round differently from the whole batch
    torch.testing.assert_close(pipe["losses"], single["losses"], rtol=0, atol=5e-3)
    _close_weights(runs, "bf16mixed", "bf16mixed_single", atol=2e-3)


def test_bf16_true_pipeline_sends_bf16_and_trains_like_one_device_in_bf16_true(runs):
    pipe, single = _result(runs, "bf16true", "pipe"), _result(runs, "bf16true", "single")
    first = _result(runs, "bf16true", "pipe", 1)
    assert first["param_dtypes"] == pipe["param_dtypes"] == ["torch.bfloat16"]
    assert first["sent_dtypes"] == {"fwd_out": ["torch.bfloat16"]} and pipe["sent_dtypes"] == {"bwd_out": [
        "torch.bfloat16"]}
    assert pipe["wire_ratio"] < 0.6, "bf16 messages must cross the wire in 2 bytes a value, not 4"
    # bf16 losses: a few units in the last place (2**-7 near 1.4), each micro-batch's mean rounded on its own
    torch.testing.assert_close(pipe["losses"], single["losses"], rtol=0, atol=3e-2)
    _close_weights(runs, "bf16true", "bf16true_single", atol=1e-2)


def test_bf16_true_error_feedback_buffers_are_bf16_and_identical_on_both_ends(runs):
    last = torch.load(runs / "bf16true_fc_pipe_feedback_rank0.pt")  # rank 0 runs the last stage
    first = torch.load(runs / "bf16true_fc_pipe_feedback_rank1.pt")
    pairs = [(first["fwd_out"], last["fwd_in"]), (last["bwd_out"], first["bwd_in"])]
    for sender, receiver in pairs:
        assert sender and set(sender) == set(receiver)
        for key, buf in sender.items():
            assert buf.dtype == torch.bfloat16, f"{key}: {buf.dtype}"
            assert torch.equal(buf, receiver[key]), f"{key}: the two ends' buffers differ"
    compressed = _result(runs, "bf16true_fc", "pipe")["losses"]
    torch.testing.assert_close(compressed, _result(runs, "bf16true", "pipe")["losses"], rtol=0, atol=2e-2)


def test_16_mixed_stages_skip_together_and_keep_one_loss_scale(runs):
    single = _result(runs, "fp16", "single")
    last, first = _result(runs, "fp16", "pipe", 0), _result(runs, "fp16", "pipe", 1)
    assert min(single["scales"]) < 2.0**20, "the reference run never overflowed: the test would prove nothing"
    # the first stage's gradients overflowed alone at some steps; the last stage skipped with it
    assert last["skipped_for_others"] > 0
    assert last["scales"] == first["scales"] == single["scales"]
    assert last["sent_dtypes"] == {"bwd_out": ["torch.float16"]}
    torch.testing.assert_close(last["losses"], single["losses"], rtol=0, atol=1e-4)
    _close_weights(runs, "fp16", "fp16_single", atol=1e-4)
