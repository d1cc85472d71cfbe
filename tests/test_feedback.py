"""Error-feedback rules, encoder and decoder side by side in one process (fast), for every variant and codec."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_clapping import ClappingStrategy
from lightning_clapping.channel import message_nbytes, pack, unpack
from lightning_clapping.codecs import NonFiniteError, get_codec
from lightning_clapping.feedback import CODEC, FULL, RAW, SKIP, MessageRule, StepContext

VARIANTS = ["direct", "ef21", "clapping-fc", "clapping-fu", "aqsgd"]
CODECS = ["q4", "q2:group16:sr", "q1", "topk:0.2", "randk:0.3", "bf16", "fp8"]


def _pair(variant, codec, direction="fwd", **kw):
    return (MessageRule(variant, codec, 0, direction, **kw), MessageRule(variant, codec, 0, direction, **kw))


def _drive(sender, receiver, steps=12, slots=3, seed=0, p=0.5):
    """Send a slowly drifting activation per slot through the wire, as a run with lazy sampling would."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(4, 8, generator=g) for _ in range(slots)]
    ids = [torch.arange(4) + 4 * j for j in range(slots)]
    mask = torch.ones(4, 1, 8, dtype=torch.bool)
    history = []
    for step in range(steps):
        fresh = step == 0 or bool(torch.rand((), generator=g) < p)
        if fresh:
            base = [torch.randn(4, 8, generator=g) for _ in range(slots)]
            ids = [i + 100 * step for i in ids]
        ctx = StepContext(step=step, fresh=fresh, sample_ids=ids)
        expected_modes = [receiver.mode(j, ctx) for j in range(slots)]  # posted when the step starts
        for j in range(slots):
            base[j] = base[j] + 0.01 * torch.randn(4, 8, generator=g)
            act = base[j].clone().requires_grad_(True)
            assert sender.mode(j, ctx) == expected_modes[j], (step, j)
            parts = unpack(pack(sender.encode(j, [act, mask], ctx)))
            values = receiver.decode(j, parts, ctx)
            history.append((step, j, fresh, act.detach(), values, parts))
    return history


@pytest.mark.parametrize(("variant", "codec"), list(itertools.product(VARIANTS, CODECS)))
def test_sender_and_receiver_buffers_stay_bit_identical(variant, codec):
    sender, receiver = _pair(variant, codec)
    history = _drive(sender, receiver)
    s_state, r_state = sender.state(), receiver.state()
    assert s_state.keys() == r_state.keys()
    for k in s_state:
        assert torch.equal(s_state[k], r_state[k]), k
    for step, j, fresh, act, values, parts in history:
        assert torch.equal(values[1], torch.ones(4, 1, 8, dtype=torch.bool))  # the mask passes through raw
        assert parts[1].codec == RAW


@pytest.mark.parametrize("codec", CODECS)
def test_feedback_value_is_the_shared_buffer(codec):
    sender, receiver = _pair("clapping-fc", codec)
    for step, j, fresh, act, values, parts in _drive(sender, receiver, steps=4):
        assert torch.equal(values[0], sender.buffers[(j, 0, -1)]) or step < 3  # later steps overwrite the buffer
    for j in range(3):
        assert torch.equal(receiver.buffers[(j, 0, -1)], sender.buffers[(j, 0, -1)])


def test_clapping_fu_sends_fresh_batches_in_full_precision_and_resets_the_buffers():
    sender, receiver = _pair("clapping-fu", "q2")
    for step, j, fresh, act, values, parts in _drive(sender, receiver, steps=16):
        if fresh:
            assert parts[0].codec == FULL and torch.equal(values[0], act)
        else:
            assert parts[0].codec == CODEC


def test_clapping_fu_with_every_batch_fresh_is_lossless():
    sender, receiver = _pair("clapping-fu", "q1")
    for *_, act, values, parts in _drive(sender, receiver, steps=6, p=1.0):
        assert torch.equal(values[0], act)


def test_clapping_fc_is_the_ef21_rule():
    fc = _drive(*_pair("clapping-fc", "q4"), steps=10)
    ef = _drive(*_pair("ef21", "q4"), steps=10)
    for a, b in zip(fc, ef):
        assert torch.equal(a[4][0], b[4][0])


def test_first_message_is_full_precision_only_with_warm_start():
    for warm, form in ((True, FULL), (False, CODEC)):
        sender, receiver = _pair("clapping-fc", "q4", warm_start=warm)
        first = _drive(sender, receiver, steps=1)[0]
        assert first[5][0].codec == form


def test_buffer_of_a_reused_batch_converges_to_the_true_activation():
    sender, receiver = _pair("clapping-fc", "q4", warm_start=False)
    x = torch.randn(8, 16).requires_grad_(True)
    errors = []
    for step in range(8):
        ctx = StepContext(step=step, fresh=step == 0)
        value = receiver.decode(0, unpack(pack(sender.encode(0, [x], ctx))), ctx)[0]
        errors.append(float((value - x.detach()).norm() / x.detach().norm()))
    assert errors[0] > 0.01
    assert all(b < 0.2 * a for a, b in zip(errors, errors[1:]) if a > 1e-6)
    assert errors[-1] < 1e-6


def test_aqsgd_keeps_one_buffer_per_sample_and_clapping_one_per_slot():
    aq = _pair("aqsgd", "q4")
    fc = _pair("clapping-fc", "q4")
    _drive(*aq, steps=20, p=0.5)
    _drive(*fc, steps=20, p=0.5)
    samples_seen = len(aq[0].store[0])
    assert samples_seen > 3 * 4  # more than one batch worth of samples
    assert aq[0].state_bytes() == samples_seen * 8 * 2  # one fp16 row of 8 values per sample
    assert fc[0].state_bytes() == 3 * 4 * 8 * 4  # 3 slots x [4, 8] fp32, whatever the data size


def test_aqsgd_sends_first_visits_in_full_and_later_visits_compressed():
    sender, receiver = _pair("aqsgd", "q4")
    ctx = StepContext(step=0, fresh=True, sample_ids=[torch.arange(4)])
    x = torch.randn(4, 8).requires_grad_(True)
    assert sender.encode(0, [x], ctx)[0].codec == FULL
    assert sender.encode(0, [x], StepContext(step=1, fresh=True, sample_ids=[torch.arange(4)]))[0].codec == CODEC


def test_aqsgd_without_sample_ids_says_how_to_get_them():
    sender, _ = _pair("aqsgd", "q4")
    with pytest.raises(ValueError, match=r"LazySamplingDataModule\(dm, p=1.0\)"):
        sender.encode(0, [torch.randn(2, 3).requires_grad_(True)], StepContext())


def test_gradients_are_compressed_directly_under_aqsgd():
    sender, receiver = _pair("aqsgd", "q8", direction="bwd")
    g = torch.randn(4, 8)
    part = sender.encode(0, [g], StepContext())[0]
    assert part.codec == CODEC and not sender.buffers and not sender.store


def test_non_finite_values_are_reported_with_boundary_and_direction():
    sender, _ = _pair("clapping-fc", "q4", warm_start=False)
    bad = torch.tensor([[1.0, float("nan")]], requires_grad=True)
    with pytest.raises(NonFiniteError, match=r"boundary 0 \(fwd\), micro-batch 0"):
        sender.encode(0, [bad], StepContext())


def test_lazy_messages_skip_small_differences_at_most_max_skips_in_a_row():
    sender, receiver = _pair("clapping-fc", "q4", lazy_threshold=0.5, max_skips=2)
    x = torch.randn(4, 8)
    forms = []
    for step in range(8):
        ctx = StepContext(step=step, fresh=step == 0)
        y = (x + 0.001 * step).requires_grad_(True)
        parts = sender.encode(0, [y], ctx)
        receiver.decode(0, unpack(pack(parts)), ctx)
        forms.append(parts[0].codec)
    assert forms[0] == FULL and SKIP in forms
    runs = "".join("s" if f == SKIP else "x" for f in forms)
    assert "sss" not in runs
    assert torch.equal(sender.buffers[(0, 0, -1)], receiver.buffers[(0, 0, -1)])


def test_steady_state_messages_have_the_codecs_exact_size():
    sender, receiver = _pair("clapping-fc", "q4")
    sizes = {}
    for step, j, fresh, act, values, parts in _drive(sender, receiver, steps=6):
        if parts[0].codec == CODEC:
            sizes.setdefault(j, set()).add(len(pack(parts)))
    codec = get_codec("q4")
    expected = message_nbytes([((4, 8), codec.payload_nbytes((4, 8), torch.float32)), ((4, 1, 8), 32)])
    assert sizes and all(s == {expected} for s in sizes.values())


def test_evaluation_is_uncompressed_unless_asked():
    strategy = ClappingStrategy(variant="clapping-fc", forward_codec="q4")
    assert strategy.make_rule(0, "fwd", training=False).kind == "raw"
    assert strategy.make_rule(0, "fwd", training=True).kind == "feedback"
    compressed = ClappingStrategy(variant="clapping-fc", compress_eval=True)
    assert compressed.make_rule(0, "fwd", training=False).kind == "direct"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"variant": "clapping"}, "unknown variant 'clapping'"),
    ({"variant": "clapping-fc", "forward_codec": "q9"}, "q9"),
    ({"variant": "clapping-fc", "backward_codec": "topk:2"}, "topk"),
    ({"lazy_messages": -1.0}, "lazy_messages must be a positive threshold"),
])
def test_bad_compression_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClappingStrategy(**kwargs)
