"""Modules that build tensors inside forward (masks, position ids, rotary tables) can be skipped by later stages.

A stage skips the units of earlier stages and needs only the shapes of what they return. It runs them on the meta
device, with ``torch.device("meta")`` as the default device so that ``torch.ones(T, T)`` and ``torch.arange(T)``
written without ``device=`` are meta tensors too; what the meta device cannot run is retried with fake tensors; what
neither can run (code that reads its inputs' values) is refused with a SplitError that says what to do.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from conftest import launch_forked
from lightning_clapping.pipeline import placeholders
from lightning_clapping.pipeline.partition import build_partition
from lightning_clapping.pipeline.stage import SplitError, StageRunner

B, T, C = 2, 5, 8


class Root(nn.Module):
    """``first`` belongs to stage 0, ``second`` starts stage 1: a stage-1 runner skips ``first``."""

    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.second = nn.Linear(C, C)


def skipped_output(first: nn.Module, *args, **kwargs):
    """What stage 1 gets back when its step calls the skipped stage-0 module ``first``.

    Also says whether that call moved the CPU random generator, and whether it left ``first`` holding exactly the
    parameter and buffer objects it held before (the meta-device ones, since stage 1 released them).
    """
    if not any(True for _ in first.parameters()):
        # a module without parameters belongs to no stage and runs where it is called (test_free_modules.py); one
        # parameter makes it stage 0's, which stage 1 skips
        first.register_parameter("owned", nn.Parameter(torch.zeros(())))
    root = Root(first)
    runner = StageRunner(root, build_partition(root, 2, ["second"]), stage=1)
    runner.release_foreign_state()  # as the strategy does: stage 0's parameters and buffers go to the meta device
    runner.install()
    state = [(n, id(t)) for n, t in (*first.named_parameters(), *first.named_buffers())]
    rng = torch.get_rng_state()
    try:
        with runner.microbatch(lambda: [torch.zeros(1, C)]):
            out = root.first(*args, **kwargs)
            root.second(torch.zeros(1, C))  # stage 1's entry: reached, so the micro-batch is well formed
    finally:
        runner.uninstall()
    info = {
        "rng_moved": not torch.equal(torch.get_rng_state(), rng),
        "state_kept": state == [(n, id(t)) for n, t in (*first.named_parameters(), *first.named_buffers())]
        and all(isinstance(p, nn.Parameter) and p.device.type == "meta" for p in first.parameters()),
    }
    return out, info


def assert_like(stub, real):
    """Same structure, shapes and dtypes; float placeholders are NaN, the others zero; all on the input's device."""
    s_leaves, s_spec = tree_flatten(stub)
    r_leaves, r_spec = tree_flatten(real)
    assert s_spec == r_spec
    for s, r in zip(s_leaves, r_leaves):
        assert isinstance(s, torch.Tensor) and isinstance(r, torch.Tensor)
        assert (s.shape, s.dtype, s.device.type) == (r.shape, r.dtype, "cpu")
        if s.dtype.is_floating_point:
            assert bool(torch.isnan(s).all())
        else:
            assert not bool(s.any())


@pytest.fixture
def no_fake_tensors(monkeypatch):
    """Only the meta device: the cases below must not need the fake-tensor fallback."""
    def no_fakes(*args, **kwargs):
        raise RuntimeError("fake tensors switched off by the test")

    monkeypatch.setattr(placeholders, "FakeTensorMode", no_fakes)


# ---------------------------------------------------------------------------------------------------- factory calls
class CausalScores(nn.Module):
    """Attention scores masked with a causal mask built in forward, without device=."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(C, C)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n), diagonal=1).bool()
        scores = self.q(x) @ x.transpose(1, 2)
        return scores.masked_fill(mask, float("-inf")).softmax(-1), mask


class MinusInfMask(nn.Module):
    """An additive float mask: torch.full of -inf, triu, and a masked_fill with float('-inf')."""

    def forward(self, x):
        n = x.shape[1]
        additive = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        return (x @ x.transpose(1, 2) + additive).masked_fill(~keep, float("-inf"))


class Positions(nn.Module):
    """Token plus position embedding; the position ids come from torch.arange(T) in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, C)
        self.pos = nn.Embedding(16, C)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])
        return self.tok(idx) + self.pos(positions), positions


class Rotary(nn.Module):
    """A rotary cos/sin table computed in forward from torch.arange, applied to a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(C, C)

    def forward(self, x):
        n = x.shape[1]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, C, 2).float() / C))
        freqs = torch.outer(torch.arange(n).float(), inv_freq)
        table = torch.cat([freqs, freqs], dim=-1)
        q = self.q(x)
        a, b = q.chunk(2, dim=-1)
        return q * table.cos() + torch.cat([-b, a], dim=-1) * table.sin()


class NewZeros(nn.Module):
    """x.new_zeros for a padding column and a long-typed counter."""

    def forward(self, x):
        pad = x.new_zeros(x.shape[0], 1, x.shape[2])
        return torch.cat([pad, x], dim=1), x.new_zeros(x.shape[:2], dtype=torch.long)


class Noise(nn.Module):
    """torch.randn and torch.full without device=, mixed with the input."""

    def forward(self, x):
        return x + 0.1 * torch.randn(x.shape[1], x.shape[2]) + torch.full((x.shape[2],), 2.0)


FACTORY_CASES = [
    pytest.param(CausalScores, lambda: torch.randn(B, T, C), id="triu-causal-mask"),
    pytest.param(MinusInfMask, lambda: torch.randn(B, T, C), id="full-and-masked_fill-minus-inf"),
    pytest.param(Positions, lambda: torch.randint(0, 11, (B, T)), id="arange-position-ids-into-embedding"),
    pytest.param(Rotary, lambda: torch.randn(B, T, C), id="rotary-table-in-forward"),
    pytest.param(NewZeros, lambda: torch.randn(B, T, C), id="new_zeros"),
    pytest.param(Noise, lambda: torch.randn(B, T, C), id="randn-and-full"),
]


@pytest.mark.parametrize(("cls", "make_input"), FACTORY_CASES)
def test_skipped_module_that_builds_tensors_in_forward_gets_its_output_shape_on_the_meta_device(
        no_fake_tensors, cls, make_input):
    torch.manual_seed(0)
    module, x = cls(), make_input()
    real = copy.deepcopy(module)(x)
    stub, info = skipped_output(module, x)
    assert_like(stub, real)
    assert not info["rng_moved"]  # nothing ran for real, not even the random generator
    assert info["state_kept"]


def test_output_shapes_are_cached_per_input_shape_and_follow_a_new_length(no_fake_tensors):
    calls = []

    class Counting(Positions):
        def forward(self, idx):
            calls.append(idx.shape)
            return super().forward(idx)

    module = Counting()
    root = Root(module)
    runner = StageRunner(root, build_partition(root, 2, ["second"]), stage=1)
    runner.release_foreign_state()
    runner.install()
    try:
        outs = []
        for n in (5, 5, 7, 5):
            with runner.microbatch(lambda: [torch.zeros(1, C)]):
                outs.append(root.first(torch.zeros(B, n, dtype=torch.long)))
                root.second(torch.zeros(1, C))
    finally:
        runner.uninstall()
    assert [o[0].shape for o in outs] == [(B, 5, C), (B, 5, C), (B, 7, C), (B, 5, C)]
    assert [o[1].shape for o in outs] == [(5,), (5,), (7,), (5,)]
    assert len(calls) == 2  # one shape inference per input signature


# ---------------------------------------------------------------------------------------------------- fake tensors
class ConstantItem(nn.Module):
    """A scale computed from a constant tensor made in forward and read with .item(): no meta tensor has a value."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(C, C)

    def forward(self, x):
        scale = torch.tensor(float(x.shape[-1])).rsqrt().item()
        return self.q(x) * scale


class PlainAttribute(nn.Module):
    """A table kept as a plain tensor attribute (not a buffer): it stays on the CPU when the module goes to meta."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(C, C)
        self.table = torch.randn(T, C)

    def forward(self, x):
        return self.q(x) + self.table[: x.shape[1]]


class ExplicitDevice(nn.Module):
    """A mask built with an explicit device="cpu": it cannot mix with meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(C, C)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device="cpu").triu(1)
        return (self.q(x) @ x.transpose(1, 2)).masked_fill(mask, float("-inf"))


@pytest.mark.parametrize("cls", [ConstantItem, PlainAttribute, ExplicitDevice],
                         ids=["constant-item", "plain-tensor-attribute", "explicit-device-cpu"])
def test_what_the_meta_device_cannot_run_falls_back_to_fake_tensors(cls):
    torch.manual_seed(0)
    module, x = cls(), torch.randn(B, T, C)
    real = copy.deepcopy(module)(x)
    with pytest.raises(Exception):  # the premise: the meta device alone cannot run it
        with torch.no_grad(), torch.device("meta"):
            copy.deepcopy(module).to("meta")(x.to("meta"))
    stub, info = skipped_output(module, x)
    assert_like(stub, real)
    assert info["state_kept"]  # the fake parameters used for the call are gone: the meta parameters are back


# ---------------------------------------------------------------------------------------------------- refused
class BooleanIndex(nn.Module):
    """Output length follows the input's values (x[x > 0] is a nonzero): no .item(), still data-dependent."""

    def forward(self, x):
        return x[x > 0]


class ValueBranch(nn.Module):
    """Python control flow on a tensor value."""

    def forward(self, x):
        return x[:, :-1] if x.sum() > 0 else x


class InputItem(nn.Module):
    def forward(self, x):
        return x[:, : int(x.abs().max().item())]


@pytest.mark.parametrize(("cls", "reason"), [
    (BooleanIndex, "nonzero"),
    (ValueBranch, "Tensor.item() cannot be called on meta tensors"),
    (InputItem, "Tensor.item() cannot be called on meta tensors"),
], ids=["boolean-index", "branch-on-value", "item-of-input"])
def test_data_dependent_module_is_refused_with_the_reason_and_what_to_do(cls, reason):
    with pytest.raises(SplitError) as info:
        skipped_output(cls(), torch.randn(B, T, C))
    text = str(info.value)
    assert "stage 1 skips 'first' (it runs on an earlier stage) and needs the shape of its output" in text
    # the original exception, the one the meta device raised, is named and chained
    original = info.value.__cause__
    assert original is not None and reason in str(original)
    assert f"the module cannot run on the meta device: {original}. " in text
    assert "Cut the model after this module's data-dependent code, or move that code into the first stage." in text
    assert "With fake tensors it fails too: " in text


# ---------------------------------------------------------------------------------------------------- end to end
def test_gpt_building_masks_positions_and_rotary_in_forward_trains_like_one_process_on_3_stages(tmp_path):
    # cut at blocks.1 and blocks.2: stage 1 skips the embedding (arange) and block 0 (triu mask); stage 2 also skips
    # block 1 (rotary table over a plain-attribute frequency tensor: the fake-tensor fallback)
    launch_forked("forward_tensors_run.py", "pipe", str(tmp_path), ranks=3, cwd=tmp_path, timeout=300)
    launch_forked("forward_tensors_run.py", "single", str(tmp_path), ranks=1, cwd=tmp_path, timeout=300)
    pipe, single = (json.loads((tmp_path / f"forward_tensors_{m}.json").read_text())["losses"]
                    for m in ("pipe", "single"))
    assert len(pipe) == len(single) == 3
    assert pipe == pytest.approx(single, rel=0, abs=1e-5)
    pipe_w = torch.load(tmp_path / "forward_tensors_pipe.pt")
    single_w = torch.load(tmp_path / "forward_tensors_single.pt")
    assert pipe_w.keys() == single_w.keys()
    for k in pipe_w:
        torch.testing.assert_close(pipe_w[k], single_w[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
