"""Compression on real processes: 3 stages on gloo, short runs with lazy sampling (one launch for all cases)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from lightning_clapping.comm.wire import message_nbytes
from lightning_clapping.codecs import get_codec
from conftest import launch_forked

RUNS = {
    "raw_p1": {"variant": "uncompressed", "p": 1.0},
    "fu_p1": {"variant": "clapping-fu", "p": 1.0},
    "ef21": {"variant": "ef21", "p": 1.0},
    "fc_p1": {"variant": "clapping-fc", "p": 1.0},
    "fc_mixed": {"variant": "clapping-fc", "fwd": "q2:group16:sr", "bwd": "topk:0.2", "p": 0.5},
    "fu_mixed": {"variant": "clapping-fu", "fwd": "randk:0.3", "bwd": "q4", "p": 0.5},
    "fu_half": {"variant": "clapping-fu", "p": 0.5},
    "fu_fresh": {"variant": "clapping-fu", "fresh": "q8", "p": 0.5},
    "fc_link1": {"variant": "clapping-fc", "fwd": {"1": "q4"}, "bwd": {"1": "q8"}, "p": 0.5},
    "aq": {"variant": "aqsgd", "p": 1.0, "steps": 10},
    "lazy": {"variant": "clapping-fc", "lazy": 0.05, "p": 0.2, "lr": 0.01},
    "lazy_off": {"variant": "clapping-fc", "p": 0.2, "lr": 0.01},
    "converge": {"variant": "clapping-fc", "warm_start": False, "lr": 0.0, "p": 0.01, "steps": 8},
    "dropout": {"variant": "uncompressed", "dropout": True, "lr": 0.0, "p": 0.3, "steps": 10},
}
STAGES = 3


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("compression")
    launch_forked("feedback_run.py", str(path), *(f"{k}={json.dumps(v)}" for k, v in RUNS.items()), ranks=STAGES,
                  cwd=path, timeout=900)
    return path


def _rank(out, name, rank):
    return torch.load(out / f"{name}_rank{rank}.pt")


def _by_stage(out, name):
    states = [_rank(out, name, r) for r in range(STAGES)]
    return {s["stage"]: s for s in states}


def _metrics(out, name):
    with open(out / name / "version_0" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("clapping/bytes")]


def _weights(out, name):
    merged = {}
    for r in range(STAGES):
        merged.update(_rank(out, name, r)["weights"])
    return merged


@pytest.mark.parametrize("name", ["ef21", "fc_p1", "fc_mixed", "fu_mixed", "fu_fresh", "aq", "lazy"])
def test_both_ends_of_every_boundary_hold_bit_identical_buffers(out, name):
    stages = _by_stage(out, name)
    compared = 0
    for s in range(STAGES - 1):
        for a, b in (("fwd_out", "fwd_in"), ("bwd_in", "bwd_out")):
            mine, theirs = stages[s]["feedback"][a], stages[s + 1]["feedback"][b]
            assert mine.keys() == theirs.keys()
            for key in mine:
                torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, equal_nan=True,
                                           msg=str((s, a, key)))
                # lazy-message triggers next to each buffer, and AQ-SGD's order of its rows, are not buffers
                compared += not key.endswith((".last_rel", ".skips", ".order"))
    if name != "aq":  # AQ-SGD compresses gradients directly: no backward buffers
        assert compared == (STAGES - 1) * 2 * 4  # two directions x four micro-batch slots per boundary
    else:
        assert compared == (STAGES - 1) * 64  # one buffer per training sample


def test_clapping_fu_with_p1_trains_exactly_like_uncompressed(out):
    a, b = _weights(out, "fu_p1"), _weights(out, "raw_p1")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bytes_handed_to_torch_distributed_are_the_packed_payload(out):
    rows = _metrics(out, "fc_p1")
    q4 = get_codec("q4")
    one = message_nbytes([((4, 32), q4.payload_nbytes((4, 32), torch.float32))])
    for step in range(2, 6):  # after the warm-start and first-resize steps every message is a q4 payload
        sent = torch.load(out / f"fc_p1_sent_step{step}.pt")
        assert all(m.dtype == torch.uint8 and m.dim() == 1 for m in sent)
        assert [m.numel() for m in sent] == [one] * 4
        assert float(rows[step]["clapping/b0_fwd_bytes"]) == 4 * one
    raw_rows = _metrics(out, "raw_p1")
    raw_one = message_nbytes([((4, 32), 4 * 32 * 4)])
    assert float(raw_rows[3]["clapping/b0_fwd_bytes"]) == 4 * raw_one
    assert raw_one > 2 * one  # 4-bit codes plus one fp32 scale per channel, against fp32 values


def test_compression_ratio_is_logged_and_on_the_progress_bar(out):
    rows = _metrics(out, "fc_p1")
    assert float(rows[3]["clapping/ratio"]) > 1.5
    assert float(_metrics(out, "raw_p1")[3]["clapping/ratio"]) == pytest.approx(1.0)
    assert "clapping/ratio" in json.loads((out / "fc_p1_progress_bar.json").read_text())


def test_on_a_reused_batch_the_buffer_converges_to_the_true_activation(out):
    rows = _metrics(out, "converge")  # lr = 0: the activation stays put while the batch is reused
    assert all(r["clapping/fresh"] == "0.0" for r in rows[1:])
    diffs = [float(r["clapping/fwd_rel_diff"]) for r in rows]
    assert diffs[0] == pytest.approx(1.0)  # no warm start: the first difference is the activation itself
    assert all(b < 0.2 * a for a, b in zip(diffs, diffs[1:4]))
    assert diffs[-1] < 1e-4


def test_aqsgd_memory_grows_with_distinct_samples_while_clapping_keeps_one_batch(out):
    aq = [float(r["clapping/feedback_bytes"]) for r in _metrics(out, "aq")]
    seen = [float(r["clapping/distinct_samples"]) for r in _metrics(out, "aq")]
    # two boundaries, both ends, one fp16 row of 32 values per sample seen (the dataset has 64 samples)
    assert aq == [2 * 2 * min(s, 64) * 32 * 2 for s in seen]
    fc = {float(r["clapping/feedback_bytes"]) for r in _metrics(out, "fc_mixed")}
    # two boundaries x two directions x two ends x one [16, 32] fp32 batch
    assert fc == {2 * 2 * 2 * 16 * 32 * 4}


def test_lazy_messages_send_fewer_bytes_and_keep_training(out):
    lazy, full = _metrics(out, "lazy"), _metrics(out, "lazy_off")
    assert sum(float(r["clapping/skipped_messages"]) for r in lazy) > 0
    assert sum(float(r["clapping/bytes"]) for r in lazy) < 0.9 * sum(float(r["clapping/bytes"]) for r in full)
    assert float(lazy[-1]["train_loss"]) == pytest.approx(float(full[-1]["train_loss"]), rel=0.02)


def test_dropout_masks_are_frozen_while_a_batch_is_reused(out):
    rows = _metrics(out, "dropout")  # lr = 0 and uncompressed: a reused batch must send the very same activation
    fresh = [r["clapping/fresh"] == "1.0" for r in rows]
    sent = [torch.load(out / f"dropout_sent_step{i}.pt") for i in range(len(rows))]
    reuse_pairs = [i for i in range(1, len(rows)) if not fresh[i]]
    fresh_steps = [i for i in range(1, len(rows)) if fresh[i]]
    assert reuse_pairs and fresh_steps
    for i in reuse_pairs:
        assert all(torch.equal(a, b) for a, b in zip(sent[i], sent[i - 1])), f"step {i} changed within its window"
    for i in fresh_steps:
        assert not all(torch.equal(a, b) for a, b in zip(sent[i], sent[i - 1]))


def test_a_codec_per_boundary_compresses_only_the_links_it_names(out):
    rows = _metrics(out, "fc_link1")  # forward {1: q4}, backward {1: q8}: boundary 0 stays uncompressed
    raw_one = message_nbytes([((4, 32), 4 * 32 * 4)])
    q4_one = message_nbytes([((4, 32), get_codec("q4").payload_nbytes((4, 32), torch.float32))])
    for r in rows[2:]:
        assert float(r["clapping/b0_fwd_bytes"]) == 4 * raw_one
        assert float(r["clapping/b1_fwd_bytes"]) == 4 * q4_one
    stages = _by_stage(out, "fc_link1")
    assert stages[0]["feedback"]["fwd_out"] == {}  # no error feedback on the uncompressed link
    assert len(stages[1]["feedback"]["fwd_out"]) == 4  # one buffer per micro-batch slot on the compressed one


def test_a_fresh_codec_sends_clapping_fus_fresh_steps_compressed(out):
    plain, fresh = _metrics(out, "fu_half"), _metrics(out, "fu_fresh")
    assert [r["clapping/fresh"] for r in plain] == [r["clapping/fresh"] for r in fresh]  # same sampling decisions
    fresh_steps = [i for i, r in enumerate(plain) if r["clapping/fresh"] == "1.0" and i > 0]
    reuse_steps = [i for i, r in enumerate(plain) if r["clapping/fresh"] == "0.0"]
    assert fresh_steps and reuse_steps
    q8 = message_nbytes([((4, 32), get_codec("q8").payload_nbytes((4, 32), torch.float32))])
    for i in fresh_steps:  # full precision without it, q8 with it
        assert float(fresh[i]["clapping/b0_fwd_bytes"]) == 4 * q8 < float(plain[i]["clapping/b0_fwd_bytes"])
    for i in reuse_steps:  # reuse steps keep the forward codec
        assert fresh[i]["clapping/b0_fwd_bytes"] == plain[i]["clapping/b0_fwd_bytes"]

