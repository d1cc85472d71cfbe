"""A bottleneck's code narrowed below its rank, and RankScheduler widening it as training goes: the cut carries the
scheduled width, the pipeline trains as one process does, and the model's function never depends on the width."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn

from conftest import launch_forked
from lightning_clapping import Bottleneck, RankScheduler

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("code_width")
    for mode, ranks in (("single_grow", 1), ("pipe_grow", 2), ("pipe_narrow", 2)):
        launch_forked("bottleneck_run.py", str(out), mode, ranks=ranks, cwd=out)
    return out


def test_a_narrowed_code_has_its_width_and_the_full_rank_computes_the_same_function():
    torch.manual_seed(0)
    b, x = Bottleneck(16, 6), torch.randn(3, 5, 16)
    b.set_code_width(2)
    assert b.down(x).shape == (3, 5, 2) and b.code_width == 2 and "code_width=2" in repr(b)
    assert torch.count_nonzero(b.up.weight[:, 2:]) == 0
    full = Bottleneck(16, 6)
    full.load_state_dict(b.state_dict())  # a checkpoint saved narrowed, loaded at the full rank
    assert full.code_width == 6
    torch.testing.assert_close(full(x), b(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(b(x), b.down(x) @ b.up.weight[:, :2].t(), rtol=0, atol=1e-6)


def test_a_widening_code_adds_values_at_zero_contribution_that_training_then_grows():
    torch.manual_seed(0)
    b, x = Bottleneck(16, 6), torch.randn(32, 16)
    b.set_code_width(2)
    rows = b.down.weight[2:].clone()
    opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for _ in range(3):  # steps at width 2: the weights out of use get no gradient and stay where they were
        opt.zero_grad()
        (b(x) - x).square().mean().backward()
        opt.step()
    assert torch.count_nonzero(b.up.weight[:, 2:]) == 0
    torch.testing.assert_close(b.down.weight[2:], rows, rtol=0, atol=1e-3)  # only AdamW's weight decay
    before = b(x)
    b.set_code_width(6)
    torch.testing.assert_close(b(x), before, rtol=0, atol=1e-6)  # no jump at the change (rounding only)
    opt.zero_grad()
    (b(x) - x).square().mean().backward()
    opt.step()
    assert torch.count_nonzero(b.up.weight[:, 2:]) > 0


def test_a_code_width_outside_1_to_the_rank_or_on_a_residual_bottleneck_is_refused():
    b = Bottleneck(16, 4)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="code width must be an integer from 1 to the rank 4"):
            b.set_code_width(bad)
    with pytest.raises(ValueError, match="residual bottleneck"):
        Bottleneck(16, 4, residual=True).set_code_width(2)
    with pytest.raises(ValueError, match="more than the rank 4"):
        b.up(torch.zeros(2, 5))


@pytest.mark.parametrize("bad, words", [({}, "width for step 0"), ({3: 8}, "width for step 0"), ([(0, 4)], "dict"),
                                        ({0: 4, -1: 8}, "integers >= 0"), ({0: 0}, "integer >= 1"),
                                        ({0: 4, 2: 2.5}, "integer >= 1"), ({0: 8, 5: 4}, "only widen")])
def test_a_schedule_is_checked_when_built(bad, words):
    with pytest.raises(ValueError, match=words):
        RankScheduler(bad)


class _Bottlenecked(L.LightningModule):
    def __init__(self, residual: bool = False, rank: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), Bottleneck(16, rank, residual=residual), nn.Linear(16, 2))


def test_a_model_the_schedule_does_not_fit_is_refused_when_fitting_starts():
    for module, words in ((L.LightningModule(), "holds no Bottleneck"), (_Bottlenecked(residual=True), "residual"),
                          (_Bottlenecked(rank=3), "wider than net.1's rank 3")):
        with pytest.raises(ValueError, match=words):
            RankScheduler({0: 2, 4: 4}).on_fit_start(None, module)


def test_every_bottleneck_takes_the_width_of_the_step():
    model, sched = _Bottlenecked(), RankScheduler({0: 1, 3: 2, 6: 4})
    sched.on_fit_start(None, model)
    for step, width in ((0, 1), (2, 1), (3, 2), (5, 2), (6, 4), (100, 4)):
        sched.on_train_batch_start(SimpleNamespace(global_step=step), model, None, 0)
        assert model.net[1].code_width == width, step


def test_a_resumed_run_takes_its_step_s_width_and_a_checkpoint_trained_wider_is_refused():
    sched = RankScheduler({0: 1, 3: 2, 6: 4})
    saved = _Bottlenecked()
    saved.net[1].set_code_width(2)  # what a scheduled run saves at step 4: the columns past 2 at zero
    resumed = _Bottlenecked()  # a new process: the model at its full rank, then the checkpoint's weights
    resumed.load_state_dict(saved.state_dict())
    sched.on_fit_start(None, resumed)
    sched.on_train_start(SimpleNamespace(global_step=4), resumed)
    assert resumed.net[1].code_width == 2
    wider = _Bottlenecked()  # a checkpoint of a run without the schedule: all 4 columns trained
    sched.on_fit_start(None, wider)
    with pytest.raises(ValueError, match="trained with a wider code"):
        sched.on_train_start(SimpleNamespace(global_step=4), wider)
    sched.on_train_start(SimpleNamespace(global_step=0), wider)  # a fresh start narrows whatever it holds
    assert wider.net[1].code_width == 1


class _BuiltLate(L.LightningModule):
    """Builds its layers in configure_model; records the code width its validation steps ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = nn.Sequential(nn.Linear(8, 16), Bottleneck(16, 4), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.widths.append(self.net[1].code_width)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_built_in_configure_model_is_narrowed_before_the_sanity_check():
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,))), batch_size=8)
    model = _BuiltLate()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                        callbacks=[RankScheduler({0: 2})])
    trainer.fit(model, data, data)
    assert model.widths[0] == 2 and set(model.widths) == {2}  # the sanity check's validation ran narrowed
    assert torch.count_nonzero(model.net[1].up.weight[:, 2:]) == 0


def test_a_growing_code_trains_on_stages_as_in_one_process(runs):
    single = json.loads((runs / "bottleneck_single_grow.json").read_text())
    pipe = json.loads((runs / "bottleneck_pipe_grow.json").read_text())
    assert len(pipe["losses"]) == 4 and pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    a, b = torch.load(runs / "bottleneck_single_grow.pt"), torch.load(runs / "bottleneck_pipe_grow.pt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert torch.count_nonzero(b["net.2.up.weight"][:, 2:]) > 0  # the widened values were trained


def _fit_for_resume(out: str, name: str, steps: int, resume: bool) -> None:
    """2 stages, RESUME_SCHEDULE; ``first`` stops before the widening with a checkpoint that ``resumed`` starts from in
    new processes. Rank 0 writes the final weights and the losses."""
    from bottleneck_run import BATCH, BottleneckMLP, data
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_clapping import ClappingStrategy

    L.seed_everything(0, verbose=False)
    model = BottleneckMLP()
    x, y = data().dataset.tensors
    loader = DataLoader(TensorDataset(x[:BATCH], y[:BATCH]), batch_size=BATCH)  # one batch: every step the same data
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RankScheduler(RESUME_SCHEDULE)],
                        strategy=ClappingStrategy(split_points=["net.2"], microbatches=2))
    trainer.fit(model, loader, ckpt_path=str(Path(out, "first.ckpt")) if resume else None)
    if name == "first":
        trainer.save_checkpoint(Path(out, "first.ckpt"))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), Path(out, f"{name}.pt"))
        Path(out, f"{name}.json").write_text(json.dumps(model.losses))


RESUME_SCHEDULE = {0: 2, 3: 4}  # 2 values for 3 steps, then all 4


def test_a_run_resumed_before_the_widening_continues_as_the_uninterrupted_one(tmp_path):
    out = str(tmp_path)
    launch_forked(_fit_for_resume, out, "whole", 6, False, ranks=2, cwd=tmp_path)
    launch_forked(_fit_for_resume, out, "first", 2, False, ranks=2, cwd=tmp_path)
    launch_forked(_fit_for_resume, out, "resumed", 6, True, ranks=2, cwd=tmp_path)
    whole, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "resumed"))
    assert len(whole) == 6 and resumed == pytest.approx(whole[2:], rel=0, abs=1e-6)
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_the_wire_carries_the_scheduled_width(runs):
    from bottleneck_run import BATCH, GROW, RANK

    grow = json.loads((runs / "bottleneck_pipe_grow.json").read_text())["totals"]
    narrow = json.loads((runs / "bottleneck_pipe_narrow.json").read_text())["totals"]
    # 2 values per position throughout against 2 for GROW's first steps, then RANK: the steps after the change carry
    # RANK - 2 more fp32 values per row, forward and back; on the wire also the messages that tell the receivers
    # their buffers grow (counted with the bytes sent)
    wider = (4 - max(GROW)) * 2 * BATCH * (RANK - 2) * 4
    assert grow["raw_bytes"] - narrow["raw_bytes"] == wider
    assert grow["bytes"] - narrow["bytes"] >= wider


def test_a_half_given_a_bias_keeps_it_at_any_width():
    torch.manual_seed(0)
    b, x = Bottleneck(16, 6), torch.randn(3, 16)
    b.down.bias, b.up.bias = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(16))
    b.set_code_width(2)
    code = b.down(x)
    torch.testing.assert_close(code, x @ b.down.weight[:2].t() + b.down.bias[:2], rtol=0, atol=1e-6)
    torch.testing.assert_close(b.up(code), code @ b.up.weight[:, :2].t() + b.up.bias, rtol=0, atol=1e-6)


def test_a_code_narrowed_while_built_on_the_meta_device_materializes_with_its_unused_columns_at_zero():
    from lightning_clapping import building_on_meta, materialize_module

    with building_on_meta():
        b = Bottleneck(16, 6)
        b.set_code_width(2)
    b = materialize_module(b, seed=0)
    assert not b.up.weight.is_meta and torch.count_nonzero(b.up.weight[:, 2:]) == 0
    assert torch.count_nonzero(b.up.weight[:, :2]) > 0
