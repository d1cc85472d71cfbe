"""Tied weights across stages train as in one process: every stage that uses a tied tensor holds a copy, the copies'
gradients are summed every optimizer step, so they stay bit-identical, and checkpoints hold the tensor once."""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import SCRIPTS, launch_forked, run_gloo_ranks
from lightning_clapping.pipeline.partition import TiedGroup, build_partition
from lightning_clapping.pipeline.stage import StageRunner

sys.path.insert(0, str(SCRIPTS))

TIE_BYTES = 2 * 97 * 32 * 4  # GPT-2's tied embedding (97 x 32 fp32), sent once each way per optimizer step


class TiedLM(nn.Module):
    """The common way to write a tied-embedding LM: the head's weight is the embedding's."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


# ---------------------------------------------------------------------------------------------------- partition
def test_the_partition_records_a_tensor_tied_across_stages_and_each_stage_keeps_its_own_copy():
    model = TiedLM(blocks=3)
    part = build_partition(model, 3, ["blocks.1", "blocks.2"])
    assert part.tied == (TiedGroup(("emb.weight", "head.weight"), (0, 2)),)
    assert part.tied[0].stages == (0, 2) and part.tied[0].key_on(1) is None
    assert part.state_stage["emb.weight"] == 0 and part.state_stage["head.weight"] == 2
    assert part.stage_params[0] == 40 + 20 and part.stage_params[2] == 20 + 40  # both stages hold the 40 values
    first = TiedLM(blocks=3)
    StageRunner(first, build_partition(first, 3, ["blocks.1", "blocks.2"]), 0).release_foreign_state()
    assert first.emb.weight.device.type == "cpu" and first.head.weight.is_meta  # the head's copy is released alone
    assert build_partition(TiedLM(), 1).tied == ()  # a tie inside one stage is an ordinary shared parameter


# ------------------------------------------------------------------------------- the sum, on three gloo ranks
GROUPS = [TiedGroup(("a.weight", "c.weight"), (0, 2)), TiedGroup(("a.bias", "b.bias", "c.bias"), (0, 1, 2))]


def _grad(step: int, group: int, stage: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + 10 * group + stage))


def _sum_worker(rank, port, out):
    from lightning_clapping.codecs import get_codec
    from lightning_clapping.comm.ties import TiedGradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        for codec in (None, "q4"):
            torch.manual_seed(rank)  # the copies start apart: the sync must make them equal
            model = nn.ModuleDict({"a": nn.Linear(3, 5), "b": nn.Linear(3, 5), "c": nn.Linear(3, 5)})
            ties = TiedGradients(GROUPS, rank, lambda s: s, None, torch.device("cpu"),
                                 None if codec is None else get_codec(codec), timedelta(seconds=20))
            ties.sync_copies(model)
            got = {"synced": {k: model.get_parameter(g.key_on(rank)).detach().clone() for k, g in
                              enumerate(GROUPS) if g.key_on(rank)}}
            for step in range(2):
                for k, g in enumerate(GROUPS):
                    if rank in g.stages:
                        p = model.get_parameter(g.key_on(rank))
                        p.grad = _grad(step, k, rank, p.shape)
                ties.sum_gradients(model, step)
                got[step] = {k: model.get_parameter(g.key_on(rank)).grad.clone()
                             for k, g in enumerate(GROUPS) if g.key_on(rank)}
            if codec is not None:  # an overflow step (16-bit loss scaling): stage 1's gradient is inf
                kept = {k: v.clone() for k, v in ties.residuals.items()}
                for k, g in enumerate(GROUPS):
                    if rank in g.stages:
                        p = model.get_parameter(g.key_on(rank))
                        p.grad = torch.full_like(p, math.inf) if rank == 1 else _grad(2, k, rank, p.shape)
                ties.sum_gradients(model, 2)
                got["overflow"] = {k: bool(torch.isnan(model.get_parameter(g.key_on(rank)).grad).all())
                                   for k, g in enumerate(GROUPS) if g.key_on(rank)}
                got["residual_kept"] = rank != 1 or torch.equal(ties.residuals[1], kept[1])
            got["bytes"] = ties.step_bytes(model)
            got["residuals"] = sorted(ties.state())
            out.put((codec, rank, got))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put(("error", rank, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def summed():
    items, exitcodes = run_gloo_ranks(_sum_worker, expected=6, world=3, timeout=200)
    errors = [v for c, _, v in items if c == "error"]
    assert not errors and len(items) == 6, (errors, exitcodes)
    return {(codec, rank): got for codec, rank, got in items}


def test_every_copy_gets_the_sum_of_the_copies_gradients_added_in_stage_order(summed):
    for step in range(2):
        for k, g in enumerate(GROUPS):
            parts = [_grad(step, k, s, summed[(None, g.stages[0])][step][k].shape) for s in g.stages]
            expected = parts[0].clone()
            for part in parts[1:]:
                expected += part
            for s in g.stages:
                assert torch.equal(summed[(None, s)][step][k], expected), (step, k, s)
    for k, g in enumerate(GROUPS):  # the copies started from the first member's values
        for s in g.stages:
            assert torch.equal(summed[(None, s)]["synced"][k], summed[(None, g.stages[0])]["synced"][k])
    weight, bias = 5 * 3 * 4, 5 * 4
    assert summed[(None, 0)]["bytes"] == (2 * weight + 6 * bias, 2 * weight + 6 * bias)  # k(k-1) payloads a group


def test_a_compressed_sum_leaves_the_copies_bit_identical_and_keeps_its_residual_on_the_sender(summed):
    for step in range(2):
        for k, g in enumerate(GROUPS):
            sums = [summed[("q4", s)][step][k] for s in g.stages]
            for other in sums[1:]:
                assert torch.equal(other, sums[0]), (step, k)
            exact = sum(_grad(step, k, s, sums[0].shape) for s in g.stages)
            assert not torch.equal(sums[0], exact)  # really compressed ...
            assert (sums[0] - exact).norm() < 0.5 * exact.norm()  # ... and close
    for s in range(3):  # stage 1's overflow reaches every copy of its group (NaN), and only those
        assert summed[("q4", s)]["overflow"] == ({0: False, 1: True} if s != 1 else {1: True})
        assert summed[("q4", s)]["residual_kept"]
    sent, raw = summed[("q4", 1)]["bytes"]
    assert sent < raw / 2  # tiny tensors: the per-row scales weigh
    assert summed[("q4", 1)]["residuals"] == ["tied.a.bias"] and summed[(None, 1)]["residuals"] == []


# ------------------------------------------------------------------------- Hugging Face models, as users train them
def _row(out, case, mode, rank=0):
    return json.loads((out / f"{case}_{mode}_rank{rank}.json").read_text())


def _weights(out, case, mode):
    return torch.load(out / f"{case}_{mode}_weights.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches: 2 processes (GPT-2, GPT-2 with a compressed tied sum, BERT), 4 processes (GPT-2 on 4 stages,
    GPT-2 on 2 stages x 2 replicas with accumulation and clipping) and one process (the references, and resuming the
    pipeline's checkpoint)."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tied")
    launch_forked("tied_run.py", str(out), "pipe", "gpt2,gpt2q,bert,hparams,bert_resume", ranks=2, cwd=out,
                  timeout=600)
    launch_forked("tied_run.py", str(out), "pipe", "gpt2x4,bertx4,replicas,replicas_diloco,replicas_every,replicas_diloco1",
                  ranks=4, cwd=out,
                  timeout=600)
    launch_forked("tied_run.py", str(out), "single", "gpt2,bert,replicas,resume,bert_resume", ranks=1, cwd=out,
                  timeout=600)
    return SimpleNamespace(out=out)


def _assert_weights_close(a, b):
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("case, reference", [("gpt2", "gpt2"), ("gpt2x4", "gpt2"), ("bert", "bert"),
                                             ("bertx4", "bert")])
def test_tied_models_train_on_2_and_4_stages_as_in_one_process(runs, case, reference):
    pipe, single = _row(runs.out, case, "pipe"), _row(runs.out, reference, "single")
    assert len(pipe["losses"]) == len(single["losses"]) == 4
    assert pipe["losses"] == pytest.approx(single["losses"], abs=1e-5)
    _assert_weights_close(_weights(runs.out, case, "pipe"), _weights(runs.out, reference, "single"))


def test_replicas_with_accumulation_and_clipping_train_as_one_process_on_the_union_of_their_batches(runs):
    _assert_weights_close(_weights(runs.out, "replicas", "pipe"), _weights(runs.out, "replicas", "single"))


def test_diloco_with_one_inner_step_trains_a_tied_model_as_every_step_averaging(runs):
    # H=1, outer lr 1, no momentum under SGD: the outer step applies the replicas' average SGD step, on each stage's
    # copy of the tied tensor from the same tied sum
    _assert_weights_close(_weights(runs.out, "replicas_diloco1", "pipe"),
                          _weights(runs.out, "replicas_every", "pipe"))


@pytest.mark.parametrize("case, ranks", [("gpt2", 2), ("gpt2x4", 4), ("bert", 2), ("bertx4", 4), ("gpt2q", 2),
                                         ("replicas", 4), ("replicas_diloco", 4)])
def test_the_tied_copies_are_bit_identical_across_stages_at_the_end(runs, case, ranks):
    # replicas_diloco: local steps between syncs, compressed tied sums and pseudo-gradients, then the end-of-fit sync
    copies = [v for r in range(ranks) for v in torch.load(runs.out / f"{case}_pipe_copies_rank{r}.pt").values()]
    assert len(copies) == (4 if case.startswith("replicas") else 2)  # two per pipeline: the middle stages hold none
    for other in copies[1:]:
        assert torch.equal(other, copies[0])


@pytest.mark.parametrize("case", ["gpt2", "gpt2x4", "bert"])
def test_after_fit_the_launching_process_holds_the_tied_tensor_once(runs, case):
    assert _row(runs.out, case, "pipe")["tied_after_fit"] is True


def test_a_compressed_tied_sum_trains(runs):
    row = _row(runs.out, "gpt2q", "pipe")
    assert len(row["losses"]) == 12 and row["losses"][-1] < row["losses"][0] - 1.5  # from 4.6 (uniform over 97)
    from lightning_clapping.codecs import get_codec

    payload = get_codec("q4").payload_nbytes((97, 32), torch.float32)
    assert row["metrics"]["clapping/tied_bytes"] == 2 * (payload + 1) < TIE_BYTES / 6  # + a byte: finite or not
    assert row["totals"]["tied_bytes"] == 12 * 2 * (payload + 1)


def test_the_tied_sum_is_counted_in_the_byte_totals(runs):
    row = _row(runs.out, "gpt2", "pipe")
    metrics, totals = row["metrics"], row["totals"]
    assert metrics["clapping/tied_bytes"] == TIE_BYTES
    assert metrics["clapping/bytes"] == metrics["clapping/b0_fwd_bytes"] + metrics["clapping/b0_bwd_bytes"] + TIE_BYTES
    assert totals["tied_bytes"] == 4 * TIE_BYTES and totals["bytes"] > totals["tied_bytes"]
    assert _row(runs.out, "replicas", "pipe")["totals"]["tied_bytes"] == 2 * TIE_BYTES  # once per optimizer step


@pytest.mark.parametrize("case", ["gpt2", "bert"])
def test_load_from_checkpoint_in_one_process_gives_the_trained_model_and_the_file_holds_the_tensor_once(runs, case):
    from tied_run import TIED, TiedLM

    path = _row(runs.out, case, "pipe")["checkpoint"]
    saved = torch.load(path, weights_only=False)["state_dict"]
    trained, single = _weights(runs.out, case, "pipe"), _weights(runs.out, case, "single")
    assert set(saved) == set(single)  # every key a one-process state_dict() has
    first, second = TIED[case]
    assert saved[first].data_ptr() == saved[second].data_ptr()  # one tensor under both names
    loaded = TiedLM.load_from_checkpoint(path)
    assert loaded.model.get_output_embeddings().weight is loaded.model.get_input_embeddings().weight
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_a_network_saved_in_the_hyperparameters_comes_back_tied_and_trained(runs):
    from tied_run import NetHolder

    loaded = NetHolder.load_from_checkpoint(_row(runs.out, "hparams", "pipe")["checkpoint"], weights_only=False)
    net = loaded.hparams.net  # what load_from_checkpoint rebuilt the model from
    assert net.lm_head.weight is net.transformer.wte.weight  # one parameter again: one-process training trains it once
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, _weights(runs.out, "hparams", "pipe")[name]), name


@pytest.mark.parametrize("case, mode", [("resume", "single"), ("bert_resume", "single"), ("bert_resume", "pipe")])
def test_the_pipeline_checkpoint_resumes_in_one_process_and_on_the_pipeline(runs, case, mode):
    row = _row(runs.out, case, mode)  # optimizer state as one process lays it out: a tied tensor once
    assert "error" not in row, row.get("error")
    assert row["steps"] == 8 and len(row["losses"]) == 4 and all(math.isfinite(v) for v in row["losses"])


@pytest.mark.parametrize("value, error, match", [
    ({1: "q4"}, TypeError, "tied_codec compresses the sum of tied gradients.*give one codec"),
    ("q99", ValueError, "tied_codec='q99' is not a codec"),
    (3, ValueError, "tied_codec=3 is not a codec.*available_codecs"),
])
def test_a_bad_tied_codec_is_refused_with_the_reason(value, error, match):
    import lightning_clapping

    with pytest.raises(error, match=match):
        lightning_clapping.ClappingStrategy(tied_codec=value)
