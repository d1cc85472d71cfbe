"""Where the lazy loader's fresh batches come from, and how a source gets back to a saved position.

Two sources, one interface (used by :mod:`lightning_clapping.data` only):

* :class:`MapSource`: a torch ``DataLoader`` over a map-style dataset with a sized index sampler. The lazy loader draws
  the epoch's index order itself and feeds it to an inner DataLoader, so every batch's dataset indices are known and a
  checkpoint can redraw the order from the saved RNG states.
* :class:`IterSource`: any other iterable (a stream, a list of batches, a generator). Batches are pulled one at a
  time, only on fresh decisions; a resume goes through the iterable's own ``state_dict``/``load_state_dict`` or
  re-reads it up to the saved position.

Per source: ``num_batches()``, ``begin(epoch)`` (the per-epoch state of a new pass), ``draw(src, epoch_fresh,
samples_seen)`` (the next fresh batch, its sample ids, its sample count and the wrapped iterable's state),
``restore(epoch, entry)`` (at ``load_state_dict``), ``resume(src, epoch, epoch_fresh, ids, wrapped_state,
need_batch)`` (at the first step after a resume: the per-epoch state and, when asked and possible, the reused batch),
``close(src)``, and the RNG hooks ``capture_rng``/``apply_generator_states``/``uses_global_rng``.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

# What ``draw`` returns: the batch, its sample ids (or None), its sample count, the wrapped iterable's state (or None).
Drawn = tuple[Any, Optional[Tensor], int, Any]


def sized_len(obj: object) -> Optional[int]:
    """``len(obj)``, or None when it has no length."""
    try:
        return int(len(obj))  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def make_source(source: Iterable, num_replicas: int, replica_rank: int, seed: int) -> "MapSource | IterSource":
    """The source for what was wrapped: map-style when it is a DataLoader over a map dataset with a sized sampler."""
    if (
        isinstance(source, DataLoader)
        and not isinstance(source.dataset, IterableDataset)
        and sized_len(source.batch_sampler if source.batch_sampler is not None else source.sampler) is not None
    ):
        return MapSource(source, num_replicas, replica_rank, seed)
    if num_replicas > 1:
        raise ValueError(
            "num_replicas > 1 can only shard a torch DataLoader over a map-style dataset; shard an iterable "
            "source yourself (each replica reading its own stream) and keep num_replicas=1."
        )
    return IterSource(source)


# --------------------------------------------------------------------------------------------------------------------
# Map-style DataLoader
# --------------------------------------------------------------------------------------------------------------------


def _fingerprint(order: list) -> int:
    flat = array("q")
    sizes = array("q")
    for item in order:
        if isinstance(item, (list, tuple)):
            flat.extend(int(i) for i in item)
            sizes.append(len(item))
        else:
            flat.append(int(item))
            sizes.append(-1)
    return (zlib.crc32(sizes.tobytes()) << 32) | zlib.crc32(flat.tobytes(), len(order))


def _set_sampler_epoch(loader: DataLoader, epoch: int) -> None:
    """What Lightning does for a train DataLoader it owns: call ``set_epoch`` on its samplers."""
    objs: dict[int, Any] = {}
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if sampler is not None:
            objs[id(sampler)] = sampler
    for sampler in objs.values():
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class MapEpoch:
    """Per-epoch state of a map-style source: the epoch's index order, materialized when the epoch begins."""

    def __init__(self, order: list, order_rng: Optional[dict], drew_base: bool, base_seed: int) -> None:
        self.order = order
        self.order_rng = order_rng  # RNG states before the order was drawn (None: order is a function of the epoch)
        self.drew_base = drew_base
        self.base_seed = base_seed
        self.fingerprint = _fingerprint(order)
        self.handed = 0  # index batches handed to the inner DataLoader
        self.fifo: deque = deque()  # handed out, not yet received
        self.iterator: Optional[Iterator] = None

    @property
    def num_batches(self) -> int:
        return len(self.order)


class _Feed:
    """Batch sampler of the inner DataLoader: hands out the current epoch's index batches and records them."""

    def __init__(self, source: "MapSource") -> None:
        self._source = source

    def __iter__(self) -> Iterator:
        mep = self._source.current
        while mep is not None and mep.handed < len(mep.order):
            item = mep.order[mep.handed]
            mep.handed += 1
            mep.fifo.append(item)
            yield item

    def __len__(self) -> int:
        mep = self._source.current
        return 0 if mep is None else len(mep.order)


class MapSource:
    """A torch ``DataLoader`` over a map-style dataset whose index sampler has a length.

    The lazy loader draws the epoch's index order itself (the same way ``DataLoader.__iter__`` would, so p = 1 gives
    exactly the same batches) and feeds it to an inner DataLoader with the same dataset, collate_fn, workers and
    pinning. So the batch looks exactly as the wrapped loader would make it, and the indices of every batch are known.
    """

    kind = "map"

    def __init__(self, loader: DataLoader, num_replicas: int, replica_rank: int, seed: int) -> None:
        self.wrapped = self.loader = loader
        self.dataset = loader.dataset
        self.auto_collation = loader.batch_sampler is not None
        self.current: Optional[MapEpoch] = None
        self.base_drawn = False  # for persistent workers: DataLoader draws its base seed only once
        self._inner: Optional[DataLoader] = None
        self.sharded = num_replicas > 1
        self._batches: Optional[BatchSampler] = None
        if self.sharded:
            sampler = loader.sampler
            if not self.auto_collation or loader.batch_size is None:
                raise ValueError(
                    "num_replicas > 1 shards a DataLoader built with batch_size/shuffle/drop_last; this one uses a "
                    "custom batch_sampler or batch_size=None. Shard the data yourself and keep num_replicas=1."
                )
            if not isinstance(sampler, (RandomSampler, SequentialSampler)):
                raise ValueError(
                    f"num_replicas > 1 needs a DataLoader with a RandomSampler (shuffle=True) or a SequentialSampler "
                    f"(shuffle=False), got {type(sampler).__name__}. Shard the data yourself and keep num_replicas=1."
                )
            self._dist = DistributedSampler(
                self.dataset, num_replicas=num_replicas, rank=replica_rank,
                shuffle=isinstance(sampler, RandomSampler), seed=seed, drop_last=False,
            )
            self._batches = BatchSampler(self._dist, loader.batch_size, loader.drop_last)

    # -- shape of an epoch -------------------------------------------------------------------------------------------

    def _index_sampler(self) -> Any:
        if self._batches is not None:
            return self._batches
        return self.loader.batch_sampler if self.auto_collation else self.loader.sampler

    def num_batches(self) -> Optional[int]:
        return sized_len(self._index_sampler())

    # -- the RNG states the order is drawn from ----------------------------------------------------------------------

    def _generators(self) -> list:
        gens: dict[int, torch.Generator] = {}
        loader = self.loader
        for g in (
            loader.generator,
            getattr(loader.sampler, "generator", None),
            getattr(getattr(loader.batch_sampler, "sampler", None), "generator", None),
        ):
            if isinstance(g, torch.Generator):
                gens[id(g)] = g
        return list(gens.values())

    def uses_global_rng(self) -> bool:
        sampler = self.loader.sampler
        return isinstance(sampler, RandomSampler) and sampler.generator is None

    def capture_rng(self) -> Optional[dict]:
        if self.sharded:
            return None
        return {"global": torch.get_rng_state(), "gens": [g.get_state() for g in self._generators()]}

    def apply_generator_states(self, saved: Optional[dict]) -> None:
        if not saved:
            return
        gens = self._generators()
        if len(gens) == len(saved["gens"]):
            for g, state in zip(gens, saved["gens"]):
                g.set_state(state)

    # -- an epoch's order --------------------------------------------------------------------------------------------

    def _draw_order(self, epoch: int, draw_base: bool) -> tuple[list, int]:
        if self._batches is not None:
            self._dist.set_epoch(epoch)
            order = [list(b) for b in self._batches]
            return order, (epoch * 0x9E3779B1 + 12345) & 0x7FFFFFFFFFFFFFFF
        _set_sampler_epoch(self.loader, epoch)
        iterator = iter(self._index_sampler())
        base_seed = 0
        if draw_base:
            # DataLoader.__iter__ draws its worker base seed right after creating the sampler iterator (and before
            # the sampler runs); doing the same keeps the shuffle identical to iterating the wrapped loader.
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator).item())
        if self.auto_collation:
            order = [list(b) for b in iterator]
        else:
            order = [int(i) for i in iterator]
        return order, base_seed

    def _new_epoch(self, epoch: int, order_rng: Optional[dict], drew_base: bool) -> MapEpoch:
        order, base_seed = self._draw_order(epoch, drew_base)
        self.base_drawn = self.base_drawn or drew_base
        return MapEpoch(order, order_rng, drew_base, base_seed)

    def begin(self, epoch: int) -> MapEpoch:
        persistent = self.loader.num_workers > 0 and self.loader.persistent_workers
        order_rng = self.capture_rng()
        return self._new_epoch(epoch, order_rng, drew_base=not (persistent and self.base_drawn))

    def restore(self, epoch: int, saved: dict) -> MapEpoch:
        """Redraw a checkpointed epoch's order from the RNG states it was drawn from (warns if it differs)."""
        order_rng = saved.get("order_rng")
        drew_base = bool(saved.get("drew_base", True))
        if order_rng is None:
            mep = self._new_epoch(epoch, order_rng, drew_base)
        else:
            global_before = torch.get_rng_state()
            try:
                torch.set_rng_state(order_rng["global"])
                self.apply_generator_states(order_rng)
                mep = self._new_epoch(epoch, order_rng, drew_base)
            finally:
                # The trainer's global RNG is not part of the data state: leave it as it was.
                torch.set_rng_state(global_before)
        expected = saved.get("fingerprint")
        if expected is not None and int(expected) != mep.fingerprint:
            rank_zero_warn(
                "LazySamplingLoader: exact resume is impossible: the wrapped DataLoader's sample order for epoch "
                f"{epoch} could not be reproduced from the checkpoint, so the rest of this epoch will not use the same "
                "batches as the uninterrupted run. Exact resume needs an index order that depends only on torch "
                "generators: e.g. DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(s)) or the "
                "default RandomSampler/SequentialSampler; custom samplers must not use other randomness.",
                category=RuntimeWarning,
            )
        return mep

    def resume(self, mep: MapEpoch, epoch: int, epoch_fresh: int, ids: Optional[Tensor], wrapped_state: Any,
               need_batch: bool) -> tuple[MapEpoch, Any]:
        """The order was redrawn by :meth:`restore`; rebuild the reused batch from its indices when asked."""
        return mep, (self.fetch(ids) if need_batch and ids is not None else None)

    # -- drawing -----------------------------------------------------------------------------------------------------

    def _inner_loader(self) -> DataLoader:
        if self._inner is None:
            loader = self.loader
            kwargs: dict[str, Any] = dict(
                num_workers=loader.num_workers,
                collate_fn=loader.collate_fn,
                pin_memory=loader.pin_memory,
                timeout=loader.timeout,
                worker_init_fn=loader.worker_init_fn,
                multiprocessing_context=loader.multiprocessing_context,
                generator=torch.Generator(),
                persistent_workers=loader.persistent_workers,
            )
            if loader.num_workers > 0:
                kwargs["prefetch_factor"] = loader.prefetch_factor
            if getattr(loader, "pin_memory_device", ""):
                kwargs["pin_memory_device"] = loader.pin_memory_device
            if hasattr(loader, "in_order"):
                kwargs["in_order"] = True  # batch order must match the recorded index order
            feed = _Feed(self)
            if self.auto_collation:
                self._inner = DataLoader(self.dataset, batch_sampler=feed, **kwargs)
            else:
                self._inner = DataLoader(self.dataset, batch_size=None, sampler=feed, **kwargs)
        return self._inner

    def draw(self, mep: MapEpoch, epoch_fresh: int, samples_seen: int) -> Drawn:
        if mep.iterator is None:
            if epoch_fresh >= len(mep.order):
                raise StopIteration
            inner = self._inner_loader()
            self.current = mep
            mep.handed = epoch_fresh
            mep.fifo.clear()
            inner.generator.manual_seed(mep.base_seed & 0x7FFFFFFFFFFFFFFF)
            mep.iterator = iter(inner)
        batch = next(mep.iterator)
        item = mep.fifo.popleft()
        ids = torch.tensor(item if self.auto_collation else [item], dtype=torch.long)
        return batch, ids, int(ids.numel()), None

    def fetch(self, ids: Tensor) -> Any:
        """Rebuild a batch from its indices (used on resume when the batch itself is not in the checkpoint)."""
        idx = [int(i) for i in ids.tolist()]
        if not self.auto_collation:
            return self.loader.collate_fn(self.dataset[idx[0]])
        getitems = getattr(self.dataset, "__getitems__", None)
        data = getitems(idx) if callable(getitems) else [self.dataset[i] for i in idx]
        return self.loader.collate_fn(data)

    def close(self, mep: Optional[MapEpoch]) -> None:
        if mep is not None:
            mep.iterator = None
            mep.fifo.clear()
            if self.current is mep:
                self.current = None


# --------------------------------------------------------------------------------------------------------------------
# Any other iterable
# --------------------------------------------------------------------------------------------------------------------


def _leading_dim(batch: Any) -> Optional[int]:
    """Number of samples in a batch: the first dimension of its first tensor (lists: their length)."""
    stack = [batch]
    while stack:
        obj = stack.pop(0)
        if isinstance(obj, Tensor):
            if obj.dim() > 0:
                return int(obj.shape[0])
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            if obj and not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in obj):
                return len(obj)
            stack.extend(obj)
    return None


class IterEpoch:
    """Per-epoch state of an iterable source: just its iterator (no order, nothing to redraw)."""

    order_rng = None
    fingerprint = None
    drew_base = False
    num_batches = None

    def __init__(self) -> None:
        self.iterator: Optional[Iterator] = None


class IterSource:
    """Any other iterable: a DataLoader over an IterableDataset (stream), a list of batches, a generator...

    Batches are pulled one at a time, only on fresh decisions; nothing is read ahead by the lazy loader.
    """

    kind = "iterable"

    def __init__(self, iterable: Iterable) -> None:
        self.wrapped = self.iterable = iterable
        self.stateful = callable(getattr(iterable, "state_dict", None)) and callable(
            getattr(iterable, "load_state_dict", None)
        )
        self._warned_replay = False

    def num_batches(self) -> Optional[int]:
        return sized_len(self.iterable)

    def uses_global_rng(self) -> bool:
        return False

    def capture_rng(self) -> None:
        return None

    def apply_generator_states(self, saved: Any) -> None:
        return None

    def begin(self, epoch: int) -> IterEpoch:
        return IterEpoch()

    def restore(self, epoch: int, saved: dict) -> None:
        """Nothing to prepare at load time: the iterable is repositioned at the first step (see :meth:`resume`)."""
        return None

    def draw(self, iep: IterEpoch, epoch_fresh: int, samples_seen: int) -> Drawn:
        if iep.iterator is None:
            iep.iterator = iter(self.iterable)
        batch = next(iep.iterator)
        count = _leading_dim(batch)
        ids = None if count is None else torch.arange(samples_seen, samples_seen + count, dtype=torch.long)
        wrapped_state = self.iterable.state_dict() if self.stateful else None  # type: ignore[attr-defined]
        return batch, ids, int(count or 0), wrapped_state

    def resume(self, iep: Optional[IterEpoch], epoch: int, epoch_fresh: int, ids: Optional[Tensor],
               wrapped_state: Any, need_batch: bool) -> tuple[IterEpoch, Any]:
        """A new iterator after ``epoch_fresh`` batches; with it the last of them when asked and possible."""
        iep = self.begin(epoch)
        if self.stateful and wrapped_state is not None:
            self.iterable.load_state_dict(wrapped_state)  # type: ignore[attr-defined]
            iep.iterator = iter(self.iterable)
            return iep, None
        iep.iterator = iter(self.iterable)
        if epoch_fresh > 0 and not isinstance(self.iterable, (list, tuple)) and not self._warned_replay:
            self._warned_replay = True
            rank_zero_warn(
                f"LazySamplingLoader: resuming an iterable source by reading its first {epoch_fresh} batch(es) again. "
                "This is exact only if the source yields the same batches in the same order on every pass; give an "
                "online stream `state_dict`/`load_state_dict` methods to resume it without re-reading."
            )
        last = None
        for _ in range(epoch_fresh):
            last = next(iep.iterator)
        return iep, (last if need_batch else None)

    def close(self, iep: Optional[IterEpoch]) -> None:
        if iep is not None:
            iep.iterator = None
