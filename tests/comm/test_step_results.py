"""Training steps wait on no collective: the loss and the logs ride back with the gradients, byte numbers lag a step.

One 3-stage run with Lightning's defaults (checkpointing, logger, progress bar) and a module that logs with
``sync_dist=True``; every rank counts the collectives it enters inside each training step. The same launch then
trains again with ``autotune=True``. First, in one process: the results' byte layout carries everything
``self.log`` records, refuses what it cannot carry, and never unpickles.
"""

import inspect
import json
import math
import pickle

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics

from conftest import launch_forked
from lightning_clapping.comm.results_layout import OPTION_NAMES
from lightning_clapping.comm.step_results import pack_results, unpack_results
from lightning_clapping.comm.wire import WireError
from lightning_clapping.log_relay import LogRelay

STAGES, STEPS = 3, 8


class _Logging(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.acc = torchmetrics.MeanMetric()


def _relayed(log_calls):
    """What the last stage sends for these ``self.log`` calls (two micro-batches of 4 samples each)."""
    module = _Logging()
    relay = LogRelay(module)
    for _ in range(2):
        with relay.capture(4):
            log_calls(module)
    return relay.to_wire(relay.combined())


def test_everything_self_log_records_comes_back_from_the_results_bytes():
    def calls(m):
        m.log("loss", torch.tensor(0.5), prog_bar=True, reduce_fx="sum")
        m.log("peak", 2, on_step=True, on_epoch=False, reduce_fx=torch.max, sync_dist=True)
        m.log("lr", 1e-3, logger=False, rank_zero_only=True, add_dataloader_idx=False, batch_size=3)
        m.log("low", 0.25, reduce_fx=min, enable_graph=True, logger=None)
        m.acc(torch.tensor([1.0, 2.0]))
        m.log("acc", m.acc, on_epoch=True)

    wire = _relayed(calls)
    assert [r[0] for r in wire] == ["loss", "peak", "lr", "low", "acc"] and wire[-1][3] is not None
    fingerprint = (0, 12345, 2**64 - 1)
    assert unpack_results(pack_results(0.125, wire, fingerprint)) == (0.125, wire, fingerprint)
    assert unpack_results(pack_results(None, [], None)) == (None, [], None)


def test_the_layout_knows_every_keyword_of_self_log():
    keywords = set(inspect.signature(pl.LightningModule.log).parameters) - {"self", "name", "value"}
    assert set(OPTION_NAMES) == keywords


def test_a_value_or_option_the_layout_cannot_carry_is_refused_with_its_log_key():
    with pytest.raises(TypeError, match=r"self.log\('median', ...\): the option reduce_fx=.* cannot be sent"):
        pack_results(0.0, _relayed(lambda m: m.log("median", 1.0, reduce_fx=torch.median)), None)
    with pytest.raises(TypeError, match=r"self.log\('odd', ...\): a value of type complex cannot be sent"):
        pack_results(0.0, [("odd", 1j, {}, None)], None)


_RAN = []


def _ran():
    _RAN.append(True)
    return "ran"


class _Crafted:
    def __reduce__(self):
        return _ran, ()


def test_a_pickle_riding_as_step_results_is_refused_and_never_run():
    blob = pickle.dumps((0.0, _Crafted(), None))
    with pytest.raises(WireError, match="step results: not step results of this version"):
        unpack_results(blob)
    assert _RAN == []


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The folder of the launch that trains twice: logging with sync_dist=True, then with autotune=True."""
    out = tmp_path_factory.mktemp("collectives")
    launch_forked("collectives_run.py", str(out), "clapping-fc", "sync", "autotune", ranks=STAGES, cwd=out, timeout=360)
    return out


def _ranks(out, run):
    return [json.loads((out / f"collectives_{run}_rank{r}.json").read_text()) for r in range(STAGES)]


@pytest.fixture(scope="module")
def ranks(launched):
    return _ranks(launched, "sync")


def test_no_training_step_waits_on_a_collective(ranks):
    for rank, run in enumerate(ranks):
        assert len(run["steps"]) == STEPS
        for step, counted in enumerate(run["steps"]):
            # the byte numbers' all_gather is started and left running; it is read a step later. Before the first
            # step only, the stages exchange which values cross cuts (two all_gathers: sizes, then rows), then the
            # guard's summaries of recomputed values and its mismatch reports (two more of each: pipeline/agreement)
            first = ["all_gather"] * 6 if step == 0 else []
            assert counted["names"] == first + ["all_gather(async)"], (rank, step, counted["names"])


def test_every_rank_gets_the_last_stages_loss_and_logs_in_the_same_step(ranks):
    for step in range(STEPS):
        losses = {run["steps"][step]["loss"] for run in ranks}
        logged = {run["steps"][step]["logged"]["train_loss"] for run in ranks}
        assert len(losses) == 1 and not math.isnan(losses.pop())
        assert logged == {ranks[0]["steps"][step]["loss"]}  # logged this step, not the previous one
        assert {run["steps"][step]["logged"]["synced_loss"] for run in ranks} == logged


def test_sync_dist_reduces_over_replicas_not_stages(ranks):
    # 64 samples, logged per step with reduce_fx="sum": a reduction over the stages would give 3 x 64
    assert [run["samples"] for run in ranks] == [64.0] * STAGES


def test_byte_numbers_arrive_one_step_late_and_sum_exactly(ranks):
    rows = [run["steps"][step]["logged"] for run in ranks[:1] for step in range(STEPS)]
    assert "clapping/bytes" not in rows[0]  # the first step has no earlier step to describe
    logged = sum(r["clapping/bytes"] for r in rows[1:])  # steps 0..6, logged at steps 1..7
    totals = ranks[0]["totals"]
    assert totals["steps"] == STEPS  # the last step included
    # the last step's numbers are in the totals only; without lazy sampling every step sends the same messages
    assert totals["bytes"] - logged == rows[-1]["clapping/bytes"]
    assert totals["control_bytes"] > 0
    assert all(run["totals"] == totals for run in ranks)


def test_autotune_on_loopback_chooses_uncompressed_for_every_link_after_the_second_step(launched):
    runs = _ranks(launched, "autotune")
    steps = runs[0]["steps"]
    decided = steps[1]["logged"]  # measured and decided at the end of the second step
    assert {decided[f"autotune/b{m}_compressed"] for m in range(STAGES - 1)} == {0.0}
    assert all(decided[f"autotune/b{m}_fwd_mb_s"] > 10 for m in range(STAGES - 1))  # loopback: fast
    # the numbers logged at step t describe step t - 1: step 1 was compressed (q4/q8), steps 2.. are not (step 2
    # also announces the new message sizes)
    assert steps[2]["logged"]["clapping/ratio"] > 1.2
    assert steps[3]["logged"]["clapping/ratio"] < 1.0
    assert all(s["logged"]["clapping/ratio"] == 1.0 for s in steps[4:])
    assert all(run["steps"][-1]["loss"] == steps[-1]["loss"] for run in runs)

