"""Liveness: a stage whose process stops answering is found within seconds, and the whole process group ends.

Without it, a hung stage (its process stopped, swapping, or deadlocked while holding the GIL) blocks every other
stage for the whole process-group ``timeout`` (10 minutes by default), and is never killed when they give up.

How it works. Every rank runs a :class:`Watchdog`, started once the process group exists. A daemon thread adds 1 to
this rank's heartbeat counter in the process group's key-value store every ``interval`` seconds and reads the other
ranks' counters. A peer whose counter has not moved for ``bound`` seconds, measured on this rank's own monotonic
clock (the hosts' clocks never need to agree), is declared hung. The store is served from rank 0's process (a
TCPStore, for ``env://`` and ``tcp://``): when rank 0 is stopped, store calls block without any bound (the store's
own timeout does not cover a server that accepted the connection and then stopped answering, nor does it bound
opening a new connection; measured on torch 2.13). The watchdog therefore talks to the store over its own connection
(``store.clone()``), and a second thread declares the store's host (``store_rank``, rank 0) hung when one of those
calls has been unanswered for ``bound`` seconds. A store call that *fails* (connection refused or reset) means rank
0's process has ended, which is not a hang: the watchdog winds down, and a rank other than 0 that still runs
``bound`` seconds later ends itself (see 4. below), unless rank 0 had finished normally. Once rank 0 has marked
itself done, the others' watchdogs wind down too (its process, and the store, may end at any moment). Under
``torchrun`` the store lives in the elastic agent: pass ``store_rank=None`` there.

When a peer is declared hung, the detecting rank

1. writes the reason under ``clapping/failure/{rank of the hung peer}`` (the key
   :mod:`lightning_clapping.comm.failures` reads): rank 0, which then fails with a lost connection, raises
   :class:`~lightning_clapping.comm.failures.StageFailure` naming the hung stage. The reason also goes to this
   rank's stderr. The key is only written if absent, so a stage's own failure reason is never replaced;
2. ends the hung process if it runs in the same process space (SIGKILL, never a reused pid); its sockets close, so
   every rank blocked in a gloo transfer with it fails at once;
3. otherwise (another host, or no permission to kill) shuts down this process's own TCP connections to it, which
   makes a gloo wait on that peer fail at once (the hung process itself stays on its host: end it there).
   :mod:`lightning_clapping.comm.liveness_actions` does both and says why nothing else would wake the wait;
4. on a rank other than 0 (``may_exit``), ends this process with exit code 1 if it has not stopped its watchdog
   ``bound`` seconds later (its main thread may be blocked where no socket can wake it: a lock, a store wait, a
   transfer with a rank that is itself blocked), so the cascade always reaches rank 0. Rank 0 is the user's process
   and is never ended by its own watchdog (but it is killed like any other when it is the hung one).

What is covered: a process that is stopped (SIGSTOP, Ctrl-Z of a single process, a debugger), swapping or starved so
that its threads do not run, deadlocked while holding the GIL, or killed without closing its sockets (its host went
away). What is not: a main thread stuck (busy loop, deadlock on a lock, a wait that never ends) while its heartbeat
thread keeps running. That stage looks alive, and the process group ``timeout`` remains the bound for it. Legitimate
long work (a long step, checkpoint writing, validation) never fires the watchdog, since the heartbeat does not depend
on the main thread. A rank that stops its watchdog (teardown, or interpreter exit through ``atexit``) marks itself
done, so ranks that finish at different times are not declared hung. When this rank's own threads did not run for
``bound / 2`` seconds (the whole group was stopped with Ctrl-Z, the machine was suspended, this process was
swapping), every timer restarts instead of blaming the peers.

Ranks must start the same number of watchdogs on one store (one per fit/validate/test call): the keys of the n-th
start are ``clapping/liveness/{n}/...``, so a later run never sees an earlier run's "done".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_clapping.comm import liveness_actions as actions
from lightning_clapping.comm.failures import failure_key

#: seconds between two heartbeats of a rank (and between two reads of the others' heartbeats)
DEFAULT_INTERVAL = 1.0
#: seconds without a heartbeat after which a peer is declared hung
DEFAULT_BOUND = 30.0
#: the bound must cover this many intervals: a healthy peer's heartbeat is seen every interval or two
MIN_INTERVALS_PER_BOUND = 4

_PREFIX = "clapping/liveness"
_DONE = 1 << 40  # added to a rank's heartbeat counter when its watchdog stops: "done, expect no more heartbeats"
_STORE_OP_LIMIT = 2.0  # seconds a side task (reason, endpoints) waits for the store before going on without it


class _StoreGone(RuntimeError):
    """A call on the watchdog's store connection failed: the store's process ended, or the connection was closed."""


@dataclass
class HungPeer:
    """A peer this watchdog declared hung, and what it did about it."""

    rank: int
    stage: int
    silent_for: float  # seconds without a heartbeat (or without an answer from the store it serves)
    reason: str  # the text written to the failure key
    action: str  # "killed", "connections closed" or "none"


@dataclass
class _Peer:
    rank: int
    stage: int
    value: int | None = None  # last heartbeat counter read
    changed_at: float = 0.0  # this rank's monotonic time when that counter was last seen to move
    done: bool = False
    declared: bool = False
    info: dict[str, Any] | None = None  # host, pid, start time, process space (registered once)
    endpoints: list[list[Any]] | None = None  # cached only for the store's host (read when the store still answers)


class Watchdog:
    """Heartbeats between the ranks of a process group; declares, reports and ends a hung peer.

    Args:
        store: the process group's key-value store (``lightning_clapping._compat.default_store()``). The watchdog
            opens its own connection to it (``store.clone()``) so that neither blocks the other.
        rank: this process's global rank.
        world_size: the number of processes (ranks) in the group.
        stage_of_rank: the pipeline stage of each rank, as a sequence indexed by rank or a function; ``None``: the
            rank. Only used to name the hung stage.
        interval: seconds between heartbeats.
        bound: seconds without a heartbeat after which a peer is declared hung; at least
            ``MIN_INTERVALS_PER_BOUND`` x ``interval``.
        store_rank: the rank whose process serves the store (rank 0 for ``env://`` and ``tcp://``), declared hung
            when the store stops answering; ``None`` when the store does not live in a rank (e.g. a FileStore).
        may_exit: whether this process may end itself when a declared peer leaves it blocked (default: every rank
            but 0, which is the user's process).
        host: the name this rank gives as its host (default ``socket.gethostname()``); two ranks are killable by each
            other only when their host names and process spaces match.

    In a strategy, on every rank (``world_size`` is the number of processes, i.e. of stages)::

        # setup_environment(), once the process group exists
        self._watchdog = Watchdog(_compat.default_store(), self.global_rank, self.num_stages,
                                  stage_of_rank=lambda r: self.num_stages - 1 - r,  # last stage on rank 0
                                  interval=1.0, bound=30.0).start()
        # teardown()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        stage_of_rank: Sequence[int] | Callable[[int], int] | None = None,
        interval: float = DEFAULT_INTERVAL,
        bound: float = DEFAULT_BOUND,
        store_rank: int | None = 0,
        may_exit: bool | None = None,
        host: str | None = None,
    ) -> None:
        for name, value in (("interval", interval), ("bound", bound)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"liveness {name} must be a positive number of seconds, got {value!r}")
        if bound < MIN_INTERVALS_PER_BOUND * interval:
            raise ValueError(
                f"liveness bound ({bound} s) must be at least {MIN_INTERVALS_PER_BOUND} x the heartbeat interval "
                f"({interval} s): a healthy rank's heartbeat is only seen every interval or two, so a shorter bound "
                f"would declare healthy ranks hung. Raise the bound or lower the interval."
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        if store_rank is not None and not (isinstance(store_rank, int) and 0 <= store_rank < world_size):
            raise ValueError(f"store_rank must be None or an int in 0..{world_size - 1}, got {store_rank!r}")
        if store is None and world_size > 1:
            raise ValueError("the liveness watchdog needs the process group's store (got None)")
        if stage_of_rank is None:
            stages = list(range(world_size))
        elif callable(stage_of_rank):
            stages = [int(stage_of_rank(r)) for r in range(world_size)]
        else:
            stages = [int(s) for s in stage_of_rank]
            if len(stages) != world_size:
                raise ValueError(f"stage_of_rank has {len(stages)} entries for {world_size} ranks")
        self.rank = rank
        self.world_size = world_size
        self.interval = float(interval)
        self.bound = float(bound)
        self.store_rank = store_rank
        self.may_exit = rank != 0 if may_exit is None else bool(may_exit)
        self.host = host if host is not None else socket.gethostname()
        self.stage = stages[rank]
        #: the peers this watchdog declared hung (filled by its threads)
        self.hung: list[HungPeer] = []
        self._given_store = store
        self._stages = stages
        self._store: Any = None
        self._gen = 0
        self._peers = {r: _Peer(r, stages[r]) for r in range(world_size) if r != rank}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # watchdog state shared by its threads
        self._store_lock = threading.Lock()  # one store call at a time on the watchdog's connection
        self._inflight_since: float | None = None  # when the store call in progress started
        self._grace_at = 0.0  # timers restart here after this process itself did not run for a while
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopped = False
        self._exit_armed = False
        self._published: frozenset[str] | None = None
        self._faulted = False

    # ------------------------------------------------------------------ public API
    def start(self) -> Watchdog:
        """Register this rank and start the threads (call on every rank, right after the process group exists)."""
        if self._started:
            raise RuntimeError("this liveness watchdog was already started; create a new one")
        self._started = True
        if self.world_size == 1:
            return self
        self._gen = int(self._given_store.add(f"{_PREFIX}/starts/{self.rank}", 1))
        self._store = _own_connection(self._given_store, self.bound)
        now = time.monotonic()
        self._grace_at = now
        for peer in self._peers.values():
            peer.changed_at = now
        info = {"host": self.host, "pid": os.getpid(), "start": actions.start_time(os.getpid()),
                "space": actions.process_space(), "stage": self.stage}
        self._call(lambda s: s.set(self._key("info", self.rank), json.dumps(info)))
        self._publish_endpoints()
        self._call(lambda s: s.add(self._key("beat", self.rank), 1))
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._store_guard_loop, "store-guard")):
            thread = threading.Thread(target=target, name=f"clapping-liveness-{name}-rank{self.rank}", daemon=True)
            thread.start()
            self._threads.append(thread)
        atexit.register(self.stop)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Mark this rank done and end the threads (teardown; idempotent; waits ``timeout`` s at most, 5 by default).

        After a declaration this also cancels ending this process. A thread blocked in a call to a store that no
        longer answers is left behind (daemon): nothing can wake it, and it holds only the watchdog's own connection.
        """
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._stop.set()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        deadline = time.monotonic() + (5.0 if timeout is None else timeout)
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive_threads(self) -> list[threading.Thread]:
        return [t for t in self._threads if t.is_alive()]

    # ------------------------------------------------------------------ the store
    def _key(self, kind: str, rank: int) -> str:
        return f"{_PREFIX}/{self._gen}/{kind}/{rank}"

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """One call on the watchdog's connection; the store guard watches how long it stays unanswered."""
        with self._store_lock:
            self._inflight_since = time.monotonic()
            try:
                return fn(self._store)
            except Exception as err:
                raise _StoreGone(f"the process group's store failed: {type(err).__name__}: {err}") from err
            finally:
                self._inflight_since = None

    def _bounded_call(self, fn: Callable[[Any], Any], limit: float = _STORE_OP_LIMIT) -> Any:
        """:meth:`_call` from a side thread, given up (None) after ``limit`` s: the store may be what hangs."""
        box: list[Any] = []

        def run() -> None:
            with contextlib.suppress(Exception):
                box.append(self._call(fn))

        thread = threading.Thread(target=run, name=f"clapping-liveness-store-rank{self.rank}", daemon=True)
        thread.start()
        thread.join(limit)
        return box[0] if box else None

    def _read_json(self, kind: str, rank: int) -> Any:
        key = self._key(kind, rank)
        # check first: a get on a missing key would wait for it
        raw = self._call(lambda s: s.get(key) if s.check([key]) else None)
        return None if raw is None else json.loads(raw.decode() if isinstance(raw, bytes) else raw)

    def _publish_endpoints(self) -> None:
        """Publish the local endpoints of this process's TCP connections when they changed (new groups connect)."""
        inodes = actions.socket_inodes()
        if inodes is None or inodes == self._published:
            return
        try:
            endpoints = actions.local_endpoints(inodes)
        except (OSError, ValueError):  # an unexpected /proc format: no endpoints, so no connections to close
            return
        self._call(lambda s: s.set(self._key("ep", self.rank), json.dumps(endpoints)))
        self._published = inodes

    # ------------------------------------------------------------------ the threads
    def _restart_timers_after_gap(self, previous: float, now: float) -> None:
        # this thread did not run for a long while: this process (or the whole group) was stopped or starved;
        # what the peers did meanwhile is unknown, so every timer restarts rather than blaming them
        if now - previous > self.bound / 2:
            self._grace_at = max(self._grace_at, now)

    def _store_host_done(self) -> bool:
        host = self._peers.get(self.store_rank) if self.store_rank is not None else None
        return host is not None and host.done

    def _heartbeat_loop(self) -> None:
        previous = time.monotonic()
        # once the store's host has finished, the run is over and its process may end (and the store with it) at
        # any moment: the watchdog winds down without another store call (the others wind down alike)
        while not self._stop.is_set() and not self._store_host_done():
            began = time.monotonic()
            self._restart_timers_after_gap(previous, began)
            previous = began
            try:
                self._cycle()
            except _StoreGone:
                # a store that answers with an error (refused, reset) is gone: the process serving it ended (a
                # store that does not answer at all is the store guard's business). Unless that rank had finished,
                # the process group cannot go on: a rank still blocked a bound later ends itself.
                if self.store_rank is not None and self.store_rank != self.rank:
                    self._exit_if_left_blocked(f"the process group's store is gone (rank {self.store_rank}, whose "
                                               "process served it, ended before it finished)")
                return
            except Exception as err:  # noqa: BLE001 - a fault here must not stop the heartbeat
                if not self._faulted:
                    self._faulted = True
                    _say(f"[lightning-clapping liveness, rank {self.rank}] heartbeat fault: "
                         f"{type(err).__name__}: {err}")
            if self._stop.wait(max(0.0, self.interval - (time.monotonic() - began))):
                break
        if not self._store_host_done():
            with contextlib.suppress(Exception):
                self._call(lambda s: s.add(self._key("beat", self.rank), _DONE))

    def _cycle(self) -> None:
        self._call(lambda s: s.add(self._key("beat", self.rank), 1))
        self._publish_endpoints()
        for peer in self._peers.values():
            if peer.done or peer.declared or self._stop.is_set():
                continue
            value = int(self._call(lambda s, r=peer.rank: s.add(self._key("beat", r), 0)))
            now = time.monotonic()
            if value >= _DONE:
                peer.done = True
                continue
            if value != peer.value:
                peer.value, peer.changed_at = value, now
            if peer.info is None:
                peer.info = self._read_json("info", peer.rank)
            if peer.rank == self.store_rank:  # its endpoints are unreadable once it hangs: keep them at hand
                peer.endpoints = self._read_json("ep", peer.rank) or peer.endpoints
        now = time.monotonic()
        for peer in self._peers.values():
            silent = now - max(peer.changed_at, self._grace_at)
            if not (peer.done or peer.declared) and silent > self.bound:
                self._declare(peer, silent, store_silent=False)

    def _store_guard_loop(self) -> None:
        previous = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            self._restart_timers_after_gap(previous, now)
            previous = now
            since = self._inflight_since
            peer = self._peers.get(self.store_rank) if self.store_rank is not None else None
            if since is None or peer is None or peer.done or peer.declared:
                continue
            silent = now - max(since, self._grace_at)
            if silent > self.bound:
                self._declare(peer, silent, store_silent=True)

    # ------------------------------------------------------------------ a hung peer
    def _declare(self, peer: _Peer, silent: float, store_silent: bool) -> None:
        with self._lock:
            if peer.declared or self._stop.is_set():
                return
            peer.declared = True
        thread = threading.Thread(target=self._act, args=(peer, silent, store_silent), daemon=True,
                                  name=f"clapping-liveness-act-rank{self.rank}")
        self._threads.append(thread)
        thread.start()

    def _act(self, peer: _Peer, silent: float, store_silent: bool) -> None:
        info = peer.info
        if info is None and not store_silent:
            info = self._bounded_call(lambda s: _get_json(s, self._key("info", peer.rank)))
        local = bool(info) and info.get("host") == self.host and info.get("space") == actions.process_space()
        if local and not actions.same_process(info["pid"], info.get("start")):
            peer.done = True  # its process has ended: not hung, and its closed sockets already end the others
            return
        action = "killed" if local else "connections closed"
        reason = self._reason(peer, silent, store_silent, info, action)
        if not store_silent:  # otherwise the store is what does not answer (it lives in the hung process)
            self._bounded_call(lambda s: s.compare_set(failure_key(peer.rank), "", reason))
        _say(f"[lightning-clapping liveness, rank {self.rank}] {reason}")
        if self._stop.is_set():
            return
        record = HungPeer(peer.rank, peer.stage, silent, reason, action)
        self.hung.append(record)  # before acting: the main thread may read it as soon as its wait fails
        if not (local and actions.kill(info["pid"])):  # (killing fails for another user's process)
            endpoints = peer.endpoints if store_silent else self._bounded_call(
                lambda s: _get_json(s, self._key("ep", peer.rank)))
            closed = actions.shutdown_connections_to(endpoints or [])
            record.action = "connections closed" if closed else "none"
        self._exit_if_left_blocked(f"stage {peer.stage} (rank {peer.rank}) was declared hung")

    def _reason(self, peer: _Peer, silent: float, store_silent: bool, info: dict[str, Any] | None,
                action: str) -> str:
        who = (f"stage {peer.stage} (rank {peer.rank}, pid {info['pid']} on host {info['host']})" if info
               else f"stage {peer.stage} (rank {peer.rank}, which never registered its host and pid)")
        what = (f"did not answer for {silent:.1f} s (liveness bound {self.bound:g} s): the key-value store its "
                f"process serves stopped answering" if store_silent
                else f"sent no heartbeat for {silent:.1f} s (liveness bound {self.bound:g} s)")
        text = f"{who} {what}: it is stopped, deadlocked while holding the GIL, or swapping. "
        if action == "killed":
            text += (f"Rank {self.rank}'s liveness watchdog killed it (SIGKILL) so that the other stages end now "
                     "instead of after the process group timeout.")
        else:
            text += (f"It runs on another host, so rank {self.rank}'s liveness watchdog closed its connections to "
                     "it so that the other stages end now; the process may still be there: end it on its host.")
        return text + " If the stage only pauses this long on purpose, raise the liveness bound."

    def _exit_if_left_blocked(self, why: str) -> None:
        """On a rank that may end itself: end this process if it has not stopped its watchdog ``bound`` s later."""
        with self._lock:
            if not self.may_exit or self._exit_armed:
                return
            self._exit_armed = True
        if self._stop.wait(self.bound):
            return
        _say(f"[lightning-clapping liveness, rank {self.rank}] ending this process (exit code 1): {why}, and "
             f"{self.bound:g} s later this process still runs: the process group cannot go on.")
        os._exit(1)


# ---------------------------------------------------------------------- helpers


def _own_connection(store: Any, bound: float) -> Any:
    """A connection to ``store`` for the watchdog alone, with a short timeout (the store itself when it has none)."""
    own = store
    with contextlib.suppress(AttributeError, RuntimeError, NotImplementedError):
        own = store.clone()
    with contextlib.suppress(AttributeError, RuntimeError):
        own.set_timeout(timedelta(seconds=max(bound, 1.0)))
    return own


def _get_json(store: Any, key: str) -> Any:
    if not store.check([key]):
        return None
    raw = store.get(key)
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(text, file=sys.stderr, flush=True)


__all__ = ["DEFAULT_BOUND", "DEFAULT_INTERVAL", "HungPeer", "MIN_INTERVALS_PER_BOUND", "Watchdog", "failure_key"]
