"""Values that cross a cut outside the cut module's inputs reach the stages that use them.

Engine level (one process, a runner per stage on copies of the model) for the mechanism; then the model families
people train (loops with residuals, Lightning's nn.Transformer demo, Hugging Face Llama) on 2 and 4 stages against
one process, and a compressed run.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from conftest import launch_forked
from lightning_clapping.pipeline.crossing_plan import CrossingError, Need, Plan
from lightning_clapping.pipeline.partition import build_partition
from lightning_clapping.pipeline.stage import StageExit, StageRunner


class Skip(nn.Module):
    """``skip`` is made before the cut at ``b`` and used after it, without passing through ``b``."""

    def __init__(self, use_skip: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_skip = use_skip

    def forward(self, x):
        h = self.a(x)
        skip = h * 2
        y = self.c(self.b(h))
        return y + skip if self.use_skip else y


def runner_for(model: nn.Module, stage: int, cuts: list[str]) -> StageRunner:
    runner = StageRunner(model, build_partition(model, len(cuts) + 1, cuts), stage=stage)
    runner.release_foreign_state()
    runner.install()
    return runner


def run_stage(runner: StageRunner, model: nn.Module, x, provider=None, kind="train"):
    with runner.microbatch(provider, kind):
        try:
            return model(x), None
        except StageExit:
            return None, runner.captured_tensors()


def test_a_value_made_before_the_cut_is_found_sent_and_used_after_it():
    torch.manual_seed(0)
    model, x = Skip(), torch.randn(3, 4)
    expected = model(x)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    r0, r1 = runner_for(first, 0, ["b"]), runner_for(second, 1, ["b"])
    needs = r1.discover("train", lambda: second(x))
    assert len(needs) == 1 and needs[0].origin == 0 and needs[0].consumer == 1  # `skip`, made on stage 0
    plan = Plan(needs, 2)
    assert plan.crossing(0) == [needs[0].key]
    r0.crossings.plans["train"] = r1.crossings.plans["train"] = plan
    _, sent = run_stage(r0, first, x)
    assert len(sent) == 2  # b's input, then skip
    torch.testing.assert_close(sent[1], first.a(x) * 2)
    out, _ = run_stage(r1, second, x, provider=lambda: [t.detach() for t in sent])
    torch.testing.assert_close(out, expected)


def test_a_value_the_first_step_did_not_move_is_refused_with_the_reason():
    torch.manual_seed(0)
    model, x = Skip(use_skip=False), torch.randn(3, 4)
    runner = runner_for(model, 1, ["b"])
    assert runner.discover("train", lambda: model(x)) == []
    runner.crossings.plans["train"] = Plan([], 2)
    model.use_skip = True  # the forward changes after the first step
    with pytest.raises(CrossingError, match="the first step's forward did not use it here"):
        run_stage(runner, model, x, provider=lambda: [torch.randn(3, 4)])


class Lengths(nn.Module):
    """A Python value (a list of ints) computed from stage 0's output and used by stage 1's module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        keep = int((h > 0).sum())
        return self.b(h)[:keep]


def test_a_python_value_made_from_an_earlier_stage_is_refused_naming_it_and_its_user():
    model = Lengths()
    runner = runner_for(model, 1, ["b"])
    with pytest.raises(CrossingError, match=r"`torch.Tensor.__int__` turns the tensor made by `torch.Tensor.sum`.*"
                                            r"the next module called is 'b'"):
        runner.discover("train", lambda: model(torch.randn(3, 4)))


class Rotary(nn.Module):
    """No parameters, a non-persistent table: belongs to no stage."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4), persistent=False)

    def forward(self, x, positions):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return torch.cat([freqs, freqs], -1).to(x.dtype).cos()


class RotaryRegisteredLast(nn.Module):
    """As Hugging Face Llama: ``rotary`` is registered after the layers but called before them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.rotary = Rotary()

    def forward(self, x):
        table = self.rotary(x, torch.arange(x.shape[0]))
        for layer in self.layers:
            x = layer(x) * table
        return x


def test_a_module_without_parameters_runs_where_it_is_called_and_its_batch_values_are_recomputed():
    torch.manual_seed(0)
    model, x = RotaryRegisteredLast(), torch.randn(3, 4)
    part = build_partition(model, 2, ["layers.1"])
    assert "rotary" in part.free and "rotary" not in part.unit_stage
    runner = runner_for(model, 1, ["layers.1"])
    assert runner.discover("train", lambda: model(x)) == []  # the table depends on the batch only: nothing sent
    runner.crossings.plans["train"] = Plan([], 2)
    h = torch.randn(3, 4)
    out, _ = run_stage(runner, model, x, provider=lambda: [h])
    torch.testing.assert_close(out, model.layers[1](h) * Rotary()(x, torch.arange(3)))


def test_a_value_is_relayed_through_the_stages_between_its_maker_and_its_user():
    need = Need(event=(1 << 24) | 2, leaf=0, origin=0, consumer=2, op=7)
    plan = Plan([need], 3)
    assert plan.crossing(0) == plan.crossing(1) == [need.key]
    assert plan.made_on(0) == {need.event: [0]} and plan.made_on(1) == {}
    with pytest.raises(CrossingError, match="disagree"):
        Plan([need, Need(need.event, 0, 0, 1, op=8)], 3)


# ---------------------------------------------------------------------------------------------------- end to end
FAMILIES = ("loop", "demo", "llama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers.models.llama.modeling_llama")  # imported once here, not in every rank
    out = tmp_path_factory.mktemp("crossings")
    for mode, ranks in (("single", 1), ("pipe2", 2), ("pipe4", 4), ("compressed", 2)):
        launch_forked("crossings_run.py", str(out), mode, ranks=ranks, cwd=out, timeout=600)
    return out


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_trains_on_stages_as_in_one_process(runs, family, stages):
    single = json.loads((runs / "crossings_single.json").read_text())[family]
    pipe = json.loads((runs / f"crossings_pipe{stages}.json").read_text())[family]
    assert len(pipe["losses"]) == len(single["losses"]) == 4
    assert pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    assert pipe["val_loss"] == pytest.approx(single["val_loss"], rel=0, abs=1e-5)
    a = torch.load(runs / f"crossings_single_{family}.pt")
    b = torch.load(runs / f"crossings_pipe{stages}_{family}.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_the_values_crossing_cuts_are_counted_in_the_byte_totals(runs):
    four = json.loads((runs / "crossings_pipe4.json").read_text())
    # 4 stages of the demo: the decoder's input embedding, made on stage 0, crosses to the decoder's stages
    assert four["demo"]["crossing_raw_bytes"] > 0
    assert four["demo"]["crossing_raw_bytes"] < four["demo"]["raw_bytes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compressed_run_trains(runs, family):
    compressed = json.loads((runs / "crossings_compressed.json").read_text())[family]
    single = json.loads((runs / "crossings_single.json").read_text())[family]
    assert compressed["losses"][-1] < compressed["losses"][0]
    assert compressed["losses"][-1] == pytest.approx(single["losses"][-1], abs=0.05)
