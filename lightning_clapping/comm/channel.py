"""The wire: how one boundary message is laid out in bytes and moved between two ranks.

Every message between stages is ONE ``uint8`` tensor handed to ``torch.distributed``::

    header   16 bytes  magic "CL", version, kind, number of parts, total length
    parts    16 bytes each + 8 per dimension: codec id, dtype, ndim, flags, payload bytes, shape
    (padding to 8 bytes)
    payloads each the codec's packed bytes, padded to 8 bytes

So the bytes counted by :class:`PeerChannel` are exactly the bytes that crossed the process boundary, and a
compressed payload travels as its packed bytes, never as floats.

A receive is posted before its message arrives (gloo moves data only once a receive is posted, NCCL's send waits
for it). That needs the receiver to know a message's size in advance: both ends remember the size of the last
message in each *slot* (micro-batch position) and *mode* (a key both ends can compute, such as "full precision" or
"compressed"), and the sender keeps to it. When the size changes anyway (the first message, a smaller last batch)
the sender sends a *resize* message of the expected size that announces the new one, and the message itself in the
group of operations that follows (see :func:`exchange`); the receiver receives the message right after the resize,
before anything else from that peer.

Every operation is issued through a :class:`~lightning_clapping.comm.p2p.P2PQueue`, i.e. with
``torch.distributed.batch_isend_irecv``, on every backend. Messages are matched in one of two ways:

* by tag (``prepost=True``, gloo only): each slot has its own tags (one for the resize or the message, one for the
  message after a resize), so receives can be posted for a whole step ahead, in any order;
* by order (``prepost=False``, NCCL, which ignores tags): everything carries tag 0; both ends make their operations
  with one peer in the same order (resize, then message), which :mod:`lightning_clapping.pipeline.schedule` guarantees.

The receiver trusts nothing it reads: every header field is checked (and every announced size bounded) before it is
used, and a malformed message raises :class:`WireError` naming the message (e.g. "boundary 1, backward,
micro-batch 3"), never another exception, an allocation of the announced size or a receive that aborts gloo.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Container
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lightning_clapping.comm.p2p import P2PQueue

MAGIC = b"CL"
VERSION = 1
KIND_DATA = 0
KIND_RESIZE = 1
_HEAD = struct.Struct("<2sBBHHQ")  # magic, version, kind, parts, reserved, total bytes
_PART = struct.Struct("<BBBBIQ")  # codec, dtype, ndim, flags, reserved, payload bytes
_DIM = struct.Struct("<q")
HEADER_BYTES = _HEAD.size
FLAG_REQUIRES_GRAD = 1
KNOWN_FLAGS = FLAG_REQUIRES_GRAD
MAX_NDIM = 16
#: default cap on the size a resize message may announce (``PeerChannel(max_message_bytes=...)`` overrides it)
MAX_MESSAGE_BYTES = 4 << 30

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES.append(getattr(torch, _name))
DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


class WireError(RuntimeError):
    """A message did not have the expected layout: the two ends disagree about the protocol."""


def _fail(what: str, where: str | None) -> NoReturn:
    raise WireError(f"{where}: {what}" if where else what)


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class Part:
    """One tensor inside a message, in its encoded form."""

    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload: torch.Tensor  # 1-D uint8
    flags: int = 0


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8)


def from_raw_bytes(payload: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return payload.view(dtype).reshape(shape)


def pack(parts: list[Part], device: torch.device | None = None) -> torch.Tensor:
    """Lay out ``parts`` as one message tensor."""
    meta = bytearray()
    for p in parts:
        meta += _PART.pack(p.codec, DTYPE_CODE[p.dtype], len(p.shape), p.flags, 0, p.payload.numel())
        for d in p.shape:
            meta += _DIM.pack(d)
    head_len = _align(HEADER_BYTES + len(meta))
    offsets, total = [], head_len
    for p in parts:
        offsets.append(total)
        total += _align(p.payload.numel())
    total = max(total, HEADER_BYTES)
    device = device or (parts[0].payload.device if parts else torch.device("cpu"))
    msg = torch.zeros(total, dtype=torch.uint8, device=device) if total <= 4096 else torch.empty(
        total, dtype=torch.uint8, device=device
    )
    head = _HEAD.pack(MAGIC, VERSION, KIND_DATA, len(parts), 0, total) + bytes(meta)
    msg[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    for p, off in zip(parts, offsets):
        n = p.payload.numel()
        msg[off : off + n] = p.payload
    return msg


def message_nbytes(parts: list[tuple[tuple[int, ...], int]]) -> int:
    """Size of a data message holding tensors of these (shape, payload bytes), without building it."""
    head = HEADER_BYTES + sum(_PART.size + _DIM.size * len(shape) for shape, _ in parts)
    return max(_align(head) + sum(_align(n) for _, n in parts), HEADER_BYTES)


def resize_message(announced: int, length: int, device: torch.device) -> torch.Tensor:
    """A message of ``length`` bytes that tells the receiver the next message has ``announced`` bytes."""
    msg = torch.zeros(max(length, HEADER_BYTES), dtype=torch.uint8, device=device)
    head = _HEAD.pack(MAGIC, VERSION, KIND_RESIZE, 0, 0, announced)
    msg[:HEADER_BYTES] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return msg


def read_header(msg: torch.Tensor, where: str | None = None) -> tuple[int, int, int]:
    """(kind, number of parts, total length) of a message; ``where`` names the message in errors."""
    if not isinstance(msg, torch.Tensor) or msg.dtype != torch.uint8 or msg.dim() != 1:
        _fail(f"a message is a 1-D torch.uint8 tensor, got {getattr(msg, 'dtype', type(msg).__name__)}", where)
    if msg.numel() < HEADER_BYTES:
        _fail(f"message of {msg.numel()} bytes is shorter than the {HEADER_BYTES}-byte header", where)
    magic, version, kind, nparts, reserved, total = _HEAD.unpack(msg[:HEADER_BYTES].cpu().numpy().tobytes())
    if magic != MAGIC or version != VERSION:
        _fail(f"not a lightning-clapping message (magic {magic!r}, version {version})", where)
    if kind not in (KIND_DATA, KIND_RESIZE) or reserved:
        _fail(f"unknown message kind {kind} or reserved field {reserved} (not 0)", where)
    return kind, nparts, total


def _descriptor(raw: bytes, pos: int, known_codecs: Container[int] | None) -> tuple | str:
    """The part descriptor at ``pos``: (codec, dtype, shape, flags, payload bytes, end), or what is wrong with it."""
    if pos + _PART.size > len(raw):
        return "descriptor runs past the end of the message"
    codec, dcode, ndim, flags, reserved, nbytes = _PART.unpack_from(raw, pos)
    end = pos + _PART.size + _DIM.size * ndim
    if dcode >= len(_DTYPES):
        return f"unknown dtype code {dcode}"
    if ndim > MAX_NDIM:
        return f"{ndim} dimensions (at most {MAX_NDIM})"
    if end > len(raw):
        return f"its {ndim} dimensions run past the end of the message"
    if flags & ~KNOWN_FLAGS:
        return f"unknown flags {flags:#x}"
    if reserved:
        return f"reserved field is {reserved}, not 0"
    if known_codecs is not None and codec not in known_codecs:
        return f"unknown codec id {codec}"
    shape = struct.unpack_from(f"<{ndim}q", raw, pos + _PART.size)
    if min(shape, default=0) < 0 or math.prod(shape) >= 1 << 63:
        return f"bad shape {shape} (negative dimension or too many elements)"
    return codec, _DTYPES[dcode], shape, flags, nbytes, end


def unpack(msg: torch.Tensor, *, known_codecs: Container[int] | None = None, expected_parts: int | None = None,
           where: str | None = None) -> list[Part]:
    """The parts of a data message; payloads are views into ``msg``.

    Raises :class:`WireError` (naming ``where``) for anything but a well-formed data message: ``known_codecs`` are
    the codec ids the receiver understands, ``expected_parts`` the number of tensors it expects (None: any).
    """
    kind, nparts, total = read_header(msg, where)
    if kind != KIND_DATA:
        _fail(f"expected a data message, got kind {kind}", where)
    if total != msg.numel():
        _fail(f"message says {total} bytes but {msg.numel()} arrived", where)
    if expected_parts is not None and nparts != expected_parts:
        _fail(f"message has {nparts} parts, expected {expected_parts}", where)
    # descriptors are variable-length; read enough of the head to parse them (never past the message)
    raw = msg[: min(total, HEADER_BYTES + nparts * (_PART.size + _DIM.size * MAX_NDIM))].cpu().numpy().tobytes()
    pos = HEADER_BYTES
    descs = []
    for i in range(nparts):
        desc = _descriptor(raw, pos, known_codecs)
        if isinstance(desc, str):
            _fail(f"part {i} of {nparts}: {desc}", where)
        descs.append(desc[:5])
        pos = desc[5]
    off = _align(pos)
    parts = []
    for i, (codec, dtype, shape, flags, nbytes) in enumerate(descs):
        if off + nbytes > total:
            _fail(f"part {i} of {nparts}: payload of {nbytes} bytes at byte {off} runs past the {total}-byte message",
                  where)
        parts.append(Part(codec, dtype, shape, msg[off : off + nbytes], flags))
        off += _align(nbytes)
    if off != total:
        _fail(f"message parts end at byte {off}, header says {total}", where)
    return parts


class PeerChannel:
    """Messages of one purpose (e.g. training activations) exchanged with one peer rank.

    The same object is used by the sending side (:meth:`send_ops` or :meth:`send`) or the receiving side
    (:meth:`recv_op` or :meth:`post`, then :meth:`recv`). Every operation goes through ``queue``, which issues it with
    ``torch.distributed.batch_isend_irecv``; channels sharing a queue (all of one rank's) have their operations
    ordered and grouped together. ``bytes_sent`` counts every byte of the messages this channel has made operations
    for (resize messages included): the executor issues each of them within the step.

    ``prepost=True``: receives may be posted ahead of time and in any order; each slot has its own tags, and the
    backend must match messages by tag (gloo). ``prepost=False``: every message carries tag 0 and is matched by its
    order between the two ranks, as NCCL does; both ends then make their operations in the same order.
    """

    def __init__(
        self,
        peer: int,
        purpose: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        prepost: bool = True,
        timeout: timedelta | None = None,
        max_message_bytes: int | None = None,
        queue: P2PQueue | None = None,
    ) -> None:
        cap = MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < HEADER_BYTES:
            raise ValueError(f"max_message_bytes must be an int >= {HEADER_BYTES}, got {cap!r}")
        self.max_message_bytes = cap
        self.peer = peer
        self.purpose = purpose
        self.device = device
        self.group = group
        self.prepost = prepost
        self.timeout = timeout
        self.queue = queue if queue is not None else P2PQueue(ordered=not prepost, timeout=timeout)
        self.bytes_sent = 0
        self.messages_sent = 0
        self._expected: dict[tuple[int, Any], int] = {}
        self._posted: dict[int, tuple[dist.P2POp, torch.Tensor, Any]] = {}  # receive issued, header not read
        self._settled: dict[int, tuple[dist.P2POp | None, torch.Tensor]] = {}  # header read: (receive after a resize)

    def _tag(self, slot: int, second: bool) -> int:
        if not self.prepost:
            return 0  # matched by order, as under NCCL (which ignores tags): gloo then checks that order too
        return self.purpose * 1_000_000 + slot * 2 + int(second)

    def _op(self, send: bool, msg: torch.Tensor, tag: int) -> dist.P2POp:
        return dist.P2POp(dist.isend if send else dist.irecv, msg, self.peer, self.group, tag)

    def _send_op(self, msg: torch.Tensor, tag: int) -> dist.P2POp:
        self.bytes_sent += msg.numel()
        self.messages_sent += 1
        return self._op(True, msg, tag)

    def send_ops(self, slot: int, msg: torch.Tensor, mode: Any = None) -> tuple[list[dist.P2POp], list[dist.P2POp]]:
        """The operations that send ``msg`` as ``slot``'s next message: ``(first, after)``.

        ``first`` is ``[msg]`` when its size is the one the receiver expects in ``mode``, else a resize message
        announcing it, and then ``after`` is ``[msg]``. Issue ``after`` in the group that follows ``first``'s, once
        that has completed: the receiver learns the new size only then (see :func:`schedule.simulate_exchanges`).
        """
        if msg.numel() > self.max_message_bytes:  # the receiver would refuse it; fail here rather than hang there
            raise WireError(f"slot {slot} to rank {self.peer}: message of {msg.numel()} bytes exceeds "
                            f"max_message_bytes={self.max_message_bytes}")
        expected = self._expected.get((slot, mode), HEADER_BYTES)
        if msg.numel() == expected:
            return [self._send_op(msg, self._tag(slot, False))], []
        self._expected[(slot, mode)] = msg.numel()
        return ([self._send_op(resize_message(msg.numel(), expected, self.device), self._tag(slot, False))],
                [self._send_op(msg, self._tag(slot, True))])

    def send(self, slot: int, msg: torch.Tensor, mode: Any = None) -> None:
        """Send ``msg`` as ``slot``'s next message, in groups of its own."""
        first, after = self.send_ops(slot, msg, mode)
        self.queue.issue(first)
        self.queue.issue(after)

    def flush(self) -> None:
        """Wait until every operation issued through this channel's queue has completed."""
        self.queue.flush()

    def recv_op(self, slot: int, mode: Any = None) -> dist.P2POp | None:
        """The receive of ``slot``'s next message, expected in ``mode`` (None when it is already posted). The caller
        issues it through :attr:`queue`, in a group with others, before it calls :meth:`settle` or :meth:`recv`."""
        if slot in self._posted or slot in self._settled:
            return None
        buf = torch.empty(self._expected.get((slot, mode), HEADER_BYTES), dtype=torch.uint8, device=self.device)
        op = self._op(False, buf, self._tag(slot, False))
        self._posted[slot] = (op, buf, mode)
        return op

    def post(self, slot: int, mode: Any = None) -> None:
        """Post the receive for ``slot``'s next message, expected in ``mode`` (no-op when already posted)."""
        op = self.recv_op(slot, mode)
        if op is not None:
            self.queue.issue([op])

    def settle(self, slot: int, where: str | None = None) -> list[dist.P2POp]:
        """Wait for ``slot``'s posted receive and read its header. Returns ``[]``, or, when it was a resize message,
        the receive of the message itself, for the caller to issue next (in one group with the messages its own
        resizes delayed); :meth:`recv` then returns that message."""
        op, buf, mode = self._posted.pop(slot)
        self.queue.wait(op)
        where = where or f"slot {slot} from rank {self.peer}"
        kind, nparts, total = read_header(buf, where)
        if kind != KIND_RESIZE:
            self._settled[slot] = (None, buf)
            return []
        # checked before anything is allocated or received: a short buffer would abort gloo, a huge one the host
        if nparts or total < HEADER_BYTES or total % 8 or total > self.max_message_bytes:
            _fail(f"resize message announces {total} bytes ({nparts} parts); a message has a multiple of 8 "
                  f"bytes in [{HEADER_BYTES}, max_message_bytes={self.max_message_bytes}]", where)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        op = self._op(False, buf, self._tag(slot, True))
        self._settled[slot] = (op, buf)
        self._expected[(slot, mode)] = total
        return [op]

    def recv(self, slot: int, mode: Any = None, where: str | None = None) -> torch.Tensor:
        """``slot``'s next message; ``where`` names it in errors (default: the slot and the peer's rank). Posts and
        settles the receive first where that has not been done (the message after a resize then comes in a group
        of its own)."""
        if slot not in self._settled:
            self.post(slot, mode)
            self.queue.issue(self.settle(slot, where))
        op, buf = self._settled.pop(slot)
        if op is not None:
            self.queue.wait(op)
        return buf

    def pending(self) -> bool:
        return bool(self._posted or self._settled) or self.queue.pending()


def exchange(queue: P2PQueue, sends: list[tuple[list[dist.P2POp], list[dist.P2POp]]],
             receives: list[tuple[PeerChannel, int, Any, str | None]]) -> None:
    """Issue one exchange: messages (``(first, after)`` pairs from :meth:`PeerChannel.send_ops`) and receives
    (``(channel, slot, mode, where)``) together in one group, then a follow-up group with the messages that resize
    messages announced.

    Under NCCL's semantics (``queue.ordered``) the receives are settled in between, so that the follow-up also holds
    the receive of any message the peer announced by a resize: two neighbours that resize towards each other at once
    then meet in their follow-ups instead of each waiting on a lone send. Receives already posted (ahead, matched by
    tag) are left as they are and settled by :meth:`PeerChannel.recv`.
    """
    ops = [op for first, _ in sends for op in first]
    for chan, slot, mode, _ in receives:
        op = chan.recv_op(slot, mode)
        if op is not None:
            ops.append(op)
    queue.issue(ops)
    follow = [op for _, after in sends for op in after]
    if queue.ordered:
        for chan, slot, _, where in receives:
            follow += chan.settle(slot, where)
    queue.issue(follow)
