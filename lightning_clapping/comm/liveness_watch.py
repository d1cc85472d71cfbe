"""Who reads whose heartbeat, and when a peer counts as hung: a tree of depth one over the ranks.

The *watcher* is the lowest rank that has neither finished nor been declared hung. It reads every other unfinished
rank's heartbeat, all in one store call (``multi_get``), and every other rank reads the watcher's only. That is one
read per rank and interval, O(N) store calls in all (an all-to-all read is N - 1 per rank). Since the watcher keeps
a timer for every rank, any number of ranks that stop at once (all the ranks of one host) are found within the
bound. The watcher itself is read by all the others, each of which declares it on its own (the first declaration is
published, the others act alike); the next lowest rank then takes over, reads everyone and starts their timers, so a
rank that stopped together with the watcher is found within two bounds. A rank that finishes writes ``"done"``: its
readers drop it, and when it was the watcher the next rank takes over at once.

A peer is hung when two reads of its beat number ``bound`` seconds apart show the same number, counted from the
*end* of the read that first saw it to the *start* of the latest read, so the time a slow store call takes is never
counted as the peer's silence; the watchdog moves ``grace`` forward (timers restart) when its own heartbeat thread
did not run for a while, which includes a store call that kept it waiting (the store was slow for every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ABSENT = -1  # the beat number of a rank whose heartbeat key does not exist yet


@dataclass
class Peer:
    rank: int
    stage: int
    done: bool = False
    declared: bool = False
    info: dict[str, Any] | None = None  # identity (host, pid, start, boot, namespaces); cached for the store's host
    endpoints: list[list[Any]] | None = None  # cached only for the store's host (read while the store answers)


@dataclass
class Watch:
    """A peer whose heartbeat this rank reads: its last beat number and when that was first seen."""

    value: int | None = None  # None: not read yet; ABSENT: its key does not exist yet
    changed_at: float = 0.0  # this rank's monotonic time at the end of the read that first saw ``value``


class Watching:
    """What one rank reads over ``peers`` (every rank but this one), and its timers."""

    def __init__(self, rank: int, world_size: int, bound: float, peers: dict[int, Peer]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.bound = bound
        self.peers = peers
        self.watches: dict[int, Watch] = {}
        self.beats = 0
        self.longest = 0.0  # the longest silence measured so far (of a peer that then beat again, or was declared)

    def heartbeat(self) -> str:
        """This rank's next beat number, as text."""
        self.beats += 1
        return str(self.beats)

    def targets(self) -> list[int]:
        """The peers to read now: every unfinished one when this rank is the watcher, else the watcher."""
        open_ = [r for r in range(self.world_size)
                 if r == self.rank or not (self.peers[r].done or self.peers[r].declared)]
        return [r for r in open_ if r != self.rank] if open_[0] == self.rank else [open_[0]]

    def step(self, read: Callable[[Sequence[int]], dict[int, str | None]], grace: float,
             declare: Callable[[Peer, float], bool]) -> None:
        """``read(ranks)`` their beats (text; None when absent); ``declare(peer, silent)`` those that have not moved
        for the bound (``declare`` returns False when the watchdog stops). ``grace``: silences count from there at
        the earliest."""
        for _ in range(self.world_size):  # once more at once when the watcher read here has just finished
            targets = self.targets()
            self.watches = {r: self.watches.get(r, Watch()) for r in targets}
            if not targets:
                return
            began = time.monotonic()
            beats = read(targets)
            ended = time.monotonic()
            watcher_done = False
            for rank in targets:
                raw, watch = beats.get(rank), self.watches[rank]
                if raw == "done":
                    self.peers[rank].done = True
                    watcher_done = len(targets) == 1
                    continue
                value = ABSENT if raw is None else int(raw)
                if watch.value is None or value != watch.value:
                    watch.value, watch.changed_at = value, ended
                    continue
                silent = began - max(watch.changed_at, grace)
                self.longest = max(self.longest, silent)
                if silent > self.bound and not declare(self.peers[rank], silent):
                    return
            if not watcher_done:
                return


__all__ = ["ABSENT", "Peer", "Watch", "Watching"]
