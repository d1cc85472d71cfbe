"""The wire format: what is sent is one uint8 message whose size is the header plus the payloads."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_clapping.channel import (
    HEADER_BYTES,
    KIND_RESIZE,
    Part,
    PeerChannel,
    WireError,
    from_raw_bytes,
    pack,
    raw_bytes,
    read_header,
    unpack,
)


def _parts():
    a = torch.randn(3, 5)
    mask = torch.rand(3, 1, 5) > 0.5
    ids = torch.arange(7)
    return [Part(0, t.dtype, tuple(t.shape), raw_bytes(t), i) for i, t in enumerate((a, mask, ids))], (a, mask, ids)


def test_pack_unpack_round_trips_tensors_of_several_dtypes():
    parts, tensors = _parts()
    back = unpack(pack(parts))
    for p, t in zip(back, tensors):
        assert torch.equal(from_raw_bytes(p.payload, p.dtype, p.shape), t)
    assert [p.flags for p in back] == [0, 1, 2]


def test_message_size_is_header_descriptors_and_aligned_payloads():
    parts, tensors = _parts()
    msg = pack(parts)
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    descriptors = sum(16 + 8 * t.dim() for t in tensors)
    payloads = sum((t.numel() * t.element_size() + 7) // 8 * 8 for t in tensors)
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
    dist.destroy_process_group()


def test_messages_of_changing_size_arrive_intact_and_every_sent_byte_is_counted():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=60), out.get(timeout=60)))
    for p in procs:
        p.join(timeout=30)
    assert results["got"][0] == [((4, 8), 0.0), ((4, 8), 1.0), ((2, 8), 2.0), ((4, 8), 3.0)]
    big = len(pack([Part(0, torch.float32, (4, 8), raw_bytes(torch.zeros(4, 8)))]))
    small = len(pack([Part(0, torch.float32, (2, 8), raw_bytes(torch.zeros(2, 8)))]))
    # first message: resize (header-sized) + message; third: resize (old size) + message; fourth: resize + message
    expected = HEADER_BYTES + big + big + big + small + small + big
    assert results["sent"] == (expected, 7)


def test_resize_message_announces_the_new_length():
    from lightning_clapping.channel import resize_message

    kind, _, total = read_header(resize_message(1000, 64, torch.device("cpu")))
    assert (kind, total) == (KIND_RESIZE, 1000)
