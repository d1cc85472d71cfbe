"""Error-feedback rules, encoder and decoder side by side in one process (fast), for every variant and codec."""

from __future__ import annotations

import io
import itertools
from typing import NamedTuple

import pytest
import torch

from lightning_clapping import ClappingStrategy
from lightning_clapping.codecs import NonFiniteError, get_codec
from lightning_clapping.codecs.feedback import MessageRule, StepContext
from lightning_clapping.comm.wire import CODEC, FULL, RAW, SKIP, message_nbytes, pack, unpack

VARIANTS = ["direct", "ef21", "clapping-fc", "clapping-fu", "aqsgd"]
CODECS = ["q4", "q2:group16:sr", "q1", "topk:0.2", "randk:0.3", "bf16", "fp8"]


def _pair(variant, codec, direction="fwd", **kw):
    return (MessageRule(variant, codec, 0, direction, **kw), MessageRule(variant, codec, 0, direction, **kw))


class Msg(NamedTuple):
    """One message through a driven pair: the step, the activation sent, what the receiver made of it, the parts on
    the wire, the form both ends predicted, and both ends' state right after it."""

    ctx: StepContext
    slot: int
    act: torch.Tensor
    values: list
    parts: list
    mode: tuple
    sent: dict
    received: dict


def _inputs(steps=12, slots=3, seed=0, p=0.5, sizes=None, pool=None):
    """Per step, its context and one activation per micro-batch, as a run with lazy sampling sends them: a fresh
    batch (probability p) brings new activations and sample ids, a reused one drifts slowly.

    ``sizes(step)`` gives a fresh batch's micro-batch sizes and sets ``ctx.sizes`` (default: 4 rows each, no sizes);
    ``pool`` draws sample ids with replacement from ``range(pool)``, so they repeat within and across micro-batches.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        fresh = step == 0 or bool(torch.rand((), generator=g) < p)
        if fresh:
            n = sizes(step) if sizes else [4] * slots
            base = [torch.randn(m, 8, generator=g) for m in n]
            if pool:
                ids = [torch.randint(pool, (m,), generator=g) for m in n]
            else:
                ids = [torch.arange(m) + 100 * step + 10 * j for j, m in enumerate(n)]
        base = [b + 0.01 * torch.randn(b.shape, generator=g) for b in base]
        out.append((StepContext(step=step, fresh=fresh, sample_ids=ids, sizes=n if sizes else None), base))
    return out


_FORM = {"raw": RAW, "direct": CODEC, "full": FULL, "codec": CODEC, "fresh": CODEC, "skip": SKIP}


def _wire_form(mode):
    """The wire form of tensor 0 that a predicted mode announces."""
    return (CODEC if mode[1] else FULL) if mode[0] == "per-sample" else _FORM[mode[0]]


def _snapshot(rule):
    return {k: v.clone() for k, v in rule.state().items()}


def _assert_same_state(a, b, where=None):
    assert a.keys() == b.keys(), where
    for k in a:  # exact, NaN equal to NaN
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=f"{where}: {k}")


def _run(sender, receiver, inputs):
    """Send ``inputs`` (see :func:`_inputs`) through the wire; both ends must predict every message's form."""
    history = []
    for ctx, acts in inputs:
        modes = [receiver.mode(j, ctx) for j in range(len(acts))]  # posted when the step starts
        for j, a in enumerate(acts):
            assert sender.mode(j, ctx) == modes[j], (ctx.step, j)
            act = a.clone().requires_grad_(True)
            mask = torch.ones(a.shape[0], 1, 8, dtype=torch.bool)
            parts = unpack(pack(sender.encode(j, [act, mask], ctx)))
            if sender.warm_start:  # without it, "full" (no buffer yet) is a compressed difference to zeros
                assert parts[0].codec == _wire_form(modes[j]), (ctx.step, j, modes[j])
            values = receiver.decode(j, parts, ctx)
            history.append(Msg(ctx, j, act.detach(), values, parts, modes[j], _snapshot(sender), _snapshot(receiver)))
    return history


def _drive(sender, receiver, **kw):
    return _run(sender, receiver, _inputs(**kw))


SCENARIOS = {
    "plain": {},
    # a smaller last micro-batch, and now and then a smaller batch (the end of an epoch): buffers keyed per size
    "sizes": {"sizes": lambda step: [3, 3, 2] if step % 4 == 3 else [4, 4, 2]},
    # ids drawn with replacement: repeats within and across the micro-batches of a step
    "repeats": {"pool": 10},
}


def _name(m):
    """The state() name of the buffer that tensor 0 of message ``m`` uses."""
    return f"slot{m.slot}.t0.rows{m.ctx.sizes[m.slot] if m.ctx.sizes else -1}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("variant", "codec"), list(itertools.product(VARIANTS, CODECS)))
def test_sender_and_receiver_buffers_stay_bit_identical(variant, codec, scenario):
    sender, receiver = _pair(variant, codec, lazy_threshold=0.05)
    history = _drive(sender, receiver, **SCENARIOS[scenario])
    assert len({m.ctx.step for m in history if m.ctx.fresh}) > 2
    for m in history:  # after every message, not only at the end
        _assert_same_state(m.sent, m.received, (m.ctx.step, m.slot))
        assert m.parts[1].codec == RAW  # the mask passes through raw
        assert torch.equal(m.values[1], torch.ones(len(m.act), 1, 8, dtype=torch.bool))
    if variant != "direct":
        assert history[-1].sent  # there is state to compare


@pytest.mark.parametrize("scenario", ["plain", "sizes"])
@pytest.mark.parametrize("codec", CODECS)
def test_feedback_value_is_the_shared_buffer(codec, scenario):
    sender, receiver = _pair("clapping-fc", codec)
    used = set()
    for m in _drive(sender, receiver, steps=8, **SCENARIOS[scenario]):  # each message, as it arrives
        assert torch.equal(m.values[0], m.received[_name(m)]) and torch.equal(m.values[0], m.sent[_name(m)])
        assert m.parts[0].codec == (CODEC if _name(m) in used else FULL)  # a new buffer starts in full precision
        used.add(_name(m))
    assert scenario == "plain" or any("rows3" in name for name in used)


def test_a_smaller_batch_gets_buffers_of_its_own_and_leaves_the_full_size_ones():
    sender, receiver = _pair("clapping-fc", "q4")
    inputs = _inputs(steps=5, p=1.0, sizes=lambda step: [3, 3, 3] if step == 2 else [4, 4, 2])
    history = _run(sender, receiver, inputs)
    forms = [[m.parts[0].codec for m in history if m.ctx.step == step] for step in range(5)]
    # new sizes start in full precision (warm start); back at [4, 4, 2] the buffers of step 1 carry on
    assert forms == [[FULL] * 3, [CODEC] * 3, [FULL] * 3, [CODEC] * 3, [CODEC] * 3]
    q4 = get_codec("q4")
    for before, after in zip(history[3:6], history[9:12]):  # step 3 compresses against what step 1 left
        seed = sender.seed(after.ctx, after.slot, 0)
        assert torch.equal(after.parts[0].payload, q4.encode(after.act - before.values[0], seed=seed))
    assert sorted(k for k in receiver.state() if k.startswith("slot2")) == ["slot2.t0.rows2", "slot2.t0.rows3"]


def test_clapping_fu_sends_fresh_batches_in_full_precision_and_resets_the_buffers():
    sender, receiver = _pair("clapping-fu", "q2")
    for m in _drive(sender, receiver, steps=16):
        if m.ctx.fresh:
            assert m.parts[0].codec == FULL and torch.equal(m.values[0], m.act)
        else:
            assert m.parts[0].codec == CODEC


FRESH_CODECS = ["q8", "bf16", "q4:fp16", "topk:0.5+q8"]


@pytest.mark.parametrize("scenario", ["plain", "sizes"])
@pytest.mark.parametrize("fresh_codec", FRESH_CODECS)
@pytest.mark.parametrize("variant", ["ef21", "clapping-fc", "clapping-fu"])
def test_buffers_stay_bit_identical_with_a_fresh_codec(variant, fresh_codec, scenario):
    sender, receiver = _pair(variant, "q2:group16:sr", lazy_threshold=0.05, fresh_codec=fresh_codec)
    history = _drive(sender, receiver, **SCENARIOS[scenario])  # checks both ends predict every message's form
    assert sum(m.mode[0] == "fresh" for m in history) > 3 and sum(m.mode[0] == "codec" for m in history) > 3
    for m in history:
        _assert_same_state(m.sent, m.received, (m.ctx.step, m.slot))
        assert torch.equal(m.values[0], m.received[_name(m)])


def test_clapping_fu_sends_fresh_batches_with_the_fresh_codec_and_resets_the_buffers_to_what_it_decodes():
    sender, receiver = _pair("clapping-fu", "q2", fresh_codec="q8")
    q8, q2, buffer = get_codec("q8"), get_codec("q2"), {}
    history = _drive(sender, receiver, steps=12)
    for m in history:
        seed = sender.seed(m.ctx, m.slot, 0)
        if m.ctx.fresh:  # q8 of the activation itself, whatever the buffer held
            payload = q8.encode(m.act, seed=seed)
            buffer[m.slot] = q8.decode(payload, m.act.shape, m.act.dtype, seed=seed)
        else:  # q2 of the difference to the buffer, as without a fresh codec
            payload = q2.encode(m.act - buffer[m.slot], seed=seed)
            buffer[m.slot] = buffer[m.slot] + q2.decode(payload, m.act.shape, m.act.dtype, seed=seed)
        assert m.parts[0].codec == CODEC and torch.equal(m.parts[0].payload, payload), (m.ctx.step, m.slot)
        assert torch.equal(m.values[0], buffer[m.slot]) and torch.equal(m.sent[_name(m)], buffer[m.slot])
    assert sum(m.ctx.fresh for m in history[3:]) >= 3 and not all(m.ctx.fresh for m in history)


def test_clapping_fc_compresses_the_difference_with_the_fresh_codec_on_fresh_steps_only():
    sender, receiver = _pair("clapping-fc", "q2", fresh_codec="q8")
    codecs, A = {True: get_codec("q8"), False: get_codec("q2")}, {}
    history = _drive(sender, receiver, steps=12)
    for m in history:
        if m.slot not in A:  # warm start: the first message of a slot is still full precision
            assert m.parts[0].codec == FULL and m.mode == ("full",)
            A[m.slot] = m.act.clone()
            continue
        c, seed = codecs[m.ctx.fresh], sender.seed(m.ctx, m.slot, 0)
        payload = c.encode(m.act - A[m.slot], seed=seed)
        assert m.parts[0].codec == CODEC and torch.equal(m.parts[0].payload, payload)
        assert m.mode == (("fresh",) if m.ctx.fresh else ("codec",))
        A[m.slot] = A[m.slot] + c.decode(payload, m.act.shape, m.act.dtype, seed=seed)
        assert torch.equal(m.values[0], A[m.slot])
    assert sum(m.ctx.fresh for m in history[3:]) >= 3


@pytest.mark.parametrize("variant", ["clapping-fc", "clapping-fu"])
def test_each_predicted_form_has_one_message_size_with_a_fresh_codec(variant):
    # the channel sizes a receive by the predicted form: fresh-codec messages must not share a form with others
    sender, receiver = _pair(variant, "q2", fresh_codec="q8")
    sizes = {}
    for m in _drive(sender, receiver, steps=16, p=0.4):
        sizes.setdefault((m.slot, m.mode), set()).add(len(pack(m.parts)))
    assert any(mode == ("fresh",) for _, mode in sizes) and any(mode == ("codec",) for _, mode in sizes)
    assert all(len(s) == 1 for s in sizes.values()), sizes
    # the activation by q8, and the mask of 32 bools one bit each
    expected = message_nbytes([((4, 8), get_codec("q8").payload_nbytes((4, 8), torch.float32)), ((4, 1, 8), 4)])
    assert {s for (_, mode), (s,) in sizes.items() if mode == ("fresh",)} == {expected}


def test_a_fresh_codec_of_none_changes_nothing_and_direct_and_aqsgd_ignore_it():
    inputs = _inputs(steps=10)
    for variant in ("clapping-fu", "clapping-fc"):
        plain = _run(*_pair(variant, "q4"), inputs)
        explicit = _run(*_pair(variant, "q4", fresh_codec=None), inputs)
        assert all(torch.equal(pack(a.parts), pack(b.parts)) and a.mode == b.mode for a, b in zip(plain, explicit))
        assert "fresh" not in {m.mode[0] for m in plain}
    for variant in ("direct", "aqsgd"):
        plain = _run(*_pair(variant, "q4"), inputs)
        with_fresh = _run(*_pair(variant, "q4", fresh_codec="q8"), inputs)
        assert all(torch.equal(pack(a.parts), pack(b.parts)) for a, b in zip(plain, with_fresh))


def test_clapping_fu_with_every_batch_fresh_is_lossless():
    sender, receiver = _pair("clapping-fu", "q1")
    for m in _drive(sender, receiver, steps=6, p=1.0):
        assert torch.equal(m.values[0], m.act)


@pytest.mark.parametrize("codec", ["q4", "q2:group16:sr", "randk:0.3"])
@pytest.mark.parametrize("variant", ["ef21", "clapping-fc"])
def test_feedback_sends_the_codec_of_the_difference_to_a_buffer_both_ends_move_by_the_decoded_value(variant, codec):
    # by hand: A = the first activation (warm start, FULL); then the payload is C(a - A), and A += decode(payload),
    # fresh batch or not (ef21 and clapping-fc are this one rule; lazy sampling is what makes FC's batches repeat)
    sender, receiver = _pair(variant, codec)
    c, A = get_codec(codec), {}
    history = _drive(sender, receiver, steps=8)
    for m in history:
        if m.slot not in A:
            assert m.parts[0].codec == FULL and torch.equal(m.values[0], m.act)
            A[m.slot] = m.act.clone()
            continue
        seed = sender.seed(m.ctx, m.slot, 0)
        payload = c.encode(m.act - A[m.slot], seed=seed)
        assert m.parts[0].codec == CODEC and torch.equal(m.parts[0].payload, payload)
        A[m.slot] = A[m.slot] + c.decode(payload, m.act.shape, m.act.dtype, seed=seed)
        assert torch.equal(m.values[0], A[m.slot])
    assert any(m.ctx.fresh for m in history[3:]) and not all(m.ctx.fresh for m in history)


def test_on_a_fresh_batch_fc_compresses_against_the_old_buffer_where_fu_resets_it():
    inputs = _inputs(steps=10)
    fc, fu = _run(*_pair("clapping-fc", "q2"), inputs), _run(*_pair("clapping-fu", "q2"), inputs)
    fresh_later = [(a, b) for a, b in zip(fc, fu) if a.ctx.fresh and a.ctx.step > 0]
    assert fresh_later
    for a, b in fresh_later:
        assert (a.parts[0].codec, b.parts[0].codec) == (CODEC, FULL)
        assert torch.equal(b.values[0], b.act) and not torch.equal(a.values[0], a.act)


def test_first_message_is_full_precision_only_with_warm_start():
    for warm, form in ((True, FULL), (False, CODEC)):
        sender, receiver = _pair("clapping-fc", "q4", warm_start=warm)
        first = _drive(sender, receiver, steps=1)[0]
        assert first.parts[0].codec == form


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


def test_aqsgd_ends_agree_when_samples_repeat_within_a_step():
    # sampling with replacement (WeightedRandomSampler): ids repeat within and across the micro-batches of a step;
    # _run checks that the receiver, deciding every slot when the step starts, predicts each message's form
    sender, receiver = _pair("aqsgd", "q4")
    inputs = _inputs(steps=16, pool=10)
    tricky, seen = 0, set()  # slots whose only first visits are samples that an earlier slot of the step holds
    for ctx, _ in inputs:
        ids = [set(i.tolist()) for i in ctx.sample_ids]
        tricky += sum(1 for j in range(3) if not ids[j] <= seen and ids[j] <= seen.union(*ids[:j]))
        seen.update(*ids)
    assert tricky and any(len(set(i.tolist())) < 4 for ctx, _ in inputs for i in ctx.sample_ids)  # and inside one
    for m in _run(sender, receiver, inputs):
        _assert_same_state(m.sent, m.received, (m.ctx.step, m.slot))


def test_aqsgd_compresses_a_repeat_against_the_row_its_earlier_occurrence_left():
    sender, receiver = _pair("aqsgd", "q4")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ids = [torch.tensor([0, 1, 2, 3]), torch.tensor([3, 2, 1, 0]), torch.tensor([4, 4, 5, 5])]
    history = _run(sender, receiver, [(StepContext(step=0, fresh=True, sample_ids=ids), [x, x.flip(0), y])])
    # all of slot 1's samples appeared in slot 0 (a first visit there): compressed against slot 0's rows, which
    # hold its values up to fp16 rounding, so only that rounding is left to compress
    assert [m.parts[0].codec for m in history] == [FULL, CODEC, FULL]
    rounding = (x.half().float() - x).abs().max()
    assert 0 < (history[1].values[0] - x.flip(0)).abs().max() <= rounding
    # within one micro-batch the last occurrence of a sample keeps its row, on both ends
    for rule in (sender, receiver):
        assert torch.equal(rule.store[0][4], y[1].half()) and torch.equal(rule.store[0][5], y[3].half())


def test_aqsgd_store_is_bounded_evicting_the_least_recent_rows_alike_on_both_ends():
    sender, receiver = _pair("aqsgd", "q4", store_max_samples=20)
    assert sender.store_device == torch.device("cpu")  # off the accelerator unless asked
    with pytest.warns(UserWarning, match="per-sample store is full"):
        history = _drive(sender, receiver, steps=16, pool=30)  # 12 draws a step from 30 samples
    seen, revisits = set(), 0
    for m in history:
        _assert_same_state(m.sent, m.received, (m.ctx.step, m.slot))  # _run checked every predicted form too
        assert sum(".sample" in k for k in m.sent) <= 20
        ids = set(m.ctx.sample_ids[m.slot].tolist())
        earlier = set().union(*(set(i.tolist()) for i in m.ctx.sample_ids[:m.slot]))
        revisits += m.parts[0].codec == FULL and ids <= seen and not ids <= earlier  # an evicted sample came back
        seen |= ids
    assert revisits


def test_aqsgd_store_keeps_the_rows_the_receiver_counted_on_when_the_step_began():
    sender, receiver = _pair("aqsgd", "q4", store_max_samples=8)
    x = [torch.randn(4, 8) for _ in range(4)]
    steps = [(StepContext(step=0, fresh=True, sample_ids=[torch.arange(4), torch.arange(4, 8)]), x[:2]),
             # slot 0 brings 4 new samples: 4 rows must go, but not those of slot 1, predicted "visited" at the start
             (StepContext(step=1, fresh=True, sample_ids=[torch.arange(8, 12), torch.arange(4)]), x[2:])]
    with pytest.warns(UserWarning, match="per-sample store is full"):
        history = _run(sender, receiver, steps)
    assert [m.parts[0].codec for m in history] == [FULL, FULL, FULL, CODEC]
    assert list(sender.store[0]) == list(receiver.store[0]) == [8, 9, 10, 11, 0, 1, 2, 3]  # 4..7 were oldest


def test_aqsgd_store_smaller_than_one_step_says_so():
    sender, _ = _pair("aqsgd", "q4", store_max_samples=6)
    ctx = StepContext(step=0, fresh=True, sample_ids=[torch.arange(4), torch.arange(4, 8)])
    sender.encode(0, [torch.randn(4, 8).requires_grad_(True)], ctx)
    with pytest.raises(ValueError, match=r"step 0 holds 8 distinct samples.*store_max_samples=6"):
        sender.encode(1, [torch.randn(4, 8).requires_grad_(True)], ctx)


def test_aqsgd_store_resumed_from_sorted_names_evicts_as_the_uninterrupted_one():
    inputs = _inputs(steps=12, pool=30, seed=2)
    kw = {"store_max_samples": 20}
    with pytest.warns(UserWarning):
        whole = _run(*_pair("aqsgd", "q4", **kw), inputs)
        first = _pair("aqsgd", "q4", **kw)
        _run(*first, inputs[:6])
    resumed = _pair("aqsgd", "q4", **kw)
    for rule, old in zip(resumed, first):
        rule.load_state(dict(sorted(old.state().items())), torch.device("cpu"))  # a checkpoint may sort them
    with pytest.warns(UserWarning):
        rest = _run(*resumed, inputs[6:])
    assert [m.parts[0].codec for m in rest] == [m.parts[0].codec for m in whole[18:]]
    for a, b in zip(rest, whole[18:]):
        _assert_same_state(a.received, b.received)


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


@pytest.mark.parametrize("sizes", [None, lambda step: [4, 4, 2]], ids=["no-sizes", "smaller-last"])
@pytest.mark.parametrize("cut", [2, 3, 5])
def test_a_rule_restored_mid_run_skips_and_sends_exactly_like_the_uninterrupted_one(cut, sizes):
    kw = {"lazy_threshold": 0.05, "max_skips": 2}
    inputs = _inputs(steps=12, p=0.2, seed=1, sizes=sizes)
    whole = _run(*_pair("clapping-fc", "q4", **kw), inputs)
    first = _pair("clapping-fc", "q4", **kw)
    _run(*first, inputs[:cut])
    saved = [rule.state() for rule in first]
    for state in saved:  # flat str -> Tensor, as torch.distributed.checkpoint takes it
        assert any(".skips" in k for k in state) and any(".last_rel" in k for k in state)
        assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    stream = io.BytesIO()
    torch.save(saved, stream)
    resumed = _pair("clapping-fc", "q4", **kw)
    for rule, state in zip(resumed, torch.load(io.BytesIO(stream.getvalue()))):
        rule.load_state(state, torch.device("cpu"))
    rest = _run(*resumed, inputs[cut:])
    tail = whole[3 * cut:]
    assert [m.parts[0].codec for m in rest] == [m.parts[0].codec for m in tail]
    assert SKIP in [m.parts[0].codec for m in rest[:6]]  # decisions soon after the cut depend on the trigger
    assert all(torch.equal(pack(a.parts), pack(b.parts)) for a, b in zip(rest, tail))
    for a, b in zip(rest, tail):
        _assert_same_state(a.received, b.received)


def test_steady_state_messages_have_the_codecs_exact_size():
    sender, receiver = _pair("clapping-fc", "q4")
    sizes = {}
    for m in _drive(sender, receiver, steps=6):
        if m.parts[0].codec == CODEC:
            sizes.setdefault(m.slot, set()).add(len(pack(m.parts)))
    codec = get_codec("q4")
    expected = message_nbytes([((4, 8), codec.payload_nbytes((4, 8), torch.float32)), ((4, 1, 8), 4)])  # bools: bits
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
    ({"lazy_messages": -1.0}, "lazy_messages must be a positive finite threshold"),
])
def test_bad_compression_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClappingStrategy(**kwargs)
