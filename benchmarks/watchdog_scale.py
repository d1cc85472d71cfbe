"""The liveness watchdog at 64 ranks on one TCPStore: store calls per second before and after, and no false alarm.

    python benchmarks/watchdog_scale.py [--minutes 10] [--quick] [--ranks 64] [--bound 5] [--out benchmarks/results]

The ranks are threads of this process, each with its own connections to one TCPStore served from this process (no
training, no process group): what is measured is the heartbeat and read loop alone. Two schemes run side by side
in one run, on the same store, with the same ranks, interval and bound:

* ``before``: every rank reads every other rank's counter each interval (how the watchdog worked until it read
  O(N)): a replay of that loop's store calls (add 1 to its own counter, add 0 to each other rank's, read the store
  host's endpoints) with its rule (a counter that has not moved for ``bound`` seconds at the end of a cycle);
* ``after``: :class:`lightning_clapping.comm.liveness.Watchdog` itself, for ``--minutes``: the lowest rank reads
  every beat in one ``multi_get``, the others read its beat only. A declaration would be a false alarm here (every
  rank is alive); the longest silence any rank measured is the margin kept to the bound.

Then two detection checks with fresh watchdogs: the store calls of 8 consecutive ranks are held (as when the host
of 8 ranks stops), and the time until each is declared is taken; and the same for rank 0 (which reads everyone)
together with one other rank. Store calls are counted by a proxy on each connection; CPU is this process's (every
thread, and the store server's). Every connection is opened before anything runs (see :func:`connections`). Saves ``watchdog_scale.json`` (``--quick``: ``watchdog_scale_quick.json``, a few
seconds with 16 ranks and a 1 s bound, for the smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

_DATA_CALLS = frozenset({"add", "set", "get", "check", "compare_set", "multi_get", "multi_set", "delete_key", "wait"})


class Holds:
    """Ranks whose store calls are held (a stopped rank) until :meth:`thaw`."""

    def __init__(self) -> None:
        self.frozen: set[int] = set()
        self._cond = threading.Condition()

    def freeze(self, *ranks: int) -> None:
        with self._cond:
            self.frozen.update(ranks)

    def thaw(self) -> None:
        with self._cond:
            self.frozen.clear()
            self._cond.notify_all()

    def wait(self, rank: int) -> None:
        if rank in self.frozen:
            with self._cond:
                while rank in self.frozen:
                    self._cond.wait(0.5)


class Counted:
    """A store connection of one rank that counts its calls (and the heartbeat keys they read); ``clone()`` hands
    out the connections in ``spares``, opened beforehand."""

    def __init__(self, inner, rank: int, holds: Holds, registry: list, spares: list | None = None) -> None:
        self._inner, self.rank, self._holds, self._registry = inner, rank, holds, registry
        self._spares = list(spares or [])
        self.calls = 0
        self.beat_keys = 0  # keys of other ranks' heartbeats read
        registry.append(self)

    def clone(self) -> Counted:
        inner = self._spares.pop(0) if self._spares else self._inner.clone()
        return Counted(inner, self.rank, self._holds, self._registry, self._spares)

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)
        if name not in _DATA_CALLS:
            return fn

        def call(*args, **kwargs):
            self._holds.wait(self.rank)
            self.calls += 1
            keys = args[0] if args and isinstance(args[0], list) else args[:1]
            self.beat_keys += sum(1 for k in keys if isinstance(k, str) and "/beat/" in k
                                  and not k.endswith(f"/beat/{self.rank}"))
            return fn(*args, **kwargs)

        return call


def _totals(registry: list) -> tuple[int, int]:
    return sum(c.calls for c in registry), sum(c.beat_keys for c in registry)


def _window(registry: list, seconds: float) -> dict:
    """Calls, heartbeat keys read and CPU over ``seconds`` from now."""
    calls0, keys0 = _totals(registry)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    calls1, keys1 = _totals(registry)
    wall = time.monotonic() - wall0
    return {"seconds": round(wall, 2), "store_calls_per_s": round((calls1 - calls0) / wall, 1),
            "heartbeat_keys_read_per_s": round((keys1 - keys0) / wall, 1),
            "cpu_cores": round((time.process_time() - cpu0) / wall, 3)}


def connections(master, ranks: int) -> list[list]:
    """Three connections to the store per rank, opened before anything runs: opening one can hold up the store's
    server for seconds (where the name of the connecting host cannot be looked up: 5 s on the machine measured),
    which every rank would see as a store that stopped answering."""
    return [[master.clone() for _ in range(3)] for _ in range(ranks)]


def before(conns: list[list], interval: float, bound: float, seconds: float) -> dict:
    """The all-to-all loop's store calls, replayed by one thread per rank, and what its rule would have declared."""
    prefix, holds, registry, ranks = "clapping/before", Holds(), [], len(conns)
    stores = [Counted(conns[r][0], r, holds, registry) for r in range(ranks)]
    stop = threading.Event()
    worst = {"silence": 0.0, "declared": set(), "cycle_s": []}

    def loop(rank: int) -> None:
        store, key = stores[rank], f"{prefix}/beat/{rank}"
        store.add(key, 1)
        store.set(f"{prefix}/info/{rank}", "{}")
        seen = {r: (None, time.monotonic()) for r in range(ranks) if r != rank}
        grace = previous = time.monotonic()
        while not stop.is_set():
            began = time.monotonic()
            if began - previous > bound / 2:  # its rule for a thread that did not run
                grace = began
            previous = began
            store.add(key, 1)
            for peer in seen:
                value = int(store.add(f"{prefix}/beat/{peer}", 0))
                if value != seen[peer][0]:
                    seen[peer] = (value, time.monotonic())
                if peer == 0:  # it read the store host's endpoints every cycle
                    ep = f"{prefix}/ep/0"
                    if store.check([ep]):
                        store.get(ep)
            now = time.monotonic()
            worst["cycle_s"].append(now - began)
            for peer, (_, changed) in seen.items():
                silent = now - max(changed, grace)
                worst["silence"] = max(worst["silence"], silent)
                if silent > bound:
                    worst["declared"].add((rank, peer))
            stop.wait(max(0.0, interval - (time.monotonic() - began)))

    stores[0].set(f"{prefix}/ep/0", "[]")
    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    time.sleep(min(2.0, seconds / 4))  # every rank has started
    measured = _window(registry, seconds)
    stop.set()
    for t in threads:
        t.join(10)
    cycles = sorted(worst["cycle_s"])
    measured.update(
        store_calls_per_rank_per_interval=round(measured["store_calls_per_s"] * interval / ranks, 2),
        cycle_s_median=round(cycles[len(cycles) // 2], 4), cycle_s_max=round(cycles[-1], 4),
        longest_silence_s=round(worst["silence"], 3), false_declarations=len(worst["declared"]))
    return measured


def _watchdogs(conns: list[list], interval: float, bound: float) -> tuple[list, Holds, list]:
    from lightning_clapping.comm.liveness import Watchdog

    holds, registry, ranks = Holds(), [], len(conns)
    wds = [Watchdog(Counted(conns[r][0], r, holds, registry, spares=conns[r][1:]), r, ranks, interval=interval,
                    bound=bound, store_rank=0, may_exit=False) for r in range(ranks)]
    # nearly at once, as the processes of a group do once it exists (4 at a time: many connects to a TCPStore at
    # the same instant from one process sometimes wait seconds, which would make the last ones look never started)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda wd: wd.start(), wds))
    return wds, holds, registry


def _stop(wds: list, holds: Holds) -> None:
    holds.thaw()
    for wd in wds:
        wd.stop(timeout=5)


def after(conns: list[list], interval: float, bound: float, seconds: float) -> dict:
    ranks = len(conns)
    wds, holds, registry = _watchdogs(conns, interval, bound)
    try:
        time.sleep(min(2.0, seconds / 4))  # registration and the first reads are over
        measured = _window(registry, seconds)
        measured.update(
            store_calls_per_rank_per_interval=round(measured["store_calls_per_s"] * interval / ranks, 2),
            longest_silence_s=round(max(wd.longest_silence for wd in wds), 3),
            false_declarations=sum(len(wd.hung) for wd in wds))
    finally:
        _stop(wds, holds)
    return measured


def _until(predicate, limit: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if predicate():
            return round(time.monotonic() - began, 2)
        time.sleep(0.05)
    return None


def detection(conns: list[list], interval: float, bound: float) -> dict:
    """Seconds from holding ranks' store calls until they are declared, for a host of 8 and for rank 0 with one."""
    out, ranks = {}, len(conns)
    host = list(range(ranks // 2 - 4, ranks // 2 + 4))
    other = (3 * ranks) // 4
    for name, frozen in (("8 consecutive ranks", host), (f"rank 0 and rank {other}", [0, other])):
        wds, holds, _ = _watchdogs(conns, interval, bound)
        try:
            time.sleep(3 * interval)
            holds.freeze(*frozen)
            declared = {r: set() for r in range(ranks)}  # by rank -> the ranks it declared

            def seen() -> dict:
                for wd in wds:
                    declared[wd.rank].update(h.rank for h in list(wd.hung))
                return declared

            if 0 in frozen:
                alive = [r for r in range(ranks) if r not in frozen]
                first = _until(lambda: all(0 in seen()[r] for r in alive), 3 * bound)
                rest = _until(lambda: other in seen()[1], 3 * bound)
                out[name] = {"rank 0 declared by every other rank after_s": first,
                             f"rank {other} declared by rank 1 (the next reader) after_s": None if first is None or
                             rest is None else round(first + rest, 2)}
            else:
                out[name] = {"all declared by rank 0 after_s": _until(lambda: set(frozen) <= seen()[0], 3 * bound)}
        finally:
            _stop(wds, holds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the watchdogs run (after)")
    ap.add_argument("--before-seconds", type=float, default=60.0, help="how long the all-to-all loop runs")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--bound", type=float, default=5.0, help="seconds without a heartbeat for a declaration")
    ap.add_argument("--quick", action="store_true", help="16 ranks, a 1 s bound, seconds in all (smoke test)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.bound, args.minutes, args.before_seconds = 16, 1.0, 3 / 60, 2.0
    interval = min(1.0, args.bound / 8)  # as the strategy sets it
    import torch.distributed as dist

    from _machine import describe

    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=60))
    settings = {"ranks": args.ranks, "bound_s": args.bound, "interval_s": interval, "minutes": args.minutes,
                "before_seconds": args.before_seconds, "quick": args.quick}
    print(f"{args.ranks} ranks, bound {args.bound:g} s, interval {interval:g} s", flush=True)
    result = {"machine": describe(), "settings": settings}
    began = time.monotonic()
    conns = connections(master, args.ranks)
    print(f"{3 * args.ranks} connections opened in {time.monotonic() - began:.1f} s", flush=True)
    result["before"] = before(conns, interval, args.bound, args.before_seconds)
    print("before (all-to-all):", result["before"], flush=True)
    result["after"] = after(conns, interval, args.bound, args.minutes * 60)
    print("after (this package):", result["after"], flush=True)
    with contextlib.redirect_stderr(io.StringIO()):  # every rank says what it did about each declaration
        result["detection"] = detection(conns, interval, args.bound)
    print("detection:", result["detection"], flush=True)
    b, a = result["before"], result["after"]
    result["store_calls_ratio_before_to_after"] = round(b["store_calls_per_s"] / a["store_calls_per_s"], 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("watchdog_scale_quick.json" if args.quick else "watchdog_scale.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"store calls per second: {b['store_calls_per_s']:.0f} before, {a['store_calls_per_s']:.0f} after "
          f"({result['store_calls_ratio_before_to_after']}x); false declarations after: {a['false_declarations']}; "
          f"saved {path}")


if __name__ == "__main__":
    main()
