"""CodecScheduler: the training messages' codecs change at the scheduled step on every rank, the wire then carries
the new codec's bytes, and a run resumed after a change continues exactly as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import launch_forked
from lightning_clapping import ClappingStrategy, CodecScheduler

SWITCH = 2  # the scheduled step: q8 both ways before it, q2 both ways from it on


def test_scheduling_is_checked_when_built():
    for bad, words in (({}, "non-empty dict"), ({-1: ("q4", "q8")}, "integers >= 0"), ({True: ("q4", "q8")}, ">= 0"),
                       ({1: "q4"}, "(forward_codec, backward_codec)"), ({1: ("q4", "q8", "q2")}, "(forward_codec"),
                       ({1: ("q4", "nope")}, "unknown codec 'nope'")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            CodecScheduler(bad)
    sched = CodecScheduler({5: ("q4", "q8"), 0: ("q1", "q2")})
    assert sched.codecs_at(0)[0].name == "q1" and sched.codecs_at(4)[1].name == "q2"
    assert [c.name for c in sched.codecs_at(5)] == ["q4", "q8"] and sched.codecs_at(99)[0].name == "q4"
    assert CodecScheduler({3: ("q4", "q8")}).codecs_at(2) is None  # before the first key: the strategy's codecs


def test_a_codec_its_name_does_not_give_back_is_refused():
    from lightning_clapping.codecs.quant import QuantCodec

    class Mine(QuantCodec):  # a user's codec, not registered: it keeps the name of the q4 it derives from
        pass

    with pytest.raises(ValueError, match="register_codec"):
        CodecScheduler({1: (Mine(4), "q8")})


class _Executor:
    def __init__(self) -> None:
        self.rebuilds = 0

    def rebuild_rules(self, training_only: bool = False) -> None:
        assert training_only
        self.rebuilds += 1


def test_the_rules_are_rebuilt_only_when_the_codecs_in_force_change():
    from lightning_clapping.tuning import Tuning

    tuning, ex = Tuning(ClappingStrategy(variant="clapping-fc", forward_codec="q8", backward_codec="q8").options), \
        _Executor()
    tuning.set_codecs("q8", "q8", ex)  # the strategy's own codecs: rules and buffers kept
    assert ex.rebuilds == 0
    tuning.set_codecs("q2", "q2", ex)
    tuning.set_codecs("q2", "q2", ex)
    assert ex.rebuilds == 1 and tuning.codecs_wire() == ["q2", "q2"]
    tuning.restore(None, ex, None)  # a checkpoint saved before the switch: back to the strategy's codecs
    assert tuning.codecs is None and ex.rebuilds == 2
    tuning.restore(None, ex, ["q2", "q2"])
    assert tuning.codecs_wire() == ["q2", "q2"] and ex.rebuilds == 3
    with pytest.raises(ValueError, match="autotune=True"):
        Tuning(ClappingStrategy(variant="clapping-fc", autotune=True).options).set_codecs("q4", "q8", ex)


@pytest.mark.parametrize("kwargs, words", [({"variant": "uncompressed"}, "variant='uncompressed'"),
                                           ({"variant": "clapping-fc", "autotune": True}, "autotune=True")])
def test_a_run_the_schedule_cannot_change_is_refused_before_it_starts(kwargs, words):
    import lightning as L

    strategy = ClappingStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        strategy=strategy)
    with pytest.raises(ValueError, match=words):  # Lightning's setup hook: before the first step
        CodecScheduler({1: ("q4", "q8")}).setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="ClappingStrategy"):
        CodecScheduler({1: ("q4", "q8")}).setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")


def _fit(out: str, name: str, schedule: bool, codec: str, steps: int, resume: str | None = None) -> None:
    """2 stages, Clapping-FC with lazy sampling (p = 0.5; its loader also resumes mid-epoch), ``codec`` both ways (the
    scheduler switches to q2 at SWITCH); writes per step the training rules' codecs, the bytes sent and the loss."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _models import SequentialMLP, classification_data
    from lightning_clapping import LazySamplingDataModule

    class Record(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rules = trainer.strategy.executor.rules
            training = [r for name, r in rules.items() if r is not None and not name.startswith("eval")]
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.steps.append({"codecs": sorted({r.codec.name for r in training}), "loss": float(loss),
                               "bytes": trainer.strategy.byte_totals["bytes"]})

    torch.manual_seed(0)
    model = SequentialMLP(optimizer="adam", lr=0.01)
    x, y = classification_data(n=80, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record] + ([CodecScheduler({SWITCH: ("q2", "q2")})] if schedule else []),
                        strategy=ClappingStrategy(split_points=["net.4"], microbatches=2, variant="clapping-fc",
                                                  forward_codec=codec, backward_codec=codec))
    trainer.fit(model, datamodule=LazySamplingDataModule(loader, p=0.5, seed=7), ckpt_path=resume)
    if resume is None and steps < 6:
        trainer.save_checkpoint(Path(out, "mid.ckpt"))
    Path(out, f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps({"steps": record.steps}))


def _runs(out: str, resume: bool) -> None:
    if resume:  # new processes, as a resumed job has
        _fit(out, "resumed", True, "q8", 6, resume=str(Path(out, "mid.ckpt")))
    else:
        _fit(out, "scheduled", True, "q8", 6)
        _fit(out, "first", True, "q8", 4)  # stops after the switch, with a checkpoint
        _fit(out, "constant_q2", False, "q2", 6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("codec_scheduler")
    for resume in (False, True):
        launch_forked(_runs, str(out), resume, ranks=2, cwd=out, timeout=300)
    return {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]
            for name in ("scheduled", "first", "constant_q2", "resumed")}


def test_every_rank_switches_at_the_scheduled_step_and_the_wire_carries_the_new_codec(runs):
    for rank in runs["scheduled"]:
        assert [s["codecs"] for s in rank["steps"]] == [["q8"]] * SWITCH + [["q2"]] * (6 - SWITCH)
    sent = [s["bytes"] for s in runs["scheduled"][0]["steps"]]
    per_step = [b - a for a, b in zip([0.0] + sent, sent)]
    q2 = [s["bytes"] for s in runs["constant_q2"][0]["steps"]]
    q2_step = [b - a for a, b in zip([0.0] + q2, q2)]
    # a step after the switch (the buffers were rebuilt at it) sends what a run at q2 from the start sends
    assert per_step[-1] == q2_step[-1] < per_step[1]


def test_a_run_resumed_after_the_switch_continues_exactly(runs):
    for resumed in runs["resumed"]:
        assert [s["codecs"] for s in resumed["steps"]] == [["q2"]] * 2
    full, first, rest = (runs[name][0]["steps"] for name in ("scheduled", "first", "resumed"))
    assert [s["loss"] for s in first] == [s["loss"] for s in full[:4]]
    # exactly the same losses: the saved buffers were restored into the q2 rules they were saved from
    assert [s["loss"] for s in rest] == [s["loss"] for s in full[4:]]
