"""Liveness: a stage whose process stops answering is found within seconds, and the whole process group ends.

Without it, a hung stage (its process stopped, swapping, or deadlocked while holding the GIL) blocks every other
stage for the whole process-group ``timeout`` (10 minutes by default), and is never killed when they give up.

How it works. Every rank runs a :class:`Watchdog`, started once the process group exists. A daemon thread writes
this rank's heartbeat (a beat number) to the process group's key-value store every ``interval`` seconds, reads the
news counter, and reads heartbeats: the lowest unfinished rank reads every other's in one call, the others read its
only (:mod:`lightning_clapping.comm.liveness_watch`). That is three store calls per rank and interval, O(N) in all.
A peer is declared hung when two reads of its beat ``bound`` seconds apart on this rank's own monotonic clock (the
hosts' clocks never need to agree) show the same number, counted from the end of the read that first saw it to the
start of the latest one, so a slow store call is never taken for the peer's silence; a gap of ``bound / 2`` in this
rank's own heartbeat thread (Ctrl-Z of the whole group, a suspended machine, swapping, or a store call that kept it
waiting: the store was slow for every rank) restarts the timers. A declaration is published in the store, and every
rank acts on it. How the store is reached without being blocked by it, how a store whose host hangs is told from a
slow call, and the key layout: :mod:`lightning_clapping.comm.liveness_store`. A store call that *fails* (connection
refused or reset) means rank 0's process, which serves the store, has ended: not a hang; the watchdog winds down,
and a rank other than 0 that still runs ``bound`` seconds later ends itself (see 4. below), unless rank 0 had
finished normally (the others then wind down without another store call).

For a hung peer, a rank

1. that declared it writes the reason under ``clapping/failure/{rank of the hung peer}`` (the key
   :mod:`lightning_clapping.comm.failures` reads; only if absent, so a stage's own reason is never replaced): rank 0,
   which then fails with a lost connection, raises :class:`~lightning_clapping.comm.failures.StageFailure` naming
   the hung stage. The reason also goes to stderr;
2. kills it where that is proven safe (:mod:`lightning_clapping.comm.liveness_actions`: through a pidfd checked to
   hold the published process, on the same host, boot and PID namespace); its sockets close, so every rank blocked
   in a gloo transfer with it fails at once;
3. otherwise says why not and shuts down this process's own TCP connections to it, which makes a gloo wait on that
   peer fail at once (the hung process itself stays on its host: end it there);
4. other than 0 (``may_exit``), ends this process with exit code 1 if it has not stopped its watchdog ``bound``
   seconds later (its main thread may be blocked where no socket can wake it: a lock, a store wait, a transfer with
   a rank that is itself blocked), so the cascade always reaches rank 0. Rank 0 is the user's process and is never
   ended by its own watchdog (but it is killed like any other when it is the hung one).

What is covered: a process that is stopped (SIGSTOP, Ctrl-Z of a single process, a debugger), swapping or starved so
that its threads do not run, deadlocked while holding the GIL, or killed without closing its sockets (its host went
away). What is not: a main thread stuck (busy loop, deadlock on a lock, a wait that never ends) while its heartbeat
thread keeps running. That stage looks alive, and the process group ``timeout`` remains the bound for it. Legitimate
long work (a long step, checkpoint writing, validation) never fires the watchdog, since the heartbeat does not depend
on the main thread. A rank that stops its watchdog (teardown, or interpreter exit through ``atexit``) marks itself
done, so ranks that finish at different times are not declared hung.

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
from typing import Any

from lightning_clapping.comm import liveness_actions as actions
from lightning_clapping.comm.failures import failure_key
from lightning_clapping.comm.liveness_store import (DONE, StoreGone, WatchdogStore, get_text, store_rank_from_env,
                                                    text)
from lightning_clapping.comm.liveness_watch import Peer, Watching

#: seconds between two heartbeats of a rank (and between two reads of its successor's heartbeat)
DEFAULT_INTERVAL = 1.0
#: seconds without a heartbeat after which a peer is declared hung
DEFAULT_BOUND = 30.0
#: the bound must cover this many intervals: a healthy peer's heartbeat is seen every interval or two
MIN_INTERVALS_PER_BOUND = 4

@dataclass
class HungPeer:
    """A peer this watchdog declared hung (or learned was declared), and what it did about it."""

    rank: int
    stage: int
    silent_for: float  # seconds without a heartbeat (or without an answer from the store it serves)
    reason: str  # the text written to the failure key
    action: str  # "killed", "connections closed" or "none"


class Watchdog:
    """Heartbeats between the ranks of a process group; declares, reports and ends a hung peer.

    Args:
        store: the process group's key-value store (``lightning_clapping._compat.default_store()``). The watchdog
            opens its own connections to it (``store.clone()``) so that neither blocks the other.
        rank: this process's global rank.
        world_size: the number of processes (ranks) in the group.
        stage_of_rank: the pipeline stage of each rank, as a sequence indexed by rank or a function; ``None``: the
            rank. Only used to name the hung stage.
        interval: seconds between heartbeats.
        bound: seconds without a heartbeat after which a peer is declared hung; at least
            ``MIN_INTERVALS_PER_BOUND`` x ``interval``.
        store_rank: the rank whose process serves the store, declared hung when the store stops answering;
            ``None`` when no rank serves it; ``"env"`` (default): :func:`store_rank_from_env`.
        may_exit: whether this process may end itself when a declared peer leaves it blocked (default: every rank
            but 0, which is the user's process).
        host: the name this rank gives as its host (default ``socket.gethostname()``), in messages; a peer is only
            killed when its host name, kernel boot and PID namespace match this rank's.

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
        store_rank: int | str | None = "env",
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
        if store_rank == "env":
            store_rank = store_rank_from_env()
        if store_rank is not None and not (isinstance(store_rank, int) and 0 <= store_rank < world_size):
            raise ValueError(f"store_rank must be None, 'env' or an int in 0..{world_size - 1}, got {store_rank!r}")
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
        self.store_rank: int | None = store_rank
        self.may_exit = rank != 0 if may_exit is None else bool(may_exit)
        self.host = host if host is not None else socket.gethostname()
        self.stage = stages[rank]
        #: the peers this watchdog declared hung, or learned were declared (filled by its threads)
        self.hung: list[HungPeer] = []
        self._given_store = store
        self._store: WatchdogStore = None  # type: ignore[assignment]  # set by start()
        self._peers = {r: Peer(r, stages[r]) for r in range(world_size) if r != rank}
        self._identity: dict[str, Any] = {}
        self._watching = Watching(rank, world_size, self.bound, self._peers)
        self._beat_keys_seen: set[int] = set()  # peers whose heartbeat key exists (a get on a missing key waits)
        self._news = -1  # the news counter last read (-1: read everything at the first cycle)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # watchdog state shared by its threads
        self._grace_at = 0.0  # timers restart here after this process's threads did not run for a while
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
        probe = self.store_rank is not None and self.store_rank != self.rank
        self._store = WatchdogStore(self._given_store, self.rank, self.bound, probe=probe)
        self._grace_at = time.monotonic()
        self._identity = actions.identity(self.host)
        info = dict(self._identity, stage=self.stage)
        if self.rank == self.store_rank:
            info["serves_store"] = self._check_serving()
        self._call(lambda s: s.set(self._key("info", self.rank), json.dumps(info)))
        self._publish_endpoints()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._store_guard_loop, "store-guard")):
            self._spawn(target, name)
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

    @property
    def watched_ranks(self) -> list[int]:
        """The peers whose heartbeat this rank reads now (all when it is the lowest unfinished rank, else that one)."""
        return sorted(self._watching.watches)

    @property
    def longest_silence(self) -> float:
        """The longest silence (seconds) this rank has measured so far: the margin a healthy run keeps to ``bound``."""
        return self._watching.longest

    # ------------------------------------------------------------------ the store
    def _key(self, kind: str, rank: int | None = None) -> str:
        return self._store.key(kind, rank)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        return self._timed(lambda: self._store.call(fn))

    def _read(self, kind: str, rank: int | None = None) -> str | None:
        return self._timed(lambda: self._store.read(kind, rank))

    def _timed(self, run: Callable[[], Any]) -> Any:
        # a call that kept this rank waiting bound / 2 or more: the store was slow for every rank, so the peers'
        # beats could not land either, and the timers restart when it returns (before the beats read next count)
        began = time.monotonic()
        try:
            return run()
        finally:
            ended = time.monotonic()
            if ended - began > self.bound / 2:
                self._grace_at = max(self._grace_at, ended)

    def _check_serving(self) -> bool:
        """On the store's host: whether this process holds the store's listening socket (True where /proc, or the
        store's port, cannot tell: the launcher's variables then stand). A rank that does not serve it says so, and
        a store that stops answering is then nobody's hang."""
        port = self._store.port
        serving = actions.listens_on(port) if port else None
        if serving is False:
            _say(f"[lightning-clapping liveness, rank {self.rank}] this process does not serve the process group's "
                 f"store (no listening socket on port {port}): a store that stops answering is not taken for a "
                 "hung rank")
            self.store_rank = None
        return serving is not False

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
        if self.rank == self.store_rank:  # the others cache the store host's endpoints (read on news)
            self._call(lambda s: s.add(self._key("news"), 1))
        self._published = inodes

    # ------------------------------------------------------------------ the threads
    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"clapping-liveness-{name}-rank{self.rank}")
        self._threads.append(thread)
        thread.start()

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
            except StoreGone:
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
                self._call(lambda s: s.set(self._key("beat", self.rank), "done"))
                if self.rank == self.store_rank:
                    self._call(lambda s: s.add(self._key("news"), DONE))

    def _cycle(self) -> None:
        beat = self._watching.heartbeat()
        self._call(lambda s: s.set(self._key("beat", self.rank), beat))
        self._publish_endpoints()
        news = int(self._call(lambda s: s.add(self._key("news"), 0)))
        if news >= DONE and self.store_rank is not None and self.store_rank != self.rank:
            self._peers[self.store_rank].done = True
            return
        if news != self._news:
            self._read_news()
            self._news = news
        host = self._peers.get(self.store_rank) if self.store_rank is not None else None
        if host is not None and host.info is None:  # kept at hand: unreadable once the store's host hangs
            raw = self._read("info", host.rank)
            host.info = None if raw is None else json.loads(raw)
            if host.info is not None and host.info.get("serves_store") is False:
                self.store_rank = None
        self._watching.step(self._read_beats, self._grace_at, self._declare)

    def _read_beats(self, ranks: Sequence[int]) -> dict[int, str | None]:
        """The heartbeats of ``ranks``: those whose key exists in one ``multi_get``, the others checked first."""
        seen = [r for r in ranks if r in self._beat_keys_seen]
        unseen = [r for r in ranks if r not in self._beat_keys_seen]

        def read(store: Any) -> dict[int, str | None]:
            found: dict[int, str | None] = {}
            if seen:
                values = store.multi_get([self._key("beat", r) for r in seen])
                found.update((r, text(v)) for r, v in zip(seen, values))
            for r in unseen:
                found[r] = get_text(store, self._key("beat", r))
            return found

        beats = self._call(read)
        self._beat_keys_seen.update(r for r in unseen if beats[r] is not None)
        return beats

    def _read_news(self) -> None:
        """Read the declarations not read yet (and the store host's endpoints, which it republished)."""
        for rank, by, silent, reason in self._store.new_declarations():
            if rank == self.rank:
                self._spawn(self._exit_if_left_blocked, "exit", f"rank {by} declared this rank hung")
            elif rank in self._peers:
                self._declare(self._peers[rank], silent, learned=(by, reason))
        host = self._peers.get(self.store_rank) if self.store_rank is not None else None
        if host is not None:
            raw = self._read("ep", host.rank)
            host.endpoints = json.loads(raw) if raw is not None else host.endpoints

    def _store_guard_loop(self) -> None:
        previous = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            self._restart_timers_after_gap(previous, now)
            previous = now
            since = self._store.inflight_since
            peer = self._peers.get(self.store_rank) if self.store_rank is not None else None
            if since is None or peer is None or peer.done or peer.declared:
                continue
            stalled = now - max(since, self._grace_at)
            if stalled <= self.bound / 2:
                continue
            probing = self._store.probe(self._spawn)  # a call on a second connection: one slow call is no hang
            if stalled > self.bound and now - max(probing, self._grace_at) > self.bound / 2:
                self._declare(peer, stalled, store_silent=True)

    # ------------------------------------------------------------------ a hung peer
    def _declare(self, peer: Peer, silent: float, store_silent: bool = False,
                 learned: tuple[int, str] | None = None) -> bool:
        """Act on ``peer`` in a thread of its own (once); False when the watchdog stops."""
        with self._lock:
            if self._stop.is_set():
                return False
            if peer.declared:
                return True
            peer.declared = True
        self._spawn(self._act, "act", peer, silent, store_silent, learned)
        return True

    def _act(self, peer: Peer, silent: float, store_silent: bool, learned: tuple[int, str] | None) -> None:
        info = peer.info
        if info is None and not store_silent:
            info = self._store.read_json_bounded("info", peer.rank)
        verdict = actions.verify(info, self._identity)
        tag = f"[lightning-clapping liveness, rank {self.rank}]"
        if verdict.ended:  # its process ended: not hung, and its closed sockets already end the others
            peer.done = True
            what = "sent no heartbeat" if learned is None else f"was declared hung by rank {learned[0]}"
            _say(f"{tag} stage {peer.stage} (rank {peer.rank}) {what}, but {verdict.why}: nothing left to do")
            return
        if learned is None:
            reason = self._reason(peer, silent, store_silent, info, verdict.pidfd is not None)
            if not store_silent:  # otherwise the store is what does not answer (it lives in the hung process)
                self._store.bounded(lambda s: self._store.publish_declaration(s, peer.rank, silent, reason))
            _say(f"{tag} {reason}")
        else:
            reason = learned[1]
            _say(f"{tag} stage {peer.stage} (rank {peer.rank}) was declared hung by rank {learned[0]}")
        if self._stop.is_set():
            verdict.close()
            return
        record = HungPeer(peer.rank, peer.stage, silent, reason,
                          "killed" if verdict.pidfd is not None else "connections closed")
        self.hung.append(record)  # before acting: the main thread may read it as soon as its wait fails
        if not actions.kill(verdict):
            closed = 0
            if not verdict.itself:  # (ranks simulated as threads of one process: their connections are this one's)
                endpoints = peer.endpoints if store_silent else self._store.read_json_bounded("ep", peer.rank)
                closed = actions.shutdown_connections_to(endpoints or [], actions.same_network(info, self._identity))
            record.action = "connections closed" if closed else "none"
            _say(f"{tag} did not kill stage {peer.stage} (rank {peer.rank}): {verdict.why or 'it ended meanwhile'}; "
                 f"shut down {closed} of this process's TCP connections to it instead")
        self._exit_if_left_blocked(f"stage {peer.stage} (rank {peer.rank}) was declared hung")

    def _reason(self, peer: Peer, silent: float, store_silent: bool, info: dict[str, Any] | None,
                killing: bool) -> str:
        who = (f"stage {peer.stage} (rank {peer.rank}, pid {info['pid']} on host {info['host']})" if info
               else f"stage {peer.stage} (rank {peer.rank}, which never registered its host and pid)")
        if store_silent:
            what = (f"did not answer for {silent:.1f} s (liveness bound {self.bound:g} s): the key-value store its "
                    f"process serves stopped answering")
        else:
            what = f"sent no heartbeat for {silent:.1f} s (liveness bound {self.bound:g} s)"
        msg = f"{who} {what}: it is stopped, deadlocked while holding the GIL, or swapping. "
        if killing:
            msg += (f"Rank {self.rank}'s liveness watchdog killed it (SIGKILL) so that the other stages end now "
                     "instead of after the process group timeout.")
        else:
            msg += (f"Rank {self.rank}'s liveness watchdog could not prove it safe to kill, so it closed its "
                     "connections to it so that the other stages end now; the process may still be there: end it "
                     "on its host.")
        return msg + " If the stage only pauses this long on purpose, raise the liveness bound."

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


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(text, file=sys.stderr, flush=True)


__all__ = ["DEFAULT_BOUND", "DEFAULT_INTERVAL", "HungPeer", "MIN_INTERVALS_PER_BOUND", "Watchdog", "failure_key",
           "store_rank_from_env"]
