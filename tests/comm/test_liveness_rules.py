"""The liveness watchdog at scale and its safety rules, with ranks simulated as threads of this process.

Every rank is a real :class:`Watchdog` on one real TCPStore (served from this process), reached through a proxy that
logs each store call and can hold a rank's calls (a stopped or slow rank, a slow store). Ranks of one process can
never be killed or have their connections shut down by each other (their pid is this process's), so only what the
watchdogs declare is looked at here; the multi-process scenarios are in ``test_liveness.py``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from lightning_clapping.comm import liveness_actions as actions
from lightning_clapping.comm.liveness import Watchdog, store_rank_from_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and pidfds")

_DATA_CALLS = frozenset({"add", "set", "get", "check", "compare_set", "multi_get", "multi_set", "delete_key", "wait"})


class _Holds:
    """When the calls of a rank (or of one of its connections) are held back."""

    def __init__(self) -> None:
        self.until: dict[object, float] = {}  # rank or (rank, connection) -> monotonic time
        self.frozen: set[int] = set()
        self._cond = threading.Condition()

    def freeze(self, *ranks: int) -> None:
        with self._cond:
            self.frozen.update(ranks)

    def thaw(self) -> None:
        with self._cond:
            self.frozen.clear()
            self.until.clear()
            self._cond.notify_all()

    def wait(self, rank: int, conn: int) -> None:
        with self._cond:
            while True:
                end = max(self.until.get(rank, 0.0), self.until.get((rank, conn), 0.0))
                left = end - time.monotonic()
                if rank not in self.frozen and left <= 0:
                    return
                self._cond.wait(0.05 if rank in self.frozen else left)


class _Proxy:
    """One rank's connection to the store: logs (time, rank, call, key) and waits on ``holds`` first. ``clone()``
    hands out ``spares``, opened beforehand: opening a connection can hold up the store's server for seconds here
    (where the connecting host's name cannot be looked up), which would read as a store that stopped answering."""

    def __init__(self, inner, rank: int, log: list, holds: _Holds, spares: list, conn: int = 0):
        self._inner, self.rank, self._log, self._holds, self.conn = inner, rank, log, holds, conn
        self._spares = spares

    def clone(self) -> _Proxy:
        inner = self._spares.pop(0) if self._spares else self._inner.clone()
        conn = 3 - len(self._spares) - 1  # 1: the watchdog's own connection, 2: its probe's
        return _Proxy(inner, self.rank, self._log, self._holds, self._spares, conn)

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)
        if name not in _DATA_CALLS:
            return fn

        def call(*args, **kwargs):
            self._holds.wait(self.rank, self.conn)
            self._log.append((time.monotonic(), self.rank, name, args[0] if args else None))
            return fn(*args, **kwargs)

        return call


class _Ranks:
    """A store and ``n`` simulated ranks; ``start(**kwargs)`` starts their watchdogs."""

    def __init__(self, n: int) -> None:
        self.master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        self.log: list = []
        self.holds = _Holds()
        self.stores = [_Proxy(self.master.clone(), r, self.log, self.holds, [self.master.clone(), self.master.clone()])
                       for r in range(n)]
        self.watchdogs: list[Watchdog] = []

    def start(self, *, bounds: dict[int, float] | None = None, **kwargs) -> list[Watchdog]:
        n = len(self.stores)
        for r in range(n):
            bound = (bounds or {}).get(r, kwargs.get("bound"))
            self.watchdogs.append(Watchdog(self.stores[r], r, n, may_exit=False, **{**kwargs, "bound": bound}))
        with ThreadPoolExecutor(4) as pool:  # nearly at once, as the processes of a group do once it exists
            list(pool.map(lambda wd: wd.start(), self.watchdogs))
        return self.watchdogs

    def declared(self, by: int) -> list[int]:
        return [h.rank for h in list(self.watchdogs[by].hung)]

    def close(self) -> None:
        self.holds.thaw()
        for wd in self.watchdogs:
            wd.stop(timeout=2)


@contextlib.contextmanager
def _ranks(n: int) -> Iterator[_Ranks]:
    ranks = _Ranks(n)
    try:
        yield ranks
    finally:
        ranks.close()


def _wait_for(predicate, limit: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if predicate():
            return time.monotonic() - began
        time.sleep(0.02)
    return None


# ---------------------------------------------------------------------- O(N) store calls


def _keys(key) -> list[str]:
    return list(key) if isinstance(key, (list, tuple)) else [key]


def test_heartbeats_make_a_constant_number_of_store_calls_per_rank():
    n, interval = 8, 0.1
    with _ranks(n) as ranks:
        ranks.start(interval=interval, bound=5.0, store_rank=0)
        time.sleep(0.8)  # registration and the first reads are over
        began = time.monotonic()
        time.sleep(2.0)
        ended = time.monotonic()
        window = [c for c in list(ranks.log) if began <= c[0] < ended]
        assert all(ranks.declared(r) == [] for r in range(n))
    cycles = sum(1 for _, rank, call, key in window if call == "set" and key.endswith(f"/beat/{rank}"))
    peer_beats = [[k for k in _keys(key) if "/beat/" in k and not k.endswith(f"/beat/{rank}")]
                  for _, rank, call, key in window]
    reads, keys = sum(1 for b in peer_beats if b), sum(len(b) for b in peer_beats)
    print(f"{n} ranks, {cycles} heartbeats: {len(window)} store calls, {reads} reads of {keys} peer heartbeats")
    assert cycles >= n * 5, f"the heartbeats did not run ({cycles} in {ended - began:.1f} s)"
    # each heartbeat: write this rank's beat, read the news counter, read heartbeats (one call); an all-to-all read
    # would be n - 1 = 7 reads of heartbeats per heartbeat, and 9 calls
    assert reads <= 1.1 * cycles, (reads, cycles)
    assert len(window) <= 3.3 * cycles, (len(window), cycles)
    assert keys <= 2 * cycles, (keys, cycles)  # the lowest rank reads n - 1 beats, each other rank 1


# ---------------------------------------------------------------------- a dead rank is still found


def test_ranks_that_stop_together_are_all_found_within_the_bound():
    # ranks 2, 3 and 4 stop at once (as the ranks of one host): rank 0 reads them all, and declares them all
    bound = 1.5
    with _ranks(6) as ranks:
        ranks.start(interval=0.1, bound=bound, store_rank=None)
        time.sleep(0.6)
        ranks.holds.freeze(2, 3, 4)
        took = _wait_for(lambda: sorted(ranks.declared(0)) == [2, 3, 4], bound + 1.5)
        declared = ranks.declared(0)
        time.sleep(0.3)
        others = [sorted(ranks.declared(r)) for r in (1, 5)]
    assert took is not None, f"rank 0 declared {declared}"
    print(f"3 ranks that stopped together declared {took:.2f} s later (bound {bound} s)")
    assert took < bound + 1.0, took
    assert others == [[2, 3, 4], [2, 3, 4]], others  # the others learned of it (and act on it)


def test_a_stopped_lowest_rank_is_found_by_all_and_the_next_reads_the_others():
    # rank 0 (which reads everyone) and rank 3 stop together: every other rank declares 0 within the bound; rank 1
    # takes over the reading and declares 3 within two bounds
    bound = 1.5
    with _ranks(5) as ranks:
        wds = ranks.start(interval=0.1, bound=bound, store_rank=None)
        time.sleep(0.6)
        ranks.holds.freeze(0, 3)
        took0 = _wait_for(lambda: all(0 in ranks.declared(r) for r in (1, 2, 4)), bound + 1.5)
        took3 = _wait_for(lambda: 3 in ranks.declared(1), 2 * bound + 1.5)
        assert _wait_for(lambda: wds[1].watched_ranks == [2, 4], 1.0) is not None, wds[1].watched_ranks
    assert took0 is not None and took0 < bound + 1.0, took0
    assert took3 is not None and took0 + took3 < 2 * bound + 1.2, (took0, took3)


def test_a_finished_rank_is_not_declared_and_the_next_takes_over_its_reading():
    bound = 1.5
    with _ranks(4) as ranks:
        wds = ranks.start(interval=0.1, bound=bound, store_rank=None)
        time.sleep(0.5)
        wds[0].stop()  # the rank reading everyone finishes
        assert _wait_for(lambda: wds[1].watched_ranks == [2, 3], 1.0) is not None, wds[1].watched_ranks
        ranks.holds.freeze(3)
        took = _wait_for(lambda: 3 in ranks.declared(1), bound + 1.5)
        assert all(0 not in ranks.declared(r) for r in range(4))
    assert took is not None and took < bound + 1.0, took


# ---------------------------------------------------------------------- a slow store is no hung peer


def test_a_store_slow_for_every_rank_is_not_taken_for_a_hung_peer():
    # every call waits 3 s (twice the bound), and rank 1's heartbeat lands 0.5 s after the others' calls return:
    # rank 0 saw rank 1's beat stand still for 3.5 s, but only 0.5 s of it while the store answered
    bound = 1.5
    with _ranks(2) as ranks:
        ranks.start(interval=0.1, bound=bound, store_rank=None)
        time.sleep(0.5)
        now = time.monotonic()
        ranks.holds.until.update({0: now + 3.0, 1: now + 3.5})
        time.sleep(3.5 + bound)
        assert ranks.declared(0) == [] and ranks.declared(1) == []


def test_one_stuck_call_on_the_store_is_not_taken_for_a_hung_store_host():
    # rank 1's own connection stops answering for 3 x the bound (a lost packet, a stuck connection), while the store
    # answers a probe on a second connection: rank 0, which serves the store, is not declared
    bound = 1.0
    with _ranks(2) as ranks:
        ranks.start(interval=0.1, bound=bound, bounds={0: 30.0}, store_rank=0)  # rank 0 sees rank 1 go silent
        time.sleep(0.5)
        ranks.holds.until[(1, 1)] = time.monotonic() + 3 * bound
        time.sleep(3 * bound + 0.5)
        assert ranks.declared(1) == []
        assert any(call == "check" for _, rank, call, _ in ranks.log if rank == 1), "no probe was made"


# ---------------------------------------------------------------------- killing and shutting down


def _silent_peer(ranks: _Ranks, info: dict, endpoints: list | None = None) -> Watchdog:
    """Rank 0 of 2 watching a rank 1 that registered ``info`` (and ``endpoints``) and never beats."""
    gen = 1  # the first watchdog on this store
    ranks.master.set(f"clapping/liveness/{gen}/info/1", json.dumps(info))
    if endpoints is not None:
        ranks.master.set(f"clapping/liveness/{gen}/ep/1", json.dumps(endpoints))
    wd = Watchdog(ranks.stores[0], 0, 2, interval=0.1, bound=0.5, store_rank=None, may_exit=False)
    ranks.watchdogs.append(wd)
    wd.start()
    assert _wait_for(lambda: wd.hung, 10.0) is not None, "the silent rank was not declared"
    acting = [t for t in threading.enumerate() if t.name == "clapping-liveness-act-rank0"]
    for thread in acting:  # the action is taken
        thread.join(5)
    return wd


@pytest.fixture
def sleeper():
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_pid_whose_start_time_differs_from_the_published_one_is_not_killed(sleeper, capfd):
    mine = actions.identity(socket.gethostname())
    info = dict(mine, pid=sleeper.pid, start=actions.start_time(sleeper.pid) + 1)  # the pid, another process
    with _ranks(2) as ranks:
        wd = _silent_peer(ranks, info)
        assert [(h.rank, h.action) for h in wd.hung] == [(1, "none")], wd.hung
    assert sleeper.poll() is None, "an unrelated process was killed"
    err = capfd.readouterr().err
    assert "did not kill stage 1 (rank 1)" in err and "start time" in err and "not the" in err, err


def test_the_published_process_is_killed_through_its_pidfd(sleeper):
    # the same, with the start time right: the kill goes through (the check above is what stopped it)
    info = dict(actions.identity(socket.gethostname()), pid=sleeper.pid, start=actions.start_time(sleeper.pid))
    with _ranks(2) as ranks:
        wd = _silent_peer(ranks, info)
        assert [(h.rank, h.action) for h in wd.hung] == [(1, "killed")], wd.hung
    assert sleeper.wait(5) == -9


def test_a_peer_without_a_start_time_is_not_killed(sleeper):
    verdict = actions.verify(dict(actions.identity(socket.gethostname()), pid=sleeper.pid, start=None),
                             actions.identity(socket.gethostname()))
    assert verdict.pidfd is None and "no start time" in verdict.why, verdict
    assert sleeper.poll() is None


@pytest.fixture
def loopback_pair():
    """A TCP connection over 127.0.0.1 held by this process: (client socket, server socket)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def _still_connected(client: socket.socket, server: socket.socket) -> bool:
    try:
        server.sendall(b"ping")
        client.settimeout(2)
        return client.recv(4) == b"ping"
    except OSError:
        return False


@pytest.mark.parametrize("proof", ["other boot", "other network namespace", "no namespace"])
def test_loopback_endpoints_published_from_another_host_are_never_matched(loopback_pair, proof):
    # the peer says it is on a host of this name, but its boot id or network namespace differs (or is unknown): its
    # 127.0.0.1:port is another socket than the one this process is connected to, and that connection survives
    client, server = loopback_pair
    mine = actions.identity(socket.gethostname())
    changed = {"other boot": {"boot": "another-boot-id"},  # another machine, or this one rebooted
               "other network namespace": {"netns": "net:[1]", "pidns": "pid:[1]"},  # a container on this host
               "no namespace": {"netns": None, "pidns": None}}[proof]  # a peer without /proc
    info = dict(mine, pid=2**22 + 12345, start=1, **changed)
    with _ranks(2) as ranks:
        wd = _silent_peer(ranks, info, endpoints=[list(server.getsockname())])
        assert [(h.rank, h.action) for h in wd.hung] == [(1, "none")], wd.hung
    assert _still_connected(client, server)


def test_loopback_endpoints_of_a_peer_in_this_network_namespace_are_shut_down(loopback_pair):
    # proven the same boot and network namespace (another host name changes nothing): the connection is shut down
    client, server = loopback_pair
    info = dict(actions.identity("another-name"), pid=2**22 + 12345, start=1)
    with _ranks(2) as ranks:
        wd = _silent_peer(ranks, info, endpoints=[list(server.getsockname())])
        assert [(h.rank, h.action) for h in wd.hung] == [(1, "connections closed")], wd.hung
    assert not _still_connected(client, server)


# ---------------------------------------------------------------------- the store's host


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),  # python train.py (Lightning starts the others), SLURM, tcp://: rank 0 serves the store
        ({"MASTER_ADDR": "node7", "MASTER_PORT": "29500"}, 0),
        ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True"}, None),  # torchrun: its agent
        ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "False"}, 0),
        ({"TORCHELASTIC_RUN_ID": "job"}, None),  # an agent that does not say: nobody is blamed for the store
    ],
)
def test_the_store_host_comes_from_the_launchers_variables(monkeypatch, env, expected):
    assert store_rank_from_env(env) == expected
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert Watchdog(object(), 1, 3, interval=0.5, bound=3.0).store_rank == expected


class _OtherPort:
    """A store whose server listens on a port this process does not hold."""

    def __init__(self, inner, port: int) -> None:
        self._inner, self.port = inner, port

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_rank_0_that_does_not_hold_the_stores_socket_is_not_its_host():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    for store, expected in ((master, 0), (_OtherPort(master, free), None)):
        wd = Watchdog(store, 0, 2, interval=0.1, bound=1.0, store_rank=0).start()
        try:
            assert wd.store_rank == expected
        finally:
            wd.stop()
