"""One epoch of the lazy loader: where it stands, what it handed out lately, and its checkpoint entry.

Lightning asks for ``batch_info(batch_idx)`` of a batch it fetched a little earlier and checkpoints at the batch it
has consumed, which may be one behind the latest yielded (prefetching). So an epoch keeps a small window of per-batch
infos and of *snapshots*: the loader's state right after each of the latest yields. Used by
:mod:`lightning_clapping.data` only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

# How many per-batch infos ``batch_info`` can still answer for (Lightning looks at most one batch back).
INFO_WINDOW = 16
# How many post-yield snapshots are kept for ``state_dict`` (Lightning prefetches at most one batch).
SNAPSHOT_WINDOW = 4


def is_plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` survives ``torch.load(weights_only=True)`` (tensors, numbers, strings, list/tuple/dict)."""
    if depth > 32:
        return False
    if obj is None or type(obj) in (bool, int, float, str, Tensor):
        return True
    if type(obj) in (list, tuple):
        return all(is_plain(x, depth + 1) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return all(type(k) in (str, int) and is_plain(v, depth + 1) for k, v in obj.items())
    return False


@dataclass(eq=False)
class Snapshot:
    """Loader state right after ``pos`` batches of an epoch were yielded (what a checkpoint at that point needs)."""

    pos: int
    step: int
    fresh_total: int
    distinct: int
    epoch_fresh: int
    batch: Any
    ids: Optional[Tensor]
    wrapped_state: Any


class Epoch:
    """Position and recent history of one epoch (one pass of the wrapped loader by fresh draws)."""

    def __init__(self, index: int, start: int, num_batches: Optional[int], total: Optional[int]) -> None:
        self.index = index
        self.start = start  # global step of the epoch's first batch
        self.num_batches = num_batches
        self.total = total  # steps this epoch takes (None when the source has no length)
        self.started = False  # first next() happened
        self.finished = False
        self.pos = 0  # batches yielded in this epoch
        self.fresh = 0  # fresh draws in this epoch
        self.batch: Any = None
        self.has_batch = False
        self.ids: Optional[Tensor] = None
        self.wrapped_state: Any = None
        self.src: Any = None  # the source's per-epoch state (MapEpoch / IterEpoch)
        self.restored: Optional[dict] = None  # loaded state whose epoch entry is still to apply on the first next()
        # Lightning's batch_idx minus our position. 0 except after a resume at an epoch boundary of a source without
        # length, where Lightning keeps counting batch_idx from the previous epoch.
        self.offset = 0
        self.snapshots: "OrderedDict[int, Snapshot]" = OrderedDict()
        self.infos: "OrderedDict[int, Any]" = OrderedDict()

    @property
    def complete(self) -> bool:
        return self.finished or (self.total is not None and self.pos >= self.total)

    def take(self, batch: Any, ids: Optional[Tensor], wrapped_state: Any) -> None:
        """A fresh batch becomes the current one; older snapshots may not keep earlier batches alive."""
        self.fresh += 1
        self.batch, self.ids, self.has_batch, self.wrapped_state = batch, ids, True, wrapped_state
        for snap in self.snapshots.values():
            snap.batch = None

    def remember_info(self, info: Any) -> None:
        """Keep the info of the batch at the current position under Lightning's batch_idx for it."""
        self.infos[self.pos + self.offset] = info
        while len(self.infos) > INFO_WINDOW:
            self.infos.popitem(last=False)

    def remember(self, step: int, fresh_total: int, distinct: int) -> None:
        """Snapshot the state after the batches yielded so far (the loader's counters given)."""
        self.snapshots[self.pos] = Snapshot(
            self.pos, step, fresh_total, distinct, self.fresh, self.batch if self.has_batch else None, self.ids,
            self.wrapped_state,
        )
        while len(self.snapshots) > SNAPSHOT_WINDOW:
            self.snapshots.popitem(last=False)

    def snapshot_for(self, ready: Optional[int]) -> Snapshot:
        """The snapshot after the batches the trainer has taken (``ready``), else after the latest one yielded."""
        snap = self.snapshots.get(ready - self.offset) if ready is not None else None
        return snap if snap is not None else next(reversed(self.snapshots.values()))

    def entry(self, snap: Snapshot) -> dict:
        """The checkpoint entry that continues this epoch right after ``snap``."""
        has_batch = snap.batch is not None and is_plain(snap.batch)
        return {
            "index": self.index,
            "start": self.start,
            "num_batches": self.num_batches,
            "total": self.total,
            "pos": snap.pos,
            "fresh": snap.epoch_fresh,
            "ids": snap.ids,
            "has_batch": has_batch,
            "batch": snap.batch if has_batch else None,
            "order_rng": self.src.order_rng,
            "fingerprint": self.src.fingerprint,
            "drew_base": self.src.drew_base,
            "wrapped_state": snap.wrapped_state,
        }

    @classmethod
    def from_entry(cls, entry: dict) -> "Epoch":
        """The epoch an :meth:`entry` describes, positioned after its snapshot (the batch comes back on resume)."""
        ep = cls(int(entry["index"]), int(entry["start"]), entry["num_batches"], entry["total"])
        ep.pos, ep.fresh = int(entry["pos"]), int(entry["fresh"])
        ep.ids, ep.wrapped_state = entry["ids"], entry.get("wrapped_state")
        return ep
