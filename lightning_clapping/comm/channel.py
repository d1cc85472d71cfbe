"""The channel: messages of one purpose exchanged with one peer rank, in the verbs a schedule needs.

A message is one ``uint8`` tensor laid out by :mod:`lightning_clapping.comm.wire`; this module moves it. A receive
is posted before its message arrives (gloo moves data only once a receive is posted, NCCL's send waits for it).
That needs the receiver to know a message's size in advance: both ends remember the size of the last message in
each *slot* (micro-batch position) and *mode* (a key both ends can compute, such as "full precision" or
"compressed"), and the sender keeps to it. When the size changes anyway (the first message, a smaller last batch)
the sender sends a *resize* message of the expected size that announces the new one
(:func:`~lightning_clapping.comm.wire.resize_message`), and the message itself in the group of operations that
follows (see :func:`exchange`); the receiver receives the message right after the resize, before anything else from
that peer.

Every operation is issued through a :class:`~lightning_clapping.comm.p2p.P2PQueue`, i.e. with
``torch.distributed.batch_isend_irecv``, on every backend. Messages are matched in one of two ways:

* by tag (``prepost=True``, gloo only): each slot has its own tags (one for the resize or the message, one for the
  message after a resize), so receives can be posted for a whole step ahead, in any order;
* by order (``prepost=False``, NCCL, which ignores tags): everything carries tag 0; both ends make their operations
  with one peer in the same order (resize, then message), which :mod:`lightning_clapping.pipeline.schedule` guarantees.

What arrives is checked by :mod:`~lightning_clapping.comm.wire` before it is used: a resize message announcing a
size out of bounds raises :class:`~lightning_clapping.comm.wire.WireError` before anything is allocated.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping.comm.p2p import P2PQueue
from lightning_clapping.comm.wire import HEADER_BYTES, MAX_MESSAGE_BYTES, WireError, announced_size, resize_message


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
        total = announced_size(buf, self.max_message_bytes, where or f"slot {slot} from rank {self.peer}")
        if total is None:  # the message itself
            self._settled[slot] = (None, buf)
            return []
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
