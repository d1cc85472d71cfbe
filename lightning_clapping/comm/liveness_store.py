"""The liveness watchdog's side of the key-value store: its own connections, timed calls, and where each key lies.

The store is served from rank 0's process (a TCPStore, for ``env://`` and ``tcp://``), or from the elastic agent
under ``torchrun``, where no rank serves it: :func:`store_rank_from_env` reads which from the launcher's variables, as
torch's own ``env://`` rendezvous decides it. When the serving process is stopped, store calls block without any
bound (the store's own timeout does not cover a server that accepted the connection and then stopped answering;
measured on torch 2.13). So the watchdog talks to the store over a connection of its own (``store.clone()``), one
call at a time, and notes when the call in progress began (:attr:`WatchdogStore.inflight_since`), for its store
guard to see; a second connection carries a probe (:meth:`WatchdogStore.probe`), which tells a store that no longer
answers from one call that is slow or stuck. A call that keeps the heartbeat thread waiting for ``bound / 2`` or more
means the store was slow for every rank: the watchdog restarts its timers (as after any gap in its own threads)
instead of blaming a peer whose heartbeat could not land either.

Keys (the n-th watchdog started on a store uses ``clapping/liveness/{n}/...``; ``n`` from ``starts/{rank}``):
``info/{rank}`` (JSON: host, pid, start time, boot id, namespaces, stage), ``beat/{rank}`` (the beat number;
``"done"`` once it stopped), ``ep/{rank}`` (the local endpoints of its TCP connections), ``decl`` (how many
declarations were made) and ``decl/{i}`` (JSON: the hung rank, who declared it, for how long it was silent, the
reason; ``declared/{rank}`` names who published it, so that a rank declared by many is published once), and
``news`` (a counter bumped after each declaration and each time the store's host republishes its endpoints;
``DONE`` is added once the store's host has finished).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from lightning_clapping.comm.failures import failure_key

PREFIX = "clapping/liveness"
DONE = 1 << 40  # added to the news counter by the store's host when its watchdog stops: the run is over
STORE_OP_LIMIT = 2.0  # seconds a side task (reason, endpoints) waits for the store before going on without it


def store_rank_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank whose process serves the process group's store, from the launcher's variables: ``None`` under an
    elastic agent that serves it (``TORCHELASTIC_USE_AGENT_STORE=True``, or ``TORCHELASTIC_RUN_ID`` set by an agent
    that does not say), else 0 (``python train.py``, SLURM, ``MASTER_ADDR``/``MASTER_PORT``, ``tcp://``)."""
    env = os.environ if environ is None else environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE")
    if agent_store is not None:
        return None if agent_store.strip().lower() in ("true", "1") else 0
    return None if env.get("TORCHELASTIC_RUN_ID") else 0


class StoreGone(RuntimeError):
    """A call on the watchdog's store connection failed: the store's process ended, or the connection was closed."""


class WatchdogStore:
    """The watchdog's connections to ``store`` (``probe``: also a second one for :meth:`probe`)."""

    def __init__(self, store: Any, rank: int, bound: float, probe: bool) -> None:
        self.rank = rank
        self.bound = bound
        self.port = store_port(store)
        self.gen = int(store.add(f"{PREFIX}/starts/{rank}", 1))
        self._conn = own_connection(store, bound)
        self._probe_conn = own_connection(store, bound) if probe else None
        self._lock = threading.Lock()  # one call at a time on the connection
        self._probe_lock = threading.Lock()
        #: when the call in progress began (None: none is)
        self.inflight_since: float | None = None
        self._probe_since: float | None = None
        self._decls_read: set[int] = set()

    def key(self, kind: str, rank: int | None = None) -> str:
        return f"{PREFIX}/{self.gen}/{kind}" + ("" if rank is None else f"/{rank}")

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(connection)``; a failure raises :class:`StoreGone`."""
        with self._lock:
            self.inflight_since = time.monotonic()
            try:
                return fn(self._conn)
            except Exception as err:
                raise StoreGone(f"the process group's store failed: {type(err).__name__}: {err}") from err
            finally:
                self.inflight_since = None

    def bounded(self, fn: Callable[[Any], Any], limit: float = STORE_OP_LIMIT) -> Any:
        """:meth:`call` from a side thread, given up (None) after ``limit`` s: the store may be what hangs."""
        box: list[Any] = []

        def run() -> None:
            with contextlib.suppress(Exception):
                box.append(self.call(fn))

        thread = threading.Thread(target=run, name=f"clapping-liveness-store-rank{self.rank}", daemon=True)
        thread.start()
        thread.join(limit)
        return box[0] if box else None

    def read(self, kind: str, rank: int | None = None) -> str | None:
        """The text under a key, None when it does not exist."""
        key = self.key(kind, rank)
        return self.call(lambda s: get_text(s, key))

    def read_json_bounded(self, kind: str, rank: int) -> Any:
        key = self.key(kind, rank)
        raw = self.bounded(lambda s: get_text(s, key))
        return None if raw is None else json.loads(raw)

    def publish_declaration(self, conn: Any, rank: int, silent: float, reason: str) -> None:
        """Leave ``reason`` as ``rank``'s failure reason (if it has none) and publish the declaration (if first)."""
        conn.compare_set(failure_key(rank), "", reason)
        if text(conn.compare_set(self.key("declared", rank), "", str(self.rank))) != str(self.rank):
            return  # another rank declared it first (a rank read by all is declared by all)
        index = int(conn.add(self.key("decl"), 1))
        conn.set(self.key("decl", index), json.dumps({"rank": rank, "by": self.rank, "silent": silent,
                                                      "reason": reason}))
        conn.add(self.key("news"), 1)

    def new_declarations(self) -> list[tuple[int, int, float, str]]:
        """The declarations not read yet: (hung rank, declared by, seconds silent, reason)."""
        count = int(self.call(lambda s: s.add(self.key("decl"), 0)))
        found = []
        for index in range(1, count + 1):
            raw = None if index in self._decls_read else self.read("decl", index)
            if raw is None:  # read already, or allocated and not written yet (then read at the next news)
                continue
            self._decls_read.add(index)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                decl = json.loads(raw)
                found.append((int(decl["rank"]), int(decl["by"]), float(decl["silent"]), str(decl["reason"])))
        return found

    def probe(self, spawn: Callable[[Callable[[], None], str], None]) -> float:
        """When the probe in progress started, starting one (through ``spawn(target, name)``) if none is."""
        with self._probe_lock:
            if self._probe_since is None:
                self._probe_since = time.monotonic()
                spawn(self._probe_run, "probe")
            return self._probe_since

    def _probe_run(self) -> None:
        with contextlib.suppress(Exception):
            (self._probe_conn or self._conn).check([self.key("beat", self.rank)])
        with self._probe_lock:
            self._probe_since = None


def own_connection(store: Any, bound: float) -> Any:
    """A connection to ``store`` for the watchdog alone, with a short timeout (the store itself when it has none)."""
    own = store
    with contextlib.suppress(AttributeError, RuntimeError, NotImplementedError):
        own = store.clone()
    with contextlib.suppress(AttributeError, RuntimeError):
        own.set_timeout(timedelta(seconds=max(bound, 1.0)))
    return own


def store_port(store: Any) -> int | None:
    """The TCP port of the server under ``store`` (through prefix stores), else the launcher's MASTER_PORT."""
    for _ in range(8):
        port = getattr(store, "port", None)
        if isinstance(port, int) and port > 0:
            return port
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    with contextlib.suppress(KeyError, ValueError):
        return int(os.environ["MASTER_PORT"])
    return None


def text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def get_text(store: Any, key: str) -> str | None:
    """``store.get(key)`` as text, None when absent (checked first: a get on a missing key would wait for it)."""
    return text(store.get(key)) if store.check([key]) else None


__all__ = ["DONE", "PREFIX", "StoreGone", "WatchdogStore", "get_text", "own_connection", "store_port",
           "store_rank_from_env", "text"]
