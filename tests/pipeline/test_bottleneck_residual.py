"""The residual bottleneck (``Bottleneck(..., residual=True)``): a learned encoder and decoder around the low-rank
identity path, with nothing but the code on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import launch_forked
from lightning_clapping import Bottleneck, BottleneckAfter, build_partition, fit_bottlenecks

BATCH, RANK = 8, 4


def _mlp(residual: bool):
    import lightning as L
    from torch import nn
    from torch.nn import functional as F

    class ResidualBottleneckMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            bottleneck = Bottleneck(32, RANK, residual=residual, hidden=24 if residual else None)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), bottleneck, nn.Linear(32, 32), nn.Tanh(),
                                     nn.Linear(32, 4))
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return ResidualBottleneckMLP()


def _run(out: str, mode: str) -> None:
    """mode: single (one process) | pipe (2 stages cut at the residual bottleneck) | plain (the same, with a plain
    bottleneck of the same rank); 4 steps of SGD; rank 0 writes the losses, byte totals and final weights."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_clapping import ClappingStrategy

    L.seed_everything(0, verbose=False)
    model = _mlp(residual=mode != "plain")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=BATCH)
    if mode == "single":
        strategy, devices = "auto", 1
    else:
        strategy, devices = ClappingStrategy(split_points=["net.2"], microbatches=2), 2
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        totals = trainer.strategy.byte_totals if mode != "single" else {}
        Path(out, f"residual_{mode}.json").write_text(json.dumps({"losses": model.losses, "totals": totals}))
        torch.save(model.state_dict(), Path(out, f"residual_{mode}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("residual_bottleneck")
    launch_forked(_run, str(out), "single", ranks=1, cwd=out)
    for mode in ("pipe", "plain"):
        launch_forked(_run, str(out), mode, ranks=2, cwd=out)
    return out


def _pair(seed: int = 0):
    """A residual bottleneck and a plain one holding the same identity path."""
    torch.manual_seed(seed)
    res = Bottleneck(32, 4, residual=True)
    plain = Bottleneck(32, 4)
    plain.load_state_dict({"down.weight": res.down.weight.detach(), "up.weight": res.up.weight.detach()})
    return res, plain


def test_a_residual_bottleneck_starts_as_the_plain_one_on_its_identity_path():
    res, plain = _pair()
    x = torch.randn(6, 32) * 5
    with torch.no_grad():
        torch.testing.assert_close(res(x), plain(x), rtol=0, atol=0)
        torch.testing.assert_close(res.down(x), x @ res.down.weight.t(), rtol=0, atol=0)
    torch.testing.assert_close(res.down.weight @ res.down.weight.t(), torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(res.up.weight, res.down.weight.t(), rtol=0, atol=0)
    assert res.hidden == 32 and "residual=True, hidden=32" in repr(res)
    # the rescaled start carries the same gain on its identity path
    rescaled = Bottleneck(64, 8, init="rescaled", residual=True)
    torch.testing.assert_close(torch.linalg.svdvals(rescaled.down.weight), torch.full((8,), 8 ** 0.25), atol=1e-5,
                               rtol=0)


def test_the_branches_learn_and_make_the_bottleneck_nonlinear():
    res, plain = _pair()
    x, target = torch.randn(64, 32), torch.randn(64, 32)
    opt = torch.optim.SGD(res.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(res(x), target).backward()
        opt.step()
    for half in (res.down, res.up):
        assert half.branch[-1].weight.abs().max() > 0  # the zero start moved
        assert half.branch[-3].weight.grad.abs().max() > 0  # and the gradient reaches the branch's first layer
    with torch.no_grad():
        # no longer linear: the code of a sum is not the sum of the codes
        a, b = torch.randn(4, 32), torch.randn(4, 32)
        assert (res.down(a + b) - res.down(a) - res.down(b)).abs().max() > 1e-4
        c, e = torch.randn(4, 4), torch.randn(4, 4)
        assert (res.up(c + e) - res.up(c) - res.up(e) + res.up(torch.zeros(4, 4))).abs().max() > 1e-4
        # and it is no longer the plain bottleneck on the same identity path
        assert (res(a) - plain(a)).abs().max() > 1e-4


def test_residual_refuses_bad_arguments():
    with pytest.raises(ValueError, match="only with residual=True"):
        Bottleneck(32, 4, hidden=16)
    with pytest.raises(ValueError, match="positive integer"):
        Bottleneck(32, 4, residual=True, hidden=0)
    with pytest.raises(ValueError, match="residual must be True or False"):
        Bottleneck(32, 4, residual=1)
    with pytest.raises(ValueError, match="smaller than features"):
        Bottleneck(8, 8, residual=True)
    with pytest.raises(ValueError, match="last dimension is 7"):
        Bottleneck(8, 2, residual=True)(torch.randn(2, 7))


def test_fitting_writes_the_identity_path_and_restarts_the_branches_at_zero():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), Bottleneck(32, 4, residual=True), torch.nn.Linear(32, 3))
    res = model[1]
    with torch.no_grad():  # as if trained: the branches no longer start at zero
        for half in (res.down, res.up):
            half.branch[-1].weight.normal_()
    first = res.down.branch[-3].weight.detach().clone()
    batches = [torch.randn(16, 8) for _ in range(3)]
    kept = fit_bottlenecks(model, batches)
    h = torch.cat([model[0](b) for b in batches]).detach().double()
    values, vectors = torch.linalg.eigh(h.t() @ h)
    top = vectors[:, -4:].flip(1).float()
    # the identity path spans the top directions, the branches add nothing, the first layers are kept
    torch.testing.assert_close((res.down.weight @ top).abs(), torch.eye(4), atol=1e-4, rtol=0)
    torch.testing.assert_close(res.up.weight, res.down.weight.t(), rtol=0, atol=0)
    for half in (res.down, res.up):
        assert half.branch[-1].weight.abs().max() == 0 and half.branch[-1].bias.abs().max() == 0
    torch.testing.assert_close(res.down.branch[-3].weight, first, rtol=0, atol=0)
    assert kept["1"] == pytest.approx(float(values[-4:].sum() / values.sum()), rel=1e-6)
    with torch.no_grad():
        x = torch.randn(5, 32)
        torch.testing.assert_close(res(x), x @ top @ top.t(), atol=1e-4, rtol=0)


def test_bottleneck_after_builds_a_residual_one():
    block = torch.nn.Linear(32, 32)
    wrapped = BottleneckAfter(block, 32, 4, residual=True, hidden=8)
    assert wrapped.bottleneck.residual and wrapped.bottleneck.hidden == 8
    assert wrapped.in_features == 32  # attributes still read from the block


def test_a_split_point_naming_a_residual_bottleneck_puts_its_encoder_and_decoder_on_either_side():
    part = build_partition(_mlp(residual=True), 2, ["net.2"])
    assert part.cut_points == ("net.2.up",)
    assert part.unit_stage["net.2.down"] == 0 and part.unit_stage["net.2.up"] == 1
    assert {k for k, s in part.state_stage.items() if k.startswith("net.2.down")} == {
        "net.2.down.weight", "net.2.down.branch.1.weight", "net.2.down.branch.1.bias",
        "net.2.down.branch.3.weight", "net.2.down.branch.3.bias"}
    assert all(part.state_stage[k] == 0 for k in part.state_stage if k.startswith("net.2.down"))
    assert all(part.state_stage[k] == 1 for k in part.state_stage if k.startswith("net.2.up"))


def test_the_residual_bottleneck_trains_on_stages_as_in_one_process(runs):
    single = json.loads((runs / "residual_single.json").read_text())
    pipe = json.loads((runs / "residual_pipe.json").read_text())
    assert len(pipe["losses"]) == 4 and pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    a, b = torch.load(runs / "residual_single.pt"), torch.load(runs / "residual_pipe.pt")
    assert a.keys() == b.keys() and "net.2.up.branch.2.weight" in a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert a["net.2.up.branch.2.weight"].abs().max() > 0  # the branches trained on the stages too


def test_the_wire_carries_the_code_as_for_a_plain_bottleneck_of_the_same_rank(runs):
    res = json.loads((runs / "residual_pipe.json").read_text())["totals"]
    plain = json.loads((runs / "residual_plain.json").read_text())["totals"]
    assert res["steps"] == plain["steps"] == 4
    assert res["raw_bytes"] == plain["raw_bytes"] and res["bytes"] == plain["bytes"]
