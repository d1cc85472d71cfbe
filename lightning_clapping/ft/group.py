"""One rank's seat in the torchft quorum: its ``Manager``, the hook that averages its gradient buckets with the same
stage of the other live replica groups, and the vote on whether this step's optimizer step happens.

Each replica group is its own torch.distributed world (its pipeline). Rank 0 of the group starts a fresh TCPStore
for torchft (a store left over from a previous incarnation could hand the group's other ranks a dead manager's
address) and torchft's ``ManagerServer``, which talks to the lighthouse; every rank gets a ``Manager`` whose
reconfigurable process group joins the ranks of the same group rank, that is the same stage, of every group in the
quorum. The quorum is synchronous (``use_async_quorum=False``): a group that heals applies the peer's state before
it computes anything, and then takes part in the same step like the others.

From the moment a rank connects, SIGTERM ends its process at once (see :meth:`ReplicaGroup._end_on_sigterm`): a
group whose process died is closed by torchrun with SIGTERM, and none of its processes may stay in the quorum.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping.ft.config import FaultTolerance
from lightning_clapping.ft.transport import StateTransport

log = logging.getLogger(__name__)

STATE_KEY = "clapping"


class ReplicaGroup:
    """This rank's part in the quorum of replica groups (``config`` resolved: every field set).

    ``group_rank`` / ``group_size``: this rank and the number of ranks in its own group (its pipeline's stages).
    """

    def __init__(self, config: FaultTolerance, group_rank: int, group_size: int, device: torch.device) -> None:
        self.config, self.group_rank, self.group_size, self.device = config, group_rank, group_size, device
        self.manager: Any = None
        self.quorum_open = False
        self.heals = 0  # times this rank took a peer's state
        #: ``(time.time(), manager step, committed, participants)`` of every vote, for benchmarks and tests
        self.votes: list[tuple[float, int, bool, int]] = []
        self._store: Any = None

    @property
    def host(self) -> str:
        return self.config.host or socket.gethostname()

    def connect(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Collective over this group's ranks (its default process group): the store, then the manager."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        store_host = self.config.host or os.environ.get("MASTER_ADDR") or self.host
        port = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.group_rank == 0:
            self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
            port += self._store.port
        if self.group_size > 1:
            dist.broadcast(port, src=0)
        cfg = self.config
        pg = ProcessGroupNCCL(timeout=cfg.timeout) if self.device.type == "cuda" else ProcessGroupGloo(
            timeout=cfg.timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_replicas, use_async_quorum=False,
            timeout=cfg.timeout, quorum_timeout=cfg.quorum_timeout, connect_timeout=cfg.timeout,
            rank=self.group_rank, world_size=self.group_size, store_addr=store_host, store_port=int(port.item()),
            lighthouse_addr=cfg.lighthouse, replica_id=f"clapping_group_{cfg.replica_group}", hostname=self.host,
            checkpoint_transport=StateTransport(cfg.timeout, self.host), init_sync=cfg.init_sync,
        )

        def load(state: Any) -> None:
            self.heals += 1
            load_state_dict(state)

        self.manager.register_state_dict_fn(STATE_KEY, load, state_dict)
        self._end_on_sigterm()

    def _end_on_sigterm(self) -> None:
        """From now on SIGTERM ends this process at once, as it ends a Python program that handles no signal.

        When one process of a group dies, torchrun sends SIGTERM to the group's others and restarts the group once
        they have ended (a scheduler stops a job the same way). Lightning's handler only sets a flag, and Python runs
        handlers between two bytecodes of the main thread, which may be waiting inside torchft for the dead rank (its
        commit vote, up to ``FaultTolerance.timeout``; its quorum, up to ``quorum_timeout``). The rank that hosts the
        group's manager then went on heartbeating, and the lighthouse, which forms no quorum without a majority of
        the groups that heartbeat, held every other group until that wait ended or torchrun's SIGKILL came 30 s
        later; the other groups' all-reduces with the group's live ranks waited as long. Ended by the kernel, the
        process stops heartbeating and closes its connections at once. Nothing of the group's state is lost: it
        takes a live peer's when it rejoins. :meth:`close` leaves it so (a SIGTERM that came during the teardown
        after an error would be swallowed again, and the process then waited for torchrun's SIGKILL); Lightning's
        teardown, which comes after, puts back the handlers it found before the fit. A SIGTERM handler of the
        script's own does not run during a fault-tolerant fit."""
        if threading.current_thread() is threading.main_thread():  # only there can Python change a handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def start_quorum(self) -> None:
        """The quorum of the coming step (once per step; a peer's state is loaded here when this group is behind)."""
        if not self.quorum_open:
            self.manager.start_quorum()
            self.quorum_open = True

    def should_commit(self) -> bool:
        """After the gradients are averaged: whether every group rank of every live group got through the step."""
        committed = bool(self.manager.should_commit())
        self.quorum_open = False
        self.votes.append((time.time(), self.manager.current_step(), committed, self.manager.num_participants()))
        return committed

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None


class _Averaged:
    """What :func:`average_bucket` returns: ``wait()`` gives the bucket averaged over the live groups. A failed
    all-reduce leaves it undefined and makes the step's vote fail, so it is never applied."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


def average_bucket(group: ReplicaGroup, bucket: Any) -> _Averaged:
    """A DDP communication hook (``hook(state, bucket)``) for :class:`~lightning_clapping.comm.replicas.
    GradientAverager`: the bucket's average over this stage of every live replica group, started now."""
    group.start_quorum()  # normally opened at the end of the previous step; here if that was skipped
    return _Averaged(group.manager.allreduce(bucket.buffer()), bucket.buffer())
