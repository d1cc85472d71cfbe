"""Lazy sampling for Clapping, as a Lightning data component.

At every training step a lazy sampler draws a fresh mini-batch with probability ``p`` and otherwise hands out the
previous mini-batch again, unchanged (same objects, so the micro-batch split and order stay the same). Every pipeline
stage runs in its own process and builds the same wrapper with the same ``seed``; the decisions only depend on
``(seed, step)``, so all stages agree on every decision without talking to each other.

Public API
----------
``LazySamplingDataModule(datamodule_or_train_dataloader, p=0.5, seed=0, num_replicas=1, replica_rank=0)``
    A ``LightningDataModule`` that wraps another data module (or a bare train loader / iterable). Its
    ``train_dataloader()`` returns a :class:`LazySamplingLoader`; everything else passes through.
``LazySamplingLoader(source, p=0.5, seed=0, num_replicas=1, replica_rank=0)``
    The iterable Lightning trains on. ``batch_info(batch_idx)`` returns the :class:`BatchInfo` of the batch that
    ``training_step`` received with that ``batch_idx``.
``BatchInfo(fresh, batch_id, sample_ids, distinct_samples, step)``
    Per-batch metadata (frozen dataclass).
``find_lazy_loader(trainer)``
    Finds the running :class:`LazySamplingLoader` from a ``Trainer``.

See the :class:`LazySamplingLoader` docstring for epoch semantics, resume, sharding and limits.
"""

from __future__ import annotations

import math
import numbers
import weakref
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
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

__all__ = ["BatchInfo", "LazySamplingDataModule", "LazySamplingLoader", "find_lazy_loader"]

_STATE_VERSION = 1
# How many per-batch infos ``batch_info`` can still answer for (Lightning looks at most one batch back).
_INFO_WINDOW = 16
# How many post-yield snapshots are kept for ``state_dict`` (Lightning prefetches at most one batch).
_SNAPSHOT_WINDOW = 4


# --------------------------------------------------------------------------------------------------------------------
# Public metadata
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchInfo:
    """What the pipeline needs to know about one training batch.

    Attributes:
        fresh: ``True`` when the batch was freshly drawn at this step (r_t = 1), ``False`` when it is the previous
            batch handed out again.
        batch_id: Identity of the batch: the number of fresh draws since the start of training, minus one. It is the
            same for every step of a reuse window and unique per distinct batch.
        sample_ids: ``LongTensor`` of the samples in the batch, in batch order: dataset indices for a map-style
            ``DataLoader``, a running count of samples read for iterable sources; ``None`` when unknown.
        distinct_samples: Samples read from the data source so far, this batch included. A reused batch adds nothing;
            a sample drawn again in a later epoch counts again. This is the data budget to report next to the step.
        step: Global step of this batch: the number of batches the loader yielded before it since training started.
    """

    fresh: bool
    batch_id: int
    sample_ids: Optional[Tensor] = field(compare=False)
    distinct_samples: int
    step: int


# --------------------------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------------------------


def _check_p(p: Any) -> float:
    ok = isinstance(p, numbers.Real) and not isinstance(p, bool)
    if ok:
        value = float(p)
        ok = math.isfinite(value) and 0.0 < value <= 1.0
    if not ok:
        raise ValueError(
            f"p must be a number in the range (0, 1]: it is the probability of drawing a fresh mini-batch at each "
            f"training step (p = 1 draws a fresh batch every step, i.e. no reuse; smaller p reuses each batch for "
            f"1/p steps on average). Got p={p!r}."
        )
    return value


def _check_seed(seed: Any) -> int:
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int (shared by all pipeline stages), got {seed!r}.")
    return int(seed)


def _check_replicas(num_replicas: Any, replica_rank: Any) -> tuple[int, int]:
    if not isinstance(num_replicas, numbers.Integral) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    if (
        not isinstance(replica_rank, numbers.Integral)
        or isinstance(replica_rank, bool)
        or not 0 <= replica_rank < num_replicas
    ):
        raise ValueError(f"replica_rank must be an int in [0, num_replicas={num_replicas}), got {replica_rank!r}.")
    return int(num_replicas), int(replica_rank)


# --------------------------------------------------------------------------------------------------------------------
# Decisions: a counter-based generator (SplitMix64). The decision of step t depends only on (seed, t), so it is the
# same in every process, needs no state to checkpoint, and the future can be simulated without consuming anything.
# --------------------------------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_TWO_POW_M53 = 1.0 / (1 << 53)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class _Decisions:
    def __init__(self, seed: int, p: float) -> None:
        self.p = p
        self._base = _mix64((seed * _GAMMA + 0x632BE59BD9B4E019) & _MASK64)

    def uniform(self, step: int) -> float:
        """The step-th uniform in [0, 1) of this seed's stream (53-bit resolution)."""
        return (_mix64((self._base + (step + 1) * _GAMMA) & _MASK64) >> 11) * _TWO_POW_M53

    def fresh(self, step: int) -> bool:
        return self.uniform(step) < self.p

    def epoch_steps(self, start: int, num_batches: int) -> int:
        """Steps an epoch takes that starts (fresh) at global step ``start`` and holds ``num_batches`` batches.

        The epoch ends at the first fresh decision that finds all its batches drawn; that step is not part of it.
        """
        if num_batches <= 0:
            return 0
        if self.p >= 1.0:
            return num_batches
        drawn, t = 1, start + 1
        while True:
            if self.uniform(t) < self.p:
                if drawn == num_batches:
                    return t - start
                drawn += 1
            t += 1


# --------------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------------


def _sized_len(obj: object) -> Optional[int]:
    try:
        return int(len(obj))  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


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


def _is_plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` survives ``torch.load(weights_only=True)`` (tensors, numbers, strings, list/tuple/dict)."""
    if depth > 32:
        return False
    if obj is None or type(obj) in (bool, int, float, str):
        return True
    if type(obj) is Tensor:
        return True
    if type(obj) in (list, tuple):
        return all(_is_plain(x, depth + 1) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return all(type(k) in (str, int) and _is_plain(v, depth + 1) for k, v in obj.items())
    return False


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


# --------------------------------------------------------------------------------------------------------------------
# Sources: how fresh batches are drawn from what was wrapped
# --------------------------------------------------------------------------------------------------------------------


class _MapEpoch:
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


class _Feed:
    """Batch sampler of the inner DataLoader: hands out the current epoch's index batches and records them."""

    def __init__(self, source: "_MapSource") -> None:
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


class _MapSource:
    """A torch ``DataLoader`` over a map-style dataset whose index sampler has a length.

    The lazy loader draws the epoch's index order itself (the same way ``DataLoader.__iter__`` would, so p = 1 gives
    exactly the same batches) and feeds it to an inner DataLoader with the same dataset, collate_fn, workers and
    pinning. So the batch looks exactly as the wrapped loader would make it, and the indices of every batch are known.
    """

    kind = "map"

    def __init__(self, loader: DataLoader, num_replicas: int, replica_rank: int, seed: int) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.auto_collation = loader.batch_sampler is not None
        self.current: Optional[_MapEpoch] = None
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
            if isinstance(sampler, RandomSampler):
                shuffle = True
            elif isinstance(sampler, SequentialSampler):
                shuffle = False
            else:
                raise ValueError(
                    f"num_replicas > 1 needs a DataLoader with a RandomSampler (shuffle=True) or a SequentialSampler "
                    f"(shuffle=False), got {type(sampler).__name__}. Shard the data yourself and keep num_replicas=1."
                )
            self._dist = DistributedSampler(
                self.dataset, num_replicas=num_replicas, rank=replica_rank, shuffle=shuffle, seed=seed, drop_last=False
            )
            self._batches = BatchSampler(self._dist, loader.batch_size, loader.drop_last)

    # -- shape of an epoch -------------------------------------------------------------------------------------------

    def _index_sampler(self) -> Any:
        if self._batches is not None:
            return self._batches
        return self.loader.batch_sampler if self.auto_collation else self.loader.sampler

    def num_batches(self) -> Optional[int]:
        return _sized_len(self._index_sampler())

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

    def _uses_global_rng(self) -> bool:
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

    def _draws_base(self) -> bool:
        persistent = self.loader.num_workers > 0 and self.loader.persistent_workers
        return not (persistent and self.base_drawn)

    def begin(self, epoch: int) -> _MapEpoch:
        order_rng = self.capture_rng()
        drew_base = self._draws_base()
        order, base_seed = self._draw_order(epoch, drew_base)
        self.base_drawn = self.base_drawn or drew_base
        return _MapEpoch(order, order_rng, drew_base, base_seed)

    def rebuild(self, epoch: int, saved: dict) -> _MapEpoch:
        order_rng = saved.get("order_rng")
        drew_base = bool(saved.get("drew_base", True))
        if order_rng is None:
            order, base_seed = self._draw_order(epoch, drew_base)
        else:
            global_before = torch.get_rng_state()
            try:
                torch.set_rng_state(order_rng["global"])
                self.apply_generator_states(order_rng)
                order, base_seed = self._draw_order(epoch, drew_base)
            finally:
                # The trainer's global RNG is not part of the data state: leave it as it was.
                torch.set_rng_state(global_before)
        self.base_drawn = self.base_drawn or drew_base
        mep = _MapEpoch(order, order_rng, drew_base, base_seed)
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

    def draw(self, mep: _MapEpoch, epoch_fresh: int, samples_seen: int) -> tuple[Any, Optional[Tensor], int, Any]:
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

    def close(self, mep: Optional[_MapEpoch]) -> None:
        if mep is not None:
            mep.iterator = None
            mep.fifo.clear()
            if self.current is mep:
                self.current = None


class _IterEpoch:
    def __init__(self) -> None:
        self.iterator: Optional[Iterator] = None
        self.order_rng = None
        self.fingerprint = None
        self.drew_base = False


class _IterSource:
    """Any other iterable: a DataLoader over an IterableDataset (stream), a list of batches, a generator...

    Batches are pulled one at a time, only on fresh decisions; nothing is read ahead by the lazy loader.
    """

    kind = "iterable"

    def __init__(self, iterable: Iterable) -> None:
        self.iterable = iterable
        self.stateful = callable(getattr(iterable, "state_dict", None)) and callable(
            getattr(iterable, "load_state_dict", None)
        )
        self._warned_replay = False

    def num_batches(self) -> Optional[int]:
        return _sized_len(self.iterable)

    def capture_rng(self) -> None:
        return None

    def apply_generator_states(self, saved: Any) -> None:
        return None

    def _uses_global_rng(self) -> bool:
        return False

    def begin(self, epoch: int) -> _IterEpoch:
        return _IterEpoch()

    def draw(self, iep: _IterEpoch, epoch_fresh: int, samples_seen: int) -> tuple[Any, Optional[Tensor], int, Any]:
        if iep.iterator is None:
            iep.iterator = iter(self.iterable)
        batch = next(iep.iterator)
        count = _leading_dim(batch)
        ids = None if count is None else torch.arange(samples_seen, samples_seen + count, dtype=torch.long)
        wrapped_state = self.iterable.state_dict() if self.stateful else None  # type: ignore[attr-defined]
        return batch, ids, int(count or 0), wrapped_state

    def rebuild(self, iep: _IterEpoch, epoch_fresh: int, wrapped_state: Any, need_batch: bool) -> Any:
        """Position a new iterator after ``epoch_fresh`` batches; return the last of them when asked and possible."""
        if self.stateful and wrapped_state is not None:
            self.iterable.load_state_dict(wrapped_state)  # type: ignore[attr-defined]
            iep.iterator = iter(self.iterable)
            return None
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
        return last if need_batch else None

    def fetch(self, ids: Tensor) -> Any:
        raise NotImplementedError

    def close(self, iep: Optional[_IterEpoch]) -> None:
        if iep is not None:
            iep.iterator = None


# --------------------------------------------------------------------------------------------------------------------
# The lazy loader
# --------------------------------------------------------------------------------------------------------------------


class _Snapshot:
    """Loader state right after ``pos`` batches of an epoch were yielded (what a checkpoint at that point needs)."""

    __slots__ = ("pos", "step", "fresh_total", "distinct", "epoch_fresh", "batch", "ids", "wrapped_state")

    def __init__(self, pos: int, step: int, fresh_total: int, distinct: int, epoch_fresh: int, batch: Any,
                 ids: Optional[Tensor], wrapped_state: Any) -> None:
        self.pos = pos
        self.step = step
        self.fresh_total = fresh_total
        self.distinct = distinct
        self.epoch_fresh = epoch_fresh
        self.batch = batch
        self.ids = ids
        self.wrapped_state = wrapped_state


class _Epoch:
    def __init__(self, index: int, start: int, num_batches: Optional[int], total: Optional[int]) -> None:
        self.index = index
        self.start = start  # global step of the epoch's first batch
        self.num_batches = num_batches
        self.total = total  # steps this epoch takes (None when the source has no length)
        self.started = False  # first next() happened
        self.iterated = False  # iter() handed it out
        self.finished = False
        self.pos = 0  # batches yielded in this epoch
        self.fresh = 0  # fresh draws in this epoch
        self.batch: Any = None
        self.has_batch = False
        self.ids: Optional[Tensor] = None
        self.wrapped_state: Any = None
        self.src: Any = None  # _MapEpoch / _IterEpoch
        self.restore: Optional[dict] = None  # checkpoint entry still to apply on the first next()
        # Lightning's batch_idx minus our position. 0 except after a resume at an epoch boundary of a source without
        # length, where Lightning keeps counting batch_idx from the previous epoch.
        self.offset = 0
        self.snapshots: "OrderedDict[int, _Snapshot]" = OrderedDict()
        self.infos: "OrderedDict[int, BatchInfo]" = OrderedDict()


class _LazyIterator(Iterator):
    def __init__(self, loader: "LazySamplingLoader", epoch: _Epoch) -> None:
        self._loader = loader
        self._epoch = epoch

    def __iter__(self) -> "_LazyIterator":
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)


class LazySamplingLoader:
    """Lazy-sampling view of a train loader: fresh batch with probability ``p``, else the previous batch again.

    Args:
        source: what to draw fresh batches from: a ``torch.utils.data.DataLoader`` (map-style or iterable dataset)
            or any iterable of batches (a list, a stream).
        p: probability of drawing a fresh batch at a step, in (0, 1]. ``p = 1`` reproduces ``source`` exactly.
        seed: seed of the decision stream; every pipeline stage must use the same one.
        num_replicas, replica_rank: data-parallel replicas of the pipeline. With ``num_replicas > 1`` the indices of
            a map-style ``source`` are sharded like ``DistributedSampler(shuffle=<source shuffles>, seed=seed)``
            (padded so all replicas have the same number of batches); the decisions do not depend on the rank, so
            all replicas take the same number of steps per epoch.

    Decisions:
        Step t is fresh when t is the first step of an epoch (so r_0 = 1) or when ``u(seed, t) < p``, where ``u`` is
        a counter-based SplitMix64 uniform. It depends on nothing but (seed, t): separate processes agree, runs
        repeat, nothing about it has to be saved, and future decisions can be simulated without consuming anything.
        A reused step yields the very same objects as the step before: the micro-batch split, the order and the
        shapes never change inside a window (a ragged last batch only ever appears at a fresh step). Do not modify a
        batch in place in ``training_step`` or the batch-transfer hooks: the next step may get it again.

    Epoch semantics:
        An epoch is one pass of the wrapped loader by fresh draws. It starts with a fresh draw and ends at the first
        fresh decision that finds the wrapped loader exhausted; that step opens the next epoch, whose first batch is
        fresh anyway. So the last batch of an epoch keeps its full reuse window and every batch of the wrapped loader
        is drawn exactly once per epoch. When the source has a length, ``len(loader)`` is the exact number of steps
        the current (or, between epochs, the next) epoch takes, computed by simulating the decision stream; it
        varies from epoch to epoch. Lightning reads a train loader's length only when it loads it, so a loader bound
        to a trainer (automatic with :class:`LazySamplingDataModule`, or :meth:`bind_trainer`) updates the fit
        loop's batch count at the first step of every epoch (see ``_sync_trainer_length``). ``max_steps`` works as
        usual. If Lightning stops an epoch early (``limit_train_batches``), the next ``iter()`` starts a new pass
        and the rest of the interrupted one is dropped.

    Metadata:
        ``batch_info(batch_idx)`` gives the :class:`BatchInfo` of the batch yielded at position ``batch_idx`` of the
        current epoch, which is the ``batch_idx`` Lightning passes to ``training_step`` (also after a resume). It is
        correct although Lightning fetches one batch ahead for sources without a length. The loader's
        ``distinct_samples``/``step`` are as of the latest batch *yielded*, which may be the prefetched one; log the
        ``BatchInfo`` values instead.

    Sample ids:
        Map-style ``DataLoader``: the dataset indices of each batch, drawn by the lazy loader itself (the same way
        ``DataLoader.__iter__`` would) and fed to an inner DataLoader with the wrapped loader's dataset, collate_fn,
        workers and pinning, so the batch looks exactly as before. Limits: the wrapped DataLoader's own ``__iter__``
        is bypassed (subclasses overriding it are not honoured); the whole epoch's index order is drawn when the
        epoch begins; with ``num_workers > 0`` batches are correct and in order but the workers' random seeds (so
        random augmentation) differ from iterating the wrapped loader, and the workers read ahead as a DataLoader
        always does. Iterable sources: a running count of the samples read (first dimension of the batch), ``None``
        when the batch has no tensor. An online stream is read once per fresh step (p per step on average) and the
        loader keeps no batch but the current one; a DataLoader with workers over it still prefetches as configured.

    Resume:
        The loader implements ``state_dict``/``load_state_dict``. Lightning stores them with the fit loop (through
        ``CombinedLoader._state_dicts``) and loads them before it creates the epoch's iterator when resuming with
        ``ckpt_path=``, so a run resumed mid-epoch (even mid-window) continues with the same decisions and batches.
        :class:`LazySamplingDataModule` also keeps a copy in its own ``state_dict``, which Lightning restores before
        reading the loader's length. Resumes rely on the loader being bound to the trainer: the data module does
        that; a bare loader passed to ``Trainer.fit(train_dataloaders=...)`` must get ``loader.bind_trainer(trainer)``
        before ``fit`` (otherwise a resume of a source without length can be one batch off, and a resume at an
        epoch boundary can misalign ``batch_info``).
        Saved: counters, the epoch position, the current batch (when it contains only tensors/numbers/strings in
        lists/tuples/dicts; otherwise it is rebuilt from its indices, or by re-reading an iterable), and the RNG
        states the epoch's index order was drawn from. Because Lightning may already have fetched one batch ahead,
        the state is taken at the batch Lightning has consumed (read from the bound trainer, see
        :func:`find_lazy_loader`); without a trainer it is taken after the latest yielded batch.
        Requirements: a map-style loader needs an index order that depends only on torch generators; pass a seeded
        ``generator=`` to the DataLoader to also reproduce the epochs after the resumed one (an unseeded shuffle
        draws from the global RNG, which Lightning does not restore: the current epoch is still exact). A warning
        says when the order could not be reproduced. Iterable sources with ``state_dict``/``load_state_dict`` are
        restored through them; others are re-read up to the position (exact only if deterministic; warned).
    """

    def __init__(
        self, source: Iterable, p: float = 0.5, seed: int = 0, num_replicas: int = 1, replica_rank: int = 0
    ) -> None:
        self.p = _check_p(p)
        self.seed = _check_seed(seed)
        self.num_replicas, self.replica_rank = _check_replicas(num_replicas, replica_rank)
        if isinstance(source, LazySamplingLoader):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        self._decisions = _Decisions(self.seed, self.p)
        self._source = self._make_source(source)
        self._step = 0  # batches yielded since the start of training
        self._fresh_total = 0  # fresh draws since the start of training
        self._distinct = 0  # samples read from the source
        self._epochs_begun = 0  # index of the next epoch
        self._epoch: Optional[_Epoch] = None
        self._trainer_ref: Optional[Callable[[], Any]] = None
        self._warned_global_rng = False

    def _make_source(self, source: Iterable) -> Any:
        if (
            isinstance(source, DataLoader)
            and not isinstance(source.dataset, IterableDataset)
            and _sized_len(source.batch_sampler if source.batch_sampler is not None else source.sampler) is not None
        ):
            return _MapSource(source, self.num_replicas, self.replica_rank, self.seed)
        if self.num_replicas > 1:
            raise ValueError(
                "num_replicas > 1 can only shard a torch DataLoader over a map-style dataset; shard an iterable "
                "source yourself (each replica reading its own stream) and keep num_replicas=1."
            )
        return _IterSource(source)

    # -- public properties -------------------------------------------------------------------------------------------

    @property
    def source(self) -> Iterable:
        """The wrapped train loader / iterable."""
        return self._source.loader if self._source.kind == "map" else self._source.iterable

    @property
    def step(self) -> int:
        """Batches yielded since training started (Lightning may have fetched the latest one ahead)."""
        return self._step

    @property
    def fresh_draws(self) -> int:
        """Fresh batches drawn since training started."""
        return self._fresh_total

    @property
    def distinct_samples(self) -> int:
        """Samples read from the source so far (reused batches not counted again), as of the latest yielded batch."""
        return self._distinct

    @property
    def epoch(self) -> int:
        """Index of the current epoch (of the next one between epochs)."""
        ep = self._epoch
        if ep is not None and ep.started and not self._epoch_complete(ep):
            return ep.index
        return self._epochs_begun

    def batch_info(self, batch_idx: int) -> BatchInfo:
        """Metadata of the batch yielded at position ``batch_idx`` of the current epoch (Lightning's ``batch_idx``)."""
        ep = self._epoch
        info = None if ep is None else ep.infos.get(int(batch_idx))
        if info is None:
            known = [] if ep is None else list(ep.infos)
            raise KeyError(
                f"LazySamplingLoader.batch_info: no batch at position {batch_idx} of the current epoch among the "
                f"last {_INFO_WINDOW} yielded (known positions: {known}). batch_idx is the index Lightning passes to "
                "training_step, i.e. the number of batches yielded before it in this epoch."
            )
        return info

    def bind_trainer(self, trainer: Any) -> None:
        """Link the loader to the trainer that trains on it (held weakly; done by LazySamplingDataModule).

        The loader then checkpoints the batch the trainer has consumed (Lightning fetches ahead), maps Lightning's
        ``batch_idx`` after a resume, and tells the fit loop the length of each epoch. Call it before ``fit``.
        """
        if trainer is None:
            self._trainer_ref = None
            return
        try:
            self._trainer_ref = weakref.ref(trainer)
        except TypeError:  # objects without weakref support (test doubles)
            self._trainer_ref = lambda: trainer

    def replace_source(self, source: Iterable) -> None:
        """Draw from ``source`` from the next epoch on (decision stream and counters continue)."""
        ep = self._epoch
        if ep is not None and not ep.started:
            self._epoch = None
        self._source = self._make_source(source)

    # -- length / planning -------------------------------------------------------------------------------------------

    def _epoch_complete(self, ep: _Epoch) -> bool:
        return ep.finished or (ep.total is not None and ep.pos >= ep.total)

    def _plan(self) -> _Epoch:
        n = self._source.num_batches()
        total = None if n is None else self._decisions.epoch_steps(self._step, n)
        return _Epoch(self._epochs_begun, self._step, n, total)

    def _current_or_next(self) -> _Epoch:
        """The epoch len() describes: the running one, else the one the next iter() will run."""
        ep = self._epoch
        if ep is None or ep.finished or (ep.started and self._epoch_complete(ep)):
            if ep is not None:
                self._close(ep)
            ep = self._epoch = self._plan()
        return ep

    def __len__(self) -> int:
        ep = self._current_or_next()
        if ep.total is None:
            raise TypeError("LazySamplingLoader has no length: the wrapped source has none.")
        return ep.total

    def __iter__(self) -> Iterator:
        ep = self._epoch
        if ep is None or ep.started or ep.finished:
            if ep is not None:
                self._close(ep)
            ep = self._epoch = self._plan()
        # An unstarted epoch (planned by len(), restored by load_state_dict, or left by an iter() nobody pulled from,
        # like Lightning's iterability check) is used as is: nothing happens before the first next().
        return _LazyIterator(self, ep)

    def _close(self, ep: _Epoch) -> None:
        ep.finished = True
        if ep.src is not None:
            self._source.close(ep.src)

    # -- the step ----------------------------------------------------------------------------------------------------

    def _begin(self, ep: _Epoch) -> None:
        ep.started = True
        ready = self._trainer_ready()
        if ready is not None:
            ep.offset = ready - ep.pos
        if ep.restore is not None:
            self._apply_restore(ep)
        else:
            self._epochs_begun = ep.index + 1
            ep.src = self._source.begin(ep.index)
            if self._source.kind == "map":
                n = len(ep.src.order)
                if n != ep.num_batches:
                    ep.num_batches, ep.total = n, self._decisions.epoch_steps(ep.start, n)
            self._record_snapshot(ep)
        self._sync_trainer_length(ep)

    def _next(self, it: _LazyIterator) -> Any:
        ep = it._epoch
        if self._epoch is not ep or ep.finished:
            raise StopIteration
        if not ep.started and ep.restore is not None and self._epoch_complete(ep):
            # Resumed from a checkpoint taken after the last step of an epoch: this iterator carries on with the
            # next epoch, as a new pass of a plain DataLoader would.
            self._close(ep)
            ep = it._epoch = self._epoch = self._plan()
        if not ep.started:
            self._begin(ep)
        t = self._step
        fresh = ep.pos == 0 or not ep.has_batch or self._decisions.fresh(t)
        if fresh:
            if ep.num_batches is not None and ep.fresh >= ep.num_batches:
                self._close(ep)
                raise StopIteration
            try:
                batch, ids, count, wrapped_state = self._source.draw(ep.src, ep.fresh, self._distinct)
            except StopIteration:
                self._close(ep)
                raise
            ep.fresh += 1
            self._fresh_total += 1
            self._distinct += count
            ep.batch, ep.ids, ep.has_batch, ep.wrapped_state = batch, ids, True, wrapped_state
            # Older snapshots may not keep an earlier batch alive (the stream is never buffered).
            for snap in ep.snapshots.values():
                snap.batch = None
        info = BatchInfo(fresh, self._fresh_total - 1, ep.ids, self._distinct, t)
        ep.infos[ep.pos + ep.offset] = info
        while len(ep.infos) > _INFO_WINDOW:
            ep.infos.popitem(last=False)
        self._step += 1
        ep.pos += 1
        self._record_snapshot(ep)
        return ep.batch

    def _sync_trainer_length(self, ep: _Epoch) -> None:
        """Tell a fitting Lightning trainer how many batches this epoch has.

        Lightning reads the length of a train loader once, when it loads it, and keeps it for later epochs; lazy
        epochs differ in length. So at the first step of each epoch the loader updates the fit loop's batch count,
        the CombinedLoader limit, the fetcher's length and a fraction-based ``val_check_batch``. This is left alone
        when ``limit_train_batches`` is set or the loader is combined with others.
        """
        if ep.total is None or self._trainer_ref is None:
            return
        trainer = self._trainer_ref()
        if trainer is None:
            return
        try:
            if getattr(trainer.state, "fn", None) != "fit":
                return
            limit = trainer.limit_train_batches
            if not (isinstance(limit, float) and limit == 1.0):
                return
            fit_loop = trainer.fit_loop
            combined = fit_loop._combined_loader
            if combined is None or len(combined.flattened) != 1 or _search(combined.flattened[0]) is not self:
                return
            want = ep.offset + ep.total
            if fit_loop.max_batches == want:
                return
            combined.limits = [want]
            fit_loop.max_batches = want
            fetcher = fit_loop._data_fetcher
            if fetcher is not None and getattr(fetcher, "length", None) is not None:
                fetcher.length = want
            interval = trainer.val_check_interval
            if (
                isinstance(interval, float)
                and getattr(trainer, "_val_check_time_interval", None) is None
                and trainer.val_check_batch not in (None, float("inf"))
            ):
                trainer.val_check_batch = max(1, int(want * interval))
        except Exception as err:  # pragma: no cover - only on an incompatible Lightning
            if not getattr(self, "_warned_sync", False):
                self._warned_sync = True
                rank_zero_warn(
                    f"LazySamplingLoader: could not update Lightning's epoch length ({err!r}); epochs longer than the "
                    "first may be cut short. Set Trainer(reload_dataloaders_every_n_epochs=1) as a workaround."
                )

    def _record_snapshot(self, ep: _Epoch) -> None:
        ep.snapshots[ep.pos] = _Snapshot(
            ep.pos, self._step, self._fresh_total, self._distinct, ep.fresh,
            ep.batch if ep.has_batch else None, ep.ids, ep.wrapped_state,
        )
        while len(ep.snapshots) > _SNAPSHOT_WINDOW:
            ep.snapshots.popitem(last=False)

    # -- checkpointing -----------------------------------------------------------------------------------------------

    def _trainer_ready(self) -> Optional[int]:
        """Batches the bound trainer has taken from the current epoch (Lightning's next batch_idx), if fitting."""
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            return None
        try:
            if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
                return None
            return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        except Exception:
            return None

    def _common_state(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "p": self.p,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "replica_rank": self.replica_rank,
            "source_kind": self._source.kind,
        }

    def _between_state(self, step: int, fresh_total: int, distinct: int, next_epoch: int, rng: Optional[dict]) -> dict:
        state = self._common_state()
        state.update(step=step, fresh_total=fresh_total, distinct=distinct, next_epoch=next_epoch, epoch=None,
                     generators=rng, base_drawn=getattr(self._source, "base_drawn", False))
        return state

    def state_dict(self) -> dict:
        """Everything needed to continue exactly from the batch the trainer consumed last (see class docstring)."""
        ep = self._epoch
        if ep is None or not ep.started:
            if ep is not None and ep.restore is not None:
                return dict(ep.restore["state"])  # restored but not iterated yet: unchanged
            return self._between_state(self._step, self._fresh_total, self._distinct, self._epochs_begun,
                                       self._source.capture_rng())
        ready = self._trainer_ready()
        snap = ep.snapshots.get(ready - ep.offset) if ready is not None else None
        if snap is None:
            snap = next(reversed(ep.snapshots.values()))
        if snap.pos == 0:
            rng = ep.src.order_rng if ep.src is not None else self._source.capture_rng()
            return self._between_state(snap.step, snap.fresh_total, snap.distinct, ep.index, rng)
        if ep.finished and ep.total is None and snap is ep.snapshots.get(ep.pos):
            # A source without length that was found exhausted: Lightning starts a new epoch on resume.
            return self._between_state(snap.step, snap.fresh_total, snap.distinct, ep.index + 1,
                                       self._source.capture_rng())
        has_batch = snap.batch is not None and _is_plain(snap.batch)
        state = self._common_state()
        state.update(
            step=snap.step,
            fresh_total=snap.fresh_total,
            distinct=snap.distinct,
            next_epoch=ep.index + 1,
            generators=None,
            base_drawn=getattr(self._source, "base_drawn", False),
            epoch={
                "index": ep.index,
                "start": ep.start,
                "num_batches": ep.num_batches,
                "total": ep.total,
                "pos": snap.pos,
                "fresh": snap.epoch_fresh,
                "ids": snap.ids,
                "has_batch": has_batch,
                "batch": snap.batch if has_batch else None,
                "order_rng": ep.src.order_rng,
                "fingerprint": ep.src.fingerprint,
                "drew_base": ep.src.drew_base,
                "wrapped_state": snap.wrapped_state,
            },
        )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from a ``state_dict``; the next ``iter()`` resumes the saved epoch at the saved position."""
        state = dict(state_dict)
        if int(state.get("version", -1)) != _STATE_VERSION:
            raise ValueError(f"LazySamplingLoader: unsupported state version {state.get('version')!r}.")
        mine = {"p": self.p, "seed": self.seed, "num_replicas": self.num_replicas,
                "replica_rank": self.replica_rank, "source_kind": self._source.kind}
        for key, value in mine.items():
            if state.get(key) != value:
                rank_zero_warn(
                    f"LazySamplingLoader: the checkpoint was written with {key}={state.get(key)!r}, this loader has "
                    f"{key}={value!r}; the resumed run will not repeat the uninterrupted one."
                )
        if self._epoch is not None:
            self._close(self._epoch)
        self._step = int(state["step"])
        self._fresh_total = int(state["fresh_total"])
        self._distinct = int(state["distinct"])
        self._epochs_begun = int(state["next_epoch"])
        if hasattr(self._source, "base_drawn"):
            self._source.base_drawn = bool(state.get("base_drawn", False))
        if self._source._uses_global_rng() and not self._warned_global_rng:
            self._warned_global_rng = True
            rank_zero_warn(
                "LazySamplingLoader: the wrapped DataLoader shuffles with the global torch RNG, which the checkpoint "
                "does not restore: the current epoch resumes exactly, but later epochs use a different order than "
                "an uninterrupted run. Pass generator=torch.Generator().manual_seed(s) to the DataLoader for fully "
                "exact resumes."
            )
        entry = state.get("epoch")
        if entry is None:
            self._source.apply_generator_states(state.get("generators"))
            self._epoch = None
            return
        ep = _Epoch(int(entry["index"]), int(entry["start"]), entry["num_batches"], entry["total"])
        ep.restore = {"entry": entry, "state": state}
        ep.pos, ep.fresh = int(entry["pos"]), int(entry["fresh"])
        self._epochs_begun = ep.index + 1
        if self._source.kind == "map":
            # Redraw the epoch's order now: this puts the DataLoader's generators where the uninterrupted run had
            # them, even if Lightning never asks this epoch for another batch (resume at its last step).
            ep.src = self._source.rebuild(ep.index, entry)
            n = len(ep.src.order)
            if n != ep.num_batches:
                ep.num_batches, ep.total = n, self._decisions.epoch_steps(ep.start, n)
        self._epoch = ep

    def _apply_restore(self, ep: _Epoch) -> None:
        entry = ep.restore["entry"]  # type: ignore[index]
        ep.restore = None
        ep.ids = entry["ids"]
        ep.wrapped_state = entry.get("wrapped_state")
        self._epochs_begun = ep.index + 1
        need_batch = not entry["has_batch"] and not self._decisions.fresh(self._step)
        rebuilt = None
        if self._source.kind == "map":
            if need_batch and ep.ids is not None:
                rebuilt = self._source.fetch(ep.ids)
        else:
            ep.src = self._source.begin(ep.index)
            rebuilt = self._source.rebuild(ep.src, ep.fresh, ep.wrapped_state, need_batch)
        if entry["has_batch"]:
            ep.batch, ep.has_batch = entry["batch"], True
        elif rebuilt is not None:
            ep.batch, ep.has_batch = rebuilt, True
        elif need_batch:
            ep.batch, ep.has_batch = None, False
            rank_zero_warn(
                "LazySamplingLoader: exact resume is impossible: the checkpoint does not hold the reused batch and it "
                "cannot be rebuilt (keep batches to tensors/numbers/strings in lists, tuples and dicts, or use a "
                "map-style DataLoader). The first step after the resume draws a fresh batch instead.",
                category=RuntimeWarning,
            )
        self._record_snapshot(ep)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_trainer_ref"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(p={self.p}, seed={self.seed}, num_replicas={self.num_replicas}, "
            f"replica_rank={self.replica_rank}, source={type(self.source).__name__}, step={self._step}, "
            f"fresh_draws={self._fresh_total}, distinct_samples={self._distinct})"
        )


# --------------------------------------------------------------------------------------------------------------------
# The data module
# --------------------------------------------------------------------------------------------------------------------

_PASS_THROUGH_IF_DEFINED = (
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "transfer_batch_to_device",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
)


class LazySamplingDataModule(LightningDataModule):
    """Lazy sampling around an existing ``LightningDataModule`` (or a bare train DataLoader / iterable).

    Args:
        datamodule_or_train_dataloader: the data module to wrap, or the train loader itself.
        p: probability of a fresh mini-batch at each training step, in (0, 1]; ``p = 1`` is exactly the wrapped module.
        seed: seed of the decision stream, the same on every pipeline stage.
        num_replicas, replica_rank: data-parallel pipeline replicas; see :class:`LazySamplingLoader`.

    ``train_dataloader()`` returns a :class:`LazySamplingLoader` over the wrapped ``train_dataloader()`` (created once
    and reused; if you asked Lightning to reload dataloaders, the wrapped module's new loader is used from the next
    epoch on). ``val/test/predict_dataloader``, the batch-transfer hooks, ``prepare_data``, ``setup``, ``teardown``,
    ``state_dict``/``load_state_dict`` and ``on_exception`` go to the wrapped module unchanged; hooks it does not
    define stay undefined here. Unknown attributes are looked up on the wrapped module.

    The loader is bound to the trainer (weakly), which lets it (a) take checkpoints at the batch the trainer has
    consumed although Lightning fetches ahead, and (b) tell Lightning the exact length of every epoch (lazy epochs
    differ in length; Lightning would otherwise keep the first one). The loader's position is also saved in this
    module's ``state_dict`` (next to the wrapped module's), because Lightning restores data modules before it reads the
    train loader's length, and the fit loop's copy of the loader state only after that.
    """

    def __init__(
        self,
        datamodule_or_train_dataloader: Any,
        p: float = 0.5,
        seed: int = 0,
        num_replicas: int = 1,
        replica_rank: int = 0,
    ) -> None:
        super().__init__()
        self.p = _check_p(p)
        self.seed = _check_seed(seed)
        self.num_replicas, self.replica_rank = _check_replicas(num_replicas, replica_rank)
        wrapped = datamodule_or_train_dataloader
        if isinstance(wrapped, LazySamplingDataModule):
            raise ValueError("The data module is already a LazySamplingDataModule; wrap the inner one instead.")
        if isinstance(wrapped, LightningDataModule):
            self._wrapped: Optional[LightningDataModule] = wrapped
            self._train_source: Optional[Iterable] = None
            self.prepare_data_per_node = wrapped.prepare_data_per_node
            self.allow_zero_length_dataloader_with_multiple_devices = (
                wrapped.allow_zero_length_dataloader_with_multiple_devices
            )
            from lightning.pytorch.utilities.model_helpers import is_overridden

            for name in _PASS_THROUGH_IF_DEFINED:
                if is_overridden(name, wrapped, LightningDataModule):
                    setattr(self, name, getattr(wrapped, name))
        elif isinstance(wrapped, Iterable):
            self._wrapped = None
            self._train_source = wrapped
        else:
            raise TypeError(
                "LazySamplingDataModule wraps a LightningDataModule or a train DataLoader/iterable, got "
                f"{type(wrapped).__name__}."
            )
        self._loader: Optional[LazySamplingLoader] = None
        self._pending_loader_state: Optional[dict] = None
        self._user_reloads: Optional[bool] = None

    @property
    def wrapped(self) -> Optional[LightningDataModule]:
        """The wrapped data module (``None`` when a bare loader was given)."""
        return self._wrapped

    @property
    def loader(self) -> Optional[LazySamplingLoader]:
        """The lazy train loader, once ``train_dataloader()`` has been called."""
        return self._loader

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: fall back to the wrapped module's attributes.
        wrapped = self.__dict__.get("_wrapped")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(wrapped, name)

    def _sync_trainer(self) -> None:
        if self._wrapped is not None and self.trainer is not None:
            self._wrapped.trainer = self.trainer

    def prepare_data(self) -> None:
        if self._wrapped is not None:
            self._wrapped.prepare_data()

    def setup(self, stage: str) -> None:
        self._sync_trainer()
        if self._wrapped is not None:
            self._wrapped.setup(stage)

    def teardown(self, stage: str) -> None:
        if self._wrapped is not None:
            self._wrapped.teardown(stage)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"wrapped": self._wrapped.state_dict() if self._wrapped is not None else {}}
        if self._loader is not None:
            state["lazy_loader"] = self._loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._wrapped is not None:
            self._wrapped.load_state_dict(state_dict.get("wrapped", {}))
        # Lightning restores the data module before it builds the train loader and reads its length, while the fit
        # loop's copy of the loader state arrives only after the length was read. Applying it here makes len() of the
        # resumed epoch right; the fit loop then loads the same state again, which changes nothing.
        loader_state = state_dict.get("lazy_loader")
        if loader_state is not None:
            if self._loader is not None:
                self._loader.load_state_dict(loader_state)
            else:
                self._pending_loader_state = loader_state

    def on_exception(self, exception: BaseException) -> None:
        if self._wrapped is not None:
            self._wrapped.on_exception(exception)

    def _wrapped_train_loader(self) -> Iterable:
        if self._wrapped is None:
            assert self._train_source is not None
            return self._train_source
        self._sync_trainer()
        return self._wrapped.train_dataloader()

    def train_dataloader(self) -> LazySamplingLoader:
        trainer = self.trainer
        if self._user_reloads is None and trainer is not None:
            self._user_reloads = bool(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))
        if self._loader is None:
            self._loader = LazySamplingLoader(
                self._wrapped_train_loader(), self.p, self.seed, self.num_replicas, self.replica_rank
            )
            if self._pending_loader_state is not None:
                self._loader.load_state_dict(self._pending_loader_state)
                self._pending_loader_state = None
        elif self._user_reloads and self._wrapped is not None:
            self._loader.replace_source(self._wrapped_train_loader())
        if trainer is not None:
            self._loader.bind_trainer(trainer)
        return self._loader

    def __repr__(self) -> str:
        inner = type(self._wrapped).__name__ if self._wrapped is not None else type(self._train_source).__name__
        return f"{type(self).__name__}({inner}, p={self.p}, seed={self.seed})"

    __str__ = __repr__


# --------------------------------------------------------------------------------------------------------------------
# Lookup from a trainer
# --------------------------------------------------------------------------------------------------------------------


def _search(obj: Any, depth: int = 0) -> Optional[LazySamplingLoader]:
    if isinstance(obj, LazySamplingLoader):
        return obj
    if obj is None or depth > 6 or isinstance(obj, (str, bytes, Tensor)):
        return None
    if isinstance(obj, CombinedLoader):
        children: Iterable = obj.flattened
    elif isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        # a strategy may wrap the loader in its own object
        children = [getattr(obj, name, None) for name in ("loader", "dataloader", "_loader", "_dataloader")]
    for child in children:
        found = _search(child, depth + 1)
        if found is not None:
            return found
    return None


def find_lazy_loader(trainer: Any) -> Optional[LazySamplingLoader]:
    """The :class:`LazySamplingLoader` the trainer trains on, or ``None``.

    Looks at ``trainer.train_dataloader`` (the loader itself, or inside a list/dict/CombinedLoader), then at
    ``trainer.datamodule`` when it is a :class:`LazySamplingDataModule`. The loader found is bound to the trainer so
    that its checkpoints account for Lightning's prefetching.
    """
    found = None
    try:
        found = _search(getattr(trainer, "train_dataloader", None))
    except Exception:
        found = None
    if found is None:
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        found = _search(combined)
    if found is None:
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, LazySamplingDataModule):
            found = datamodule.loader
    if found is not None and (found._trainer_ref is None or found._trainer_ref() is not trainer):
        found.bind_trainer(trainer)
    return found
