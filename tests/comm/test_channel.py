"""The wire format: what is sent is one uint8 message whose size is the header plus the payloads."""

from __future__ import annotations

import os
import struct

import pytest
import torch
import torch.distributed as dist

from conftest import channel_holding, run_gloo_ranks
from lightning_clapping.comm.channel import PeerChannel
from lightning_clapping.comm.wire import (
    HEADER_BYTES,
    KIND_RESIZE,
    VERSION,
    Part,
    WireError,
    from_raw_bytes,
    pack,
    raw_bytes,
    raw_payload_nbytes,
    read_header,
    resize_message,
    unpack,
)


def _parts():
    a = torch.randn(3, 5)
    mask = torch.rand(3, 1, 5) > 0.5
    ids = torch.arange(7)
    return [Part(0, t.dtype, tuple(t.shape), raw_bytes(t), i % 2) for i, t in enumerate((a, mask, ids))], (a, mask, ids)


def test_pack_unpack_round_trips_tensors_of_several_dtypes():
    parts, tensors = _parts()
    back = unpack(pack(parts))
    for p, t in zip(back, tensors):
        assert torch.equal(from_raw_bytes(p.payload, p.dtype, p.shape), t)
    assert [p.flags for p in back] == [0, 1, 0]


def test_message_size_is_header_descriptors_and_aligned_payloads():
    parts, tensors = _parts()
    msg = pack(parts)
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    descriptors = sum(16 + 8 * t.dim() for t in tensors)
    payloads = sum((raw_payload_nbytes(t.shape, t.dtype) + 7) // 8 * 8 for t in tensors)  # bools: a bit each
    assert msg.numel() == (HEADER_BYTES + descriptors + 7) // 8 * 8 + payloads


def test_a_foreign_message_is_rejected():
    with pytest.raises(WireError, match="not a lightning-clapping message"):
        unpack(torch.zeros(64, dtype=torch.uint8))


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    chan = PeerChannel(1 - rank, purpose=1, device=torch.device("cpu"))
    sizes = [(4, 8), (4, 8), (2, 8), (4, 8)]  # the third message is smaller: a resize
    if rank == 0:
        for i, shape in enumerate(sizes):
            chan.send(0, pack([Part(0, torch.float32, shape, raw_bytes(torch.full(shape, float(i))))]))
        chan.flush()
        out.put(("sent", chan.bytes_sent, chan.messages_sent))
    else:
        got = []
        for _ in sizes:
            chan.post(0)
            p = unpack(chan.recv(0))[0]
            got.append((p.shape, float(from_raw_bytes(p.payload, p.dtype, p.shape).mean())))
        out.put(("got", got))
    _forged_resizes(rank, out)  # in the same processes: starting two more costs half a minute
    dist.destroy_process_group()


def _forged_resizes(rank, out):
    """Rank 0 forges resize messages announcing less than a header and 8 EiB, then sends a real message."""
    chan = PeerChannel(1 - rank, purpose=2, device=torch.device("cpu"))
    if rank == 0:
        for slot, announced in ((0, 8), (1, 2**63)):
            forged = resize_message(announced, HEADER_BYTES, torch.device("cpu"))
            chan.queue.issue([chan._send_op(forged, chan._tag(slot, False))])
        chan.send(2, pack([Part(0, torch.float32, (2,), raw_bytes(torch.tensor([1.0, 2.0])))]))
        chan.flush()
    else:
        errors = []
        for slot in (0, 1):
            try:
                chan.recv(slot, where=f"boundary 0, forward, micro-batch {slot}")
            except WireError as e:
                errors.append(str(e))
        p = unpack(chan.recv(2))[0]
        out.put(("forged", errors, from_raw_bytes(p.payload, p.dtype, p.shape).tolist()))


@pytest.fixture(scope="module")
def two_ranks():
    """What two gloo ranks running :func:`_worker` reported (keys "sent", "got", "forged"), and their exit codes."""
    items, exitcodes = run_gloo_ranks(_worker, expected=3)
    results: dict = {r[0]: r[1:] for r in items}
    results["exitcodes"] = exitcodes
    return results


def test_messages_of_changing_size_arrive_intact_and_every_sent_byte_is_counted(two_ranks):
    assert two_ranks["got"][0] == [((4, 8), 0.0), ((4, 8), 1.0), ((2, 8), 2.0), ((4, 8), 3.0)]
    big = len(pack([Part(0, torch.float32, (4, 8), raw_bytes(torch.zeros(4, 8)))]))
    small = len(pack([Part(0, torch.float32, (2, 8), raw_bytes(torch.zeros(2, 8)))]))
    # first message: resize (header-sized) + message; third: resize (old size) + message; fourth: resize + message
    expected = HEADER_BYTES + big + big + big + small + small + big
    assert two_ranks["sent"] == (expected, 7)


def test_a_forged_resize_raises_a_wire_error_in_the_receiver_instead_of_aborting_it(two_ranks):
    assert two_ranks["exitcodes"] == [0, 0]  # no SIGABRT inside gloo, no attempt to allocate 8 EiB
    errors, values = two_ranks["forged"]
    assert errors[0].startswith("boundary 0, forward, micro-batch 0: resize message announces 8 bytes")
    assert errors[1].startswith(f"boundary 0, forward, micro-batch 1: resize message announces {2**63} bytes")
    assert values == [1.0, 2.0]  # the channel still works for the other slots


def test_resize_message_announces_the_new_length():
    kind, _, total = read_header(resize_message(1000, 64, torch.device("cpu")))
    assert (kind, total) == (KIND_RESIZE, 1000)


# ---------------------------------------------------------------------------------------------- malformed messages
WHERE = "boundary 1, backward, micro-batch 3"
DESC = HEADER_BYTES  # the first part's descriptor: codec, dtype, ndim, flags, reserved (4), payload bytes (8), dims


def _message_part() -> Part:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return Part(1, t.dtype, (2, 3), raw_bytes(t), 1)


def _message() -> torch.Tensor:
    return pack([_message_part()])


def _two_part_message() -> torch.Tensor:
    """Big enough that a first descriptor with 17 dimensions still lies inside it."""
    return pack([_message_part(), Part(0, torch.float32, (40,), raw_bytes(torch.zeros(40)))])


def _poke(msg: torch.Tensor, at: int, value: bytes) -> torch.Tensor:
    msg = msg.clone()
    msg[at : at + len(value)] = torch.tensor(list(value), dtype=torch.uint8)
    return msg


@pytest.mark.parametrize(
    "corrupt, what",
    [
        (lambda m: _poke(m, DESC + 1, b"\xc8"), "unknown dtype code 200"),
        (lambda m: _poke(m, DESC + 3, b"\x82"), "unknown flags 0x82"),
        (lambda m: _poke(m, DESC + 4, b"\x01"), "reserved field is 1, not 0"),
        (lambda m: _poke(m, DESC + 16, struct.pack("<q", -2)), r"bad shape \(-2, 3\)"),
        (lambda m: _poke(m, DESC + 16, struct.pack("<qq", 1 << 62, 4)), "too many elements"),
        (lambda m: _poke(m, DESC, b"\x09"), "unknown codec id 9"),
        (lambda m: _poke(_two_part_message(), DESC + 2, b"\x11"), r"part 0 of 2: 17 dimensions \(at most 16\)"),
        (lambda m: _poke(m, DESC + 2, b"\x10"), "part 0 of 1: its 16 dimensions run past the end of the message"),
        (lambda m: _poke(m, DESC + 2, b"\x01"), "message parts end at byte 64, header says 72"),
        (lambda m: _poke(m, DESC + 8, struct.pack("<Q", 1 << 63)), "payload of 9223372036854775808 bytes"),
        (lambda m: _poke(m, 8, struct.pack("<Q", 1 << 63)), "message says 9223372036854775808 bytes but 72 arrived"),
        (lambda m: _poke(m, 4, struct.pack("<H", 0xFFFF)), "part 1 of 65535: reserved field is 1065353216"),
        (lambda m: _poke(pack([]), 4, b"\x01"), "part 0 of 1: descriptor runs past the end of the message"),
        (lambda m: _poke(m, 3, b"\x07"), "unknown message kind 7"),
        (lambda m: _poke(m, 6, b"\x01"), r"reserved field 1 \(not 0\)"),
        (lambda m: _poke(m, 2, bytes([VERSION + 1])), "not a lightning-clapping message"),
        (lambda m: _poke(m, 3, b"\x01"), "expected a data message, got kind 1"),
        (lambda m: m[:-8], "message says 72 bytes but 64 arrived"),
        (lambda m: m[:9], "message of 9 bytes is shorter than the 16-byte header"),
        (lambda m: m.view(torch.int8), "a message is a 1-D torch.uint8 tensor"),
    ],
)
def test_each_corrupted_field_raises_a_wire_error_that_names_the_message_and_the_field(corrupt, what):
    msg = _message()
    assert len(unpack(msg, known_codecs={0, 1, 2, 3})) == 1  # the uncorrupted message is fine
    with pytest.raises(WireError, match=f"^{WHERE}: .*{what}"):
        unpack(corrupt(msg), known_codecs={0, 1, 2, 3}, where=WHERE)


def test_the_expected_number_of_parts_is_checked():
    with pytest.raises(WireError, match=f"^{WHERE}: message has 1 parts, expected 2"):
        unpack(_message(), expected_parts=2, where=WHERE)
    assert len(unpack(_message(), expected_parts=1)) == 1


def _resize_receiver(announced, nparts=0, **kw):
    """A receiving channel whose posted receive for slot 0 already holds a resize message announcing ``announced``."""
    msg = _poke(resize_message(0, HEADER_BYTES, torch.device("cpu")), 8, struct.pack("<Q", announced))
    return channel_holding(_poke(msg, 4, struct.pack("<H", nparts)), **kw)


@pytest.mark.parametrize(
    "announced, nparts, cap",
    [(0, 0, None), (8, 0, None), (15, 0, None), (20, 0, None), (2**63, 0, None), (2**64 - 8, 0, None),
     (4096, 0, 4088), (64, 1, None)],
)
def test_a_resize_announcing_an_impossible_length_raises_before_anything_is_allocated_or_received(
    announced, nparts, cap
):
    chan, received = _resize_receiver(announced, nparts, max_message_bytes=cap)
    with pytest.raises(WireError, match=f"^{WHERE}: resize message announces {announced} bytes"):
        chan.recv(0, where=WHERE)
    assert received == []


def test_a_resize_within_bounds_receives_the_announced_length():
    chan, received = _resize_receiver(4096, max_message_bytes=4096)
    assert chan.recv(0).numel() == 4096 and received == [4096]
    chan, _ = _resize_receiver(2**63)
    with pytest.raises(WireError, match="^slot 0 from rank 1: resize"):  # the default names slot and peer
        chan.recv(0)


@pytest.mark.parametrize("cap", [0, HEADER_BYTES - 1, 1.5, True, "4GiB"])
def test_max_message_bytes_is_validated(cap):
    with pytest.raises(ValueError, match="max_message_bytes"):
        PeerChannel(1, purpose=1, device=torch.device("cpu"), max_message_bytes=cap)


def test_a_sender_refuses_a_message_over_the_cap_before_sending_anything():
    chan = PeerChannel(1, purpose=1, device=torch.device("cpu"), max_message_bytes=48)
    with pytest.raises(WireError, match="^slot 0 to rank 1: message of 72 bytes exceeds max_message_bytes=48"):
        chan.send(0, _message())
    assert chan.bytes_sent == 0 and not chan.pending()


def test_the_executor_names_boundary_direction_and_micro_batch_of_a_malformed_message():
    from types import SimpleNamespace

    from lightning_clapping.pipeline.executor import PipelineExecutor
    from lightning_clapping.codecs.feedback import MessageRule, StepContext

    class FakeChannel:
        peer = 2

        def recv(self, slot, mode=None, where=None):
            self.where = where
            return _poke(_message(), DESC, b"\x07")  # codec id 7: no wire form has it

    rule = MessageRule("ef21", "q4", 1, "bwd")
    executor = SimpleNamespace(rules={"bwd_in": rule}, _mode=lambda name, j, ctx: None)
    chan = FakeChannel()
    with pytest.raises(WireError, match=r"^boundary 1, backward, micro-batch 3, from rank 2: part 0 of 1: unknown "
                                        r"codec id 7"):
        PipelineExecutor._recv(executor, chan, "bwd_in", 3, StepContext())
    assert chan.where.startswith("boundary 1, backward, micro-batch 3")  # resize errors get the same name
    executor.rules["eval_in"] = MessageRule("ef21", "q4", 0, "fwd")
    with pytest.raises(WireError, match=r"^boundary 0, forward \(evaluation\), micro-batch 5"):
        PipelineExecutor._recv(executor, chan, "eval_in", 5, StepContext())
