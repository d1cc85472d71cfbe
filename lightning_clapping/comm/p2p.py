"""Issuing one rank's point-to-point operations in groups, each group with one ``torch.distributed.batch_isend_irecv``.

Under NCCL a send may wait until the peer has posted the matching receive, messages are matched by their order
between two ranks (tags are ignored), and a rank's batched operations run one group after another on one stream.
Two ranks that each send before they receive therefore wait on each other forever, unless the send and the receive
are issued in the same group: ``batch_isend_irecv`` launches a group's operations together, so they progress
together. The executor decides which operations form a group (:func:`lightning_clapping.pipeline.schedule.with_exchanges`);
this module issues them.

Two modes:

* ``ordered=True`` (NCCL's semantics, on every backend): a group is issued only once the previous one has completed,
  sends included, and waiting for one receive waits for its whole group. On gloo, whose sends also wait for the
  peer's receive, this behaves as NCCL does, so a grouping that would deadlock under NCCL deadlocks under gloo too.
* ``ordered=False`` (gloo with receives posted ahead and matched by tag): groups are issued at once, an operation is
  waited for alone and sends are waited for in :meth:`P2PQueue.flush`.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class _Group:
    def __init__(self, ops: list[dist.P2POp], works: list[dist.Work]) -> None:
        self.ops = ops  # keeps the tensors alive until the group has completed
        self.on_cuda = any(op.tensor.is_cuda for op in ops)
        self.works = works
        self.done = [False] * len(works)

    def works_of(self, index: int | None) -> list[int]:
        """Positions in :attr:`works` to wait for: the operation's own work when the backend returned one per
        operation (gloo), else all of them (NCCL returns one work for the whole group)."""
        if index is not None and len(self.works) == len(self.ops):
            return [index]
        return list(range(len(self.works)))


class P2PQueue:
    """A rank's point-to-point operations, issued in groups (see the module docstring for the two modes)."""

    def __init__(self, ordered: bool, timeout: timedelta | None = None) -> None:
        self.ordered = ordered
        self.timeout = timeout
        self._open: list[_Group] = []
        self._receives: dict[int, tuple[_Group, int]] = {}  # id of an issued receive not yet waited for -> place

    def issue(self, ops: list[dist.P2POp]) -> None:
        """Issue ``ops`` as one group (one ``batch_isend_irecv``); wait for a receive among them with :meth:`wait`."""
        if not ops:
            return
        if self.ordered:
            self.flush()  # the previous group completes before this one starts, as on NCCL's stream
        group = _Group(list(ops), dist.batch_isend_irecv(list(ops)))
        self._open.append(group)
        for i, op in enumerate(ops):
            if op.op is not dist.isend:
                self._receives[id(op)] = (group, i)

    def wait(self, op: dist.P2POp) -> None:
        """Return once the receive ``op`` has completed (in ordered mode: once its whole group has)."""
        try:
            group, index = self._receives.pop(id(op))
        except KeyError:
            raise RuntimeError("waiting for a receive that was never issued through this queue") from None
        self._wait(group, None if self.ordered else index)

    def flush(self) -> None:
        """Wait until every operation issued so far has completed (its tensors may be reused afterwards)."""
        for group in list(self._open):
            self._wait(group, None)

    def pending(self) -> bool:
        return bool(self._open)

    def _wait(self, group: _Group, index: int | None) -> None:
        for i in group.works_of(index):
            if not group.done[i]:
                work = group.works[i]
                if self.timeout is None or group.on_cuda:
                    # NCCL: wait() makes the current stream wait, the CPU runs on; given a timeout it would block
                    # the CPU until the group is done. The process group's own timeout still ends a stuck group.
                    work.wait()
                else:
                    work.wait(self.timeout)
                group.done[i] = True
        if all(group.done) and group in self._open:
            self._open.remove(group)
