"""Property-based fuzzing of the wire: whatever bytes arrive, the receiver raises WireError or gets valid parts.

Malformed input must never escape as ``struct.error``, ``IndexError``, ``KeyError`` or a torch error, never be
accepted with an unknown dtype, flag, codec id or a negative dimension, and a resize message must never make the
receiver allocate or receive a length it announces out of bounds.
"""

from __future__ import annotations

import copy
import math
import random
import struct

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import channel_holding  # noqa: E402
from lightning_clapping.codecs import available_codecs, get_codec  # noqa: E402
from lightning_clapping.codecs.feedback import MessageRule, StepContext  # noqa: E402
from lightning_clapping.comm.step_results import pack_results, unpack_results  # noqa: E402
from lightning_clapping.comm.ties import TiedGradients  # noqa: E402
from lightning_clapping.comm.wire import (  # noqa: E402
    ATTACHMENT,
    CODEC,
    DTYPE_CODE,
    FLAG_REQUIRES_GRAD,
    FULL,
    HEADER_BYTES,
    KNOWN_FLAGS,
    MAX_NDIM,
    RAW,
    SKIP,
    VERSION,
    Part,
    WireError,
    check_codec_payload,
    decode_message,
    decode_payload,
    from_raw_bytes,
    message_nbytes,
    pack,
    raw_bytes,
    raw_payload_nbytes,
    resize_message,
    results_of,
    results_part,
    unpack,
)
from lightning_clapping.pipeline.partition import TiedGroup  # noqa: E402

KNOWN = (RAW, CODEC, FULL, SKIP)
WHERE = "boundary 2, forward, micro-batch 1"
FAST = settings(max_examples=400, deadline=None, database=None)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def _unpack_or_wire_error(msg: torch.Tensor) -> list[Part] | None:
    """unpack(msg); None when it raised WireError (which must name the message). Any other exception fails the test."""
    try:
        parts = unpack(msg, known_codecs=KNOWN, where=WHERE)
    except WireError as e:
        assert str(e).startswith(WHERE + ": ")
        return None
    _assert_valid(parts, msg)
    return parts


def _assert_valid(parts: list[Part], msg: torch.Tensor) -> None:
    """What an accepted message guarantees: known fields, shapes torch can hold, payloads that are views inside
    ``msg``, and a layout that is exactly what ``pack`` makes of these parts (padding bytes aside)."""
    start, end = msg.data_ptr(), msg.data_ptr() + msg.numel()
    for p in parts:
        assert p.codec in KNOWN and p.dtype in DTYPE_CODE and not p.flags & ~KNOWN_FLAGS
        assert len(p.shape) <= MAX_NDIM and all(d >= 0 for d in p.shape) and math.prod(p.shape) < 2**63
        assert p.payload.dtype == torch.uint8 and p.payload.dim() == 1
        if p.payload.numel():
            assert start <= p.payload.data_ptr() and p.payload.data_ptr() + p.payload.numel() <= end
    again = pack(parts)
    head = HEADER_BYTES + sum(16 + 8 * len(p.shape) for p in parts)
    assert again.numel() == msg.numel() and torch.equal(again[:head], msg[:head])


# -------------------------------------------------------------------------------------------- (a) random bytes
@FAST
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_wire_error(data):
    _unpack_or_wire_error(_tensor(data))


@st.composite
def plausible_messages(draw):
    """A valid data header (so parsing gets past the magic) with a random part count and random descriptors."""
    body, count = b"", draw(st.integers(0, 4))
    for _ in range(count):
        ndim = draw(st.integers(0, 18))
        body += struct.pack(
            "<BBBBIQ", draw(st.integers(0, 5)), draw(st.integers(0, 16)), ndim, draw(st.integers(0, 3)),
            draw(st.sampled_from([0, 0, 0, 1])), draw(st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1))),
        )
        body += b"".join(struct.pack("<q", draw(st.integers(-2, 5))) for _ in range(draw(st.integers(0, ndim))))
    body += bytes(draw(st.integers(0, 7))) + draw(st.binary(max_size=64))
    length = HEADER_BYTES + len(body)
    total = draw(st.one_of(st.just(length), st.integers(0, 2**64 - 1)))
    nparts = draw(st.one_of(st.just(count), st.integers(0, 4), st.integers(0, 0xFFFF)))
    return struct.pack("<2sBBHHQ", b"CL", VERSION, 0, nparts, 0, total) + body


@FAST
@given(plausible_messages())
def test_random_descriptors_behind_a_valid_header_raise_only_wire_error(data):
    _unpack_or_wire_error(_tensor(data))


# ------------------------------------------------------------------------- (b) corrupted valid messages
@st.composite
def parts_lists(draw):
    out = []
    for _ in range(draw(st.integers(0, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
        payload = draw(st.binary(max_size=48))  # pack does not check the length against the shape: decoders do
        out.append(Part(draw(st.sampled_from(KNOWN)), draw(st.sampled_from(list(DTYPE_CODE))), shape, _tensor(payload),
                        draw(st.integers(0, KNOWN_FLAGS))))
    return out


@FAST
@given(parts_lists())
def test_valid_messages_round_trip(parts):
    msg = pack(parts)
    back = _unpack_or_wire_error(msg)
    assert back is not None, "a message pack built was refused"
    assert [(p.codec, p.dtype, p.shape, p.flags, p.payload.tolist()) for p in back] == [
        (p.codec, p.dtype, p.shape, p.flags, p.payload.tolist()) for p in parts
    ]


@FAST
@given(parts_lists(), st.data())
def test_corrupted_truncated_or_extended_messages_raise_only_wire_error(parts, data):
    msg = pack(parts)
    n = msg.numel()
    head = HEADER_BYTES + sum(16 + 8 * len(p.shape) for p in parts)  # the header and the part descriptors
    how = data.draw(st.sampled_from(["byte", "head byte", "head field", "truncate", "extend"]))
    if how in ("byte", "head byte"):
        at = data.draw(st.integers(0, (n if how == "byte" else head) - 1))
        msg[at] = data.draw(st.one_of(st.integers(0, 255), st.sampled_from([2, 17, 0x80, 0xFF])))
    elif how == "head field":  # an 8-byte field (length, payload size, dimension) set to an extreme value
        at = 8 * data.draw(st.integers(0, head // 8 - 1))
        value = data.draw(st.sampled_from([2**63, 2**64 - 1, 2**62, 2**63 - 8, 2**32, 2**64 - 8, 0, 1, 7]))
        msg[at : at + 8] = _tensor(struct.pack("<Q", value))
    elif how == "truncate":
        msg = msg[: data.draw(st.integers(0, n - 1))]
    else:
        msg = torch.cat([msg, _tensor(data.draw(st.binary(min_size=1, max_size=40)))])
    back = _unpack_or_wire_error(msg)
    if how in ("truncate", "extend"):
        assert back is None  # the length no longer matches the header


# ------------------------------------------------------------------- (c) resize messages and the size cap
@settings(max_examples=300, deadline=None, database=None)
@given(
    announced=st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1), st.sampled_from([8, 15, 2**63])),
    nparts=st.sampled_from([0, 0, 0, 1, 0xFFFF]),
    cap=st.integers(HEADER_BYTES, 4096),
)
def test_a_resize_receives_only_an_announced_length_in_bounds(announced, nparts, cap):
    msg = resize_message(0, HEADER_BYTES, torch.device("cpu"))
    msg[4:16] = _tensor(struct.pack("<HHQ", nparts, 0, announced))
    chan, received = channel_holding(msg, max_message_bytes=cap)
    try:
        got = chan.recv(0, where=WHERE)
    except WireError as e:
        assert str(e).startswith(f"{WHERE}: resize message announces {announced} bytes")
        assert received == []  # refused before allocating or posting anything
        return
    assert nparts == 0 and HEADER_BYTES <= announced <= cap and announced % 8 == 0
    assert received == [announced] and got.numel() == announced


# ------------------------------------------------------------- (d) decoding: every codec, every variant, every form
# Past ``unpack``: what a message's parts decode to. Seeded loops (the same cases every run), a few seconds in all.
CODEC_SPECS = [s for s in ["identity", "bf16", "fp16", "fp8", "fp8_e5m2", "q1", "q2:sr", "q3:tensor", "q4",
                           "q5:group4", "q6:fp16", "q7:group3:fp16:sr", "q8", "topk:0.3", "topk:0.5+q4:group4",
                           "randk:0.3", "randk:0.5+q8:fp16", "lowrank:3", "lowrank:2:it0"]
               if s.split(":")[0] in available_codecs()]
RULES = [("uncompressed", {}), ("direct", {}), ("ef21", {"fresh_codec": "q8"}),
         ("clapping-fc", {"lazy_threshold": 10.0, "max_skips": 1}), ("clapping-fu", {}),
         ("clapping-fu", {"fresh_codec": "fp16"}), ("aqsgd", {})]


def test_the_decode_fuzz_covers_every_registered_codec():
    assert {s.split(":")[0] for s in CODEC_SPECS} == set(available_codecs())


def _decoded_or_wire_error(decode, *args, named=WHERE, **kwargs):
    """decode(...)'s result, or None when it raised WireError naming the message (``named``); any other exception
    fails the test."""
    try:
        return decode(*args, **kwargs)
    except WireError as e:
        assert str(e).startswith(named + ": "), e
        return None


def _payload_cases(rng: random.Random, payload: torch.Tensor, shape: tuple, n: int):
    """(payload, shape, dtype) a peer could send instead of ``payload`` for a float32 tensor of ``shape``."""
    raw = bytes(payload.tolist())
    for _ in range(n):
        how = rng.choice(["random", "flip", "ones", "short", "long", "shape", "dtype"])
        data, s, dtype = bytearray(raw), shape, torch.float32
        if how == "random":
            data = bytearray(rng.randbytes(len(raw)))
        elif how == "flip" and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.choice([0, 0xFF, 0x80, 0x7F, rng.randrange(256)])
        elif how == "ones":
            data = bytearray(b"\xff" * len(raw))
        elif how == "short":
            data = data[: rng.randrange(len(data) + 1) - 1] if data else data
        elif how == "long":
            data += rng.randbytes(rng.randint(1, 9))
        elif how == "shape":
            s = tuple(rng.randint(0, 7) for _ in range(rng.randint(0, 3)))
        else:
            dtype = rng.choice([torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float16,
                                torch.bfloat16, torch.float64])
        yield torch.tensor(list(data), dtype=torch.uint8), s, dtype


@pytest.mark.parametrize("spec", CODEC_SPECS)
def test_codec_payloads_decode_to_their_shape_or_raise_only_wire_error(spec):
    codec = get_codec(spec)
    rng = random.Random(spec)
    shape = (3, 5)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    payload = codec.encode(x, seed=3)
    for bad, s, dtype in _payload_cases(rng, payload, shape, 60):
        out = _decoded_or_wire_error(decode_payload, codec, bad, s, dtype, seed=3, where=WHERE)
        if out is not None:
            assert isinstance(out, torch.Tensor) and tuple(out.shape) == s and out.dtype == dtype


def test_a_topk_index_past_the_tensor_is_refused_before_the_decoder_writes():
    codec = get_codec("topk:0.25")
    x = torch.randn(5, 6)
    payload = codec.encode(x)
    payload[codec.values_nbytes(codec.count(30)):] = 0xFF  # 5-bit indices of 31: past the 30 values
    # checked before decoding where the decoder's out-of-bounds write would be a device assert (accelerators)
    with pytest.raises(WireError, match=f"^{WHERE}: topk:0.25 payload .* flat index 31 is past the tensor's 30"):
        check_codec_payload(codec, payload, (5, 6), torch.float32, WHERE, indices=True)
    # on the CPU the decoder's IndexError is caught instead
    with pytest.raises(WireError, match=f"^{WHERE}: topk:0.25 payload .* could not be decoded .*index 31"):
        decode_payload(codec, payload, (5, 6), torch.float32, seed=0, where=WHERE)


def _drive(variant, spec, kw):
    """A sender and a receiver driven through five steps of two micro-batches (fresh, reuse, reuse, fresh, reuse):
    per message, the step, the slot, the receiver as it was before it, and the valid parts."""
    sender, receiver = (MessageRule(variant, spec, 1, "fwd", **kw) for _ in range(2))
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(4, dtype=torch.int64)  # a tensor that carries no gradient: always RAW
    out = []
    for step, fresh in enumerate([True, False, False, True, False]):
        if fresh:
            acts = [torch.randn(4, 6, generator=g) for _ in range(2)]
            ids = [torch.arange(4) + 10 * step + 4 * j for j in range(2)]
        ctx = StepContext(step=step, fresh=fresh, sample_ids=ids)
        for j in range(2):
            acts[j] = acts[j] + 0.01 * torch.randn(4, 6, generator=g)
            parts = sender.encode(j, [acts[j].requires_grad_(), mask], ctx)
            out.append((ctx, j, copy.deepcopy(receiver), parts))
            got = decode_message(receiver, j, unpack(pack(parts), known_codecs=KNOWN), ctx, WHERE)
            assert [tuple(t.shape) for t in got] == [(4, 6), (4,)]
    return out


def _mutated(rng: random.Random, parts: list[Part]) -> list[Part]:
    parts = [Part(p.codec, p.dtype, p.shape, p.payload.clone(), p.flags) for p in parts]
    for _ in range(rng.randint(1, 2)):
        p = rng.choice(parts) if parts else None
        how = rng.choice(["form", "flags", "dtype", "shape", "bytes", "length", "drop", "copy", "swap"])
        if p is None or how == "copy":
            parts.append(copy.copy(rng.choice(parts)) if parts else Part(RAW, torch.float32, (0,), _tensor(b"")))
        elif how == "form":
            p.codec = rng.choice(KNOWN)
        elif how == "flags":
            p.flags ^= KNOWN_FLAGS
        elif how == "dtype":
            p.dtype = rng.choice(list(DTYPE_CODE))
        elif how == "shape":
            p.shape = tuple(rng.randint(0, 6) for _ in range(rng.randint(0, 3)))
        elif how == "bytes":
            p.payload = _tensor(rng.randbytes(p.payload.numel()))
        elif how == "length":
            n = p.payload.numel()
            p.payload = p.payload[: rng.randrange(n)] if n and rng.random() < 0.5 else \
                torch.cat([p.payload, _tensor(rng.randbytes(rng.randint(1, 8)))])
        elif how == "drop":
            parts.remove(p)
        else:
            q = rng.choice(parts)
            p.payload, q.payload = q.payload, p.payload
    return parts


@pytest.mark.parametrize("variant,kw", RULES, ids=[f"{v}{'-' + '-'.join(kw) if kw else ''}" for v, kw in RULES])
def test_messages_of_every_variant_and_codec_decode_or_raise_only_wire_error(variant, kw):
    forms = set()
    for spec in CODEC_SPECS if variant != "uncompressed" else ["identity"]:
        rng = random.Random(f"{variant}{kw}{spec}")
        messages = _drive(variant, spec, kw)
        forms |= {p.codec for *_, parts in messages for p in parts}
        for _ in range(24):
            ctx, slot, receiver, parts = rng.choice(messages[2:])
            msg = pack(_mutated(rng, parts))
            if rng.random() < 0.25:  # and now and then a byte of the packed message itself
                msg[rng.randrange(msg.numel())] = rng.randrange(256)
            got = _unpack_or_wire_error(msg)
            if got is None:
                continue
            out = _decoded_or_wire_error(decode_message, copy.deepcopy(receiver), slot, got, ctx, WHERE)
            if out is not None:
                assert [(tuple(t.shape), t.dtype) for t in out] == [(p.shape, p.dtype) for p in got]
    # the fuzz started from every form the variant sends: FULL resets (none under clapping-fu with a fresh codec,
    # whose resets are CODEC), SKIP under lazy messages
    expected = {"uncompressed": {RAW}, "direct": {RAW, CODEC}, "aqsgd": {RAW, FULL, CODEC}}.get(variant, {
        RAW, CODEC, *([SKIP] if "lazy_threshold" in kw else []), *([] if variant == "clapping-fu" and kw else [FULL])})
    assert forms == expected


@pytest.mark.parametrize("shape", [(8, 1, 32, 32), (3, 5, 7), (65,), (0, 4)])
def test_a_bool_tensor_crosses_as_one_bit_per_value_and_comes_back_exactly(shape):
    # an attention mask crossing a cut: 8x fewer bytes than one byte per value, without loss
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.5
    payload = raw_bytes(mask)
    assert payload.numel() == raw_payload_nbytes(shape, torch.bool) == math.ceil(mask.numel() / 8)
    back = from_raw_bytes(payload, torch.bool, shape)
    assert back.dtype == torch.bool and torch.equal(back, mask)
    msg = pack([Part(RAW, torch.bool, shape, payload)])
    assert msg.numel() == message_nbytes([(shape, math.ceil(mask.numel() / 8))])
    (part,) = unpack(msg)
    assert torch.equal(from_raw_bytes(part.payload, part.dtype, part.shape), mask)


def test_a_bool_part_of_one_byte_per_value_is_a_wire_error():
    ctx, slot, receiver, parts = _drive("direct", "q4", {})[2]
    mask = torch.ones(4, 1, 8, dtype=torch.bool)
    whole_bytes = Part(RAW, torch.bool, (4, 1, 8), mask.view(torch.uint8).reshape(-1))
    with pytest.raises(WireError, match=r"part 1 of 2 \(RAW\): 32 bytes for shape \(4, 1, 8\) of torch.bool \(4\)"):
        decode_message(receiver, slot, [parts[0], whole_bytes], ctx, WHERE)
    bits = Part(RAW, torch.bool, (4, 1, 8), raw_bytes(mask))
    out = decode_message(receiver, slot, [parts[0], bits], ctx, WHERE)
    assert torch.equal(out[1], mask)


def test_a_skip_without_a_buffer_and_a_row_without_its_sample_are_wire_errors():
    ctx, slot, receiver, parts = _drive("clapping-fc", "q4", {})[0]  # the first message: no buffer yet
    skip = [Part(SKIP, torch.float32, (4, 6), _tensor(b""), FLAG_REQUIRES_GRAD), parts[1]]
    with pytest.raises(WireError, match=f"^{WHERE}: part 0 of 2 \\(SKIP\\): a skipped tensor .* buffer None"):
        decode_message(receiver, slot, skip, ctx, WHERE)
    ctx, slot, receiver, parts = _drive("aqsgd", "q4", {})[2]  # a reuse step: CODEC against the samples' rows
    ctx = StepContext(step=ctx.step, fresh=False, sample_ids=[torch.arange(4) + 999] * 2)  # samples never seen
    with pytest.raises(WireError, match=f"^{WHERE}: parts \\(CODEC, RAW\\) could not be decoded by the aqsgd rule"):
        decode_message(receiver, slot, parts, ctx, WHERE)


def test_tied_gradient_payloads_decode_or_raise_only_wire_error():
    codec = get_codec("topk:0.3+q4")
    ties = TiedGradients([TiedGroup(("emb.weight", "head.weight"), (0, 2))], 0, lambda s: s, None,
                         torch.device("cpu"), codec=codec)
    like = torch.randn(4, 6)
    rng = random.Random(5)
    valid = torch.cat([codec.encode(like), torch.zeros(1, dtype=torch.uint8)])
    for bad, _, _ in _payload_cases(rng, valid, (4, 6), 80):
        if bad.numel() == valid.numel():  # the tied sum receives into a buffer of the size both ends know
            _decoded_or_wire_error(ties._decode, bad, like, 3, 0, 2, named="tied tensor 'emb.weight' from stage 2")
    with pytest.raises(WireError, match="tied tensor 'emb.weight' from stage 2: the finite flag is 7"):
        ties._decode(torch.cat([valid[:-1], _tensor(b"\x07")]), like, 3, 0, 2)


# ------------------------------------------------------------------------------------------ (e) step results
def _results_or_wire_error(blob: bytes):
    try:
        return unpack_results(blob)
    except WireError as e:
        assert str(e).startswith("step results: "), e
        return None


RESULTS = pack_results(0.75, [
    ("train_loss", 0.5, {"prog_bar": True, "batch_size": 16, "reduce_fx": torch.sum, "logger": None}, None),
    ("acc", 0.25, {"on_epoch": True, "sync_dist": True}, ("acc_metric", 0.125)),
    ("hist", torch.arange(6, dtype=torch.float16).reshape(2, 3), {"reduce_fx": "max"}, None),
    ("count", 3, {}, None), ("flag", True, {"on_step": False}, None),
], (1, 2**64 - 1))


def test_random_step_results_raise_only_wire_error():
    rng = random.Random(11)
    for _ in range(3000):  # random bytes, half of them behind a valid magic and version
        blob = rng.randbytes(rng.randint(0, 120))
        _results_or_wire_error(b"CR\x01" + blob if rng.random() < 0.5 else blob)


def test_corrupted_step_results_raise_only_wire_error():
    rng = random.Random(12)
    for _ in range(1500):
        blob = bytearray(RESULTS)
        how = rng.choice(["byte", "field", "truncate", "extend"])
        if how == "byte":
            for _ in range(rng.randint(1, 3)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
        elif how == "field":  # a length or count set to an extreme value
            at = rng.randrange(len(blob) - 3)
            blob[at : at + 4] = struct.pack("<I", rng.choice([0, 1, 2**31, 2**32 - 1, 255, 7]))
        elif how == "truncate":
            blob = blob[: rng.randrange(len(blob))]
        else:
            blob += rng.randbytes(rng.randint(1, 20))
        got = _results_or_wire_error(bytes(blob))
        if how in ("truncate", "extend"):
            assert got is None
        elif got is not None:
            loss, logs, fingerprint = got
            assert isinstance(loss, float) and all(isinstance(v, int) for v in fingerprint)
            for name, value, options, metric in logs:
                assert isinstance(name, str) and isinstance(options, dict) and (metric is None or len(metric) == 2)
                assert isinstance(value, (float, int, bool, torch.Tensor))


def test_step_results_ride_a_message_and_come_back_without_pickle():
    part = results_part(RESULTS)
    parts = unpack(pack([Part(RAW, torch.float32, (2,), _tensor(bytes(8))), part]),
                   known_codecs=(*KNOWN, ATTACHMENT), where=WHERE)
    loss, logs, fingerprint = unpack_results(results_of(parts, WHERE))
    assert loss == 0.75 and fingerprint == (1, 2**64 - 1) and [r[0] for r in logs] == [
        "train_loss", "acc", "hist", "count", "flag"]
