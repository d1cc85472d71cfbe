"""Property-based fuzzing of the wire: whatever bytes arrive, the receiver raises WireError or gets valid parts.

Malformed input must never escape as ``struct.error``, ``IndexError``, ``KeyError`` or a torch error, never be
accepted with an unknown dtype, flag, codec id or a negative dimension, and a resize message must never make the
receiver allocate or receive a length it announces out of bounds.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import channel_holding  # noqa: E402
from lightning_clapping.comm.wire import (  # noqa: E402
    CODEC,
    DTYPE_CODE,
    FULL,
    HEADER_BYTES,
    KNOWN_FLAGS,
    MAX_NDIM,
    RAW,
    SKIP,
    Part,
    WireError,
    pack,
    resize_message,
    unpack,
)

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
    return struct.pack("<2sBBHHQ", b"CL", 1, 0, nparts, 0, total) + body


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
