"""Where fresh batches come from: ``draw(k, samples_seen)`` is the k-th batch of a pass of the wrapped loader.

:class:`MapSource` (a ``DataLoader`` over a map-style dataset) draws each pass's index order as ``DataLoader.__iter__``
would and loads it with an inner DataLoader built alike, so every batch's dataset indices are known; a resume redraws
the order from the RNG states it came from. :class:`IterSource` (any other iterable) pulls batches one by one; a
resume goes through the iterable's ``state_dict``/``load_state_dict`` or reads it again.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler
from torch.utils.data import SequentialSampler

from lightning_clapping._compat import tree_flatten

_SEED_MASK = 0x7FFFFFFFFFFFFFFF
_INNER_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                      "prefetch_factor", "persistent_workers", "pin_memory_device")


def sized_len(obj: object) -> Optional[int]:
    try:
        return int(len(obj))  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def make_source(source: Iterable, num_replicas: int, replica_rank: int, seed: int) -> "MapSource | IterSource":
    if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset) and sized_len(
            source.batch_sampler if source.batch_sampler is not None else source.sampler) is not None:
        return MapSource(source, num_replicas, replica_rank, seed)
    if num_replicas > 1:
        raise ValueError("num_replicas > 1 can only shard a torch DataLoader over a map-style dataset; shard an "
                         "iterable source yourself (each replica reading its own stream) and keep num_replicas=1.")
    return IterSource(source)


class MapSource:
    """A torch ``DataLoader`` over a map-style dataset; with ``num_replicas > 1``, sharded like DistributedSampler."""

    kind = "map"

    def __init__(self, loader: DataLoader, num_replicas: int, replica_rank: int, seed: int) -> None:
        self.wrapped, self.auto_collation, sampler = loader, loader.batch_sampler is not None, loader.sampler
        self.base_drawn = False  # with persistent workers a DataLoader draws its workers' base seed only once
        self.order: Optional[list] = None  # the running pass's index batches (indices without auto-collation)
        self._entry: dict = {}
        self._inner, self._iter, self._warned = None, None, False
        self._feed: list = []  # the inner DataLoader's index sampler: what it still loads of the pass
        self._indices = loader.batch_sampler if self.auto_collation else sampler
        self._sharded = num_replicas > 1
        if self._sharded:
            if loader.batch_size is None or not isinstance(sampler, (RandomSampler, SequentialSampler)):
                raise ValueError(
                    "num_replicas > 1 shards a DataLoader built with batch_size, shuffle and drop_last (a RandomSampler"
                    f" or SequentialSampler), got sampler={type(sampler).__name__}, batch_size={loader.batch_size}. "
                    "Shard the data yourself and keep num_replicas=1.")
            shards = DistributedSampler(loader.dataset, num_replicas, replica_rank, seed=seed, drop_last=False,
                                        shuffle=isinstance(sampler, RandomSampler))
            self._indices = BatchSampler(shards, loader.batch_size, loader.drop_last)

    def num_batches(self) -> Optional[int]:
        return len(self.order) if self.order is not None else sized_len(self._indices)

    def _generators(self) -> list:
        """The generators the order is drawn from, looked up now (a strategy may give the loader one later)."""
        loader = self.wrapped
        found = (loader.generator, getattr(loader.sampler, "generator", None),
                 getattr(getattr(loader.batch_sampler, "sampler", None), "generator", None))
        return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())

    def _rng_states(self) -> Optional[dict]:
        """The RNG states an order is drawn from now (None when sharded: then it is a function of seed and epoch)."""
        return None if self._sharded else {"global": torch.get_rng_state(),
                                           "gens": [g.get_state() for g in self._generators()]}

    def begin(self, epoch: int) -> None:
        persistent = self.wrapped.num_workers > 0 and self.wrapped.persistent_workers
        self._draw_order(epoch, self._rng_states(), drew_base=not (persistent and self.base_drawn))

    def _draw_order(self, epoch: int, order_rng: Optional[dict], drew_base: bool) -> None:
        if self._sharded:
            self._indices.sampler.set_epoch(epoch)  # type: ignore[union-attr]
            order, base_seed = [list(b) for b in self._indices], (epoch * 0x9E3779B1 + 12345) & _SEED_MASK
        else:
            samplers = (self.wrapped.sampler, getattr(self.wrapped.batch_sampler, "sampler", None))
            for sampler in {id(s): s for s in samplers if callable(getattr(s, "set_epoch", None))}.values():
                sampler.set_epoch(epoch)  # what Lightning does for a train DataLoader it owns
            indices = iter(self._indices)
            # DataLoader.__iter__ draws its workers' base seed after creating the sampler iterator and before the
            # sampler runs: in the same order here, the shuffle is the one iterating the wrapped loader gives
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.wrapped.generator)) \
                if drew_base else 0
            order = [list(b) if self.auto_collation else int(b) for b in indices]
        self.base_drawn = self.base_drawn or drew_base
        self.order, self._base_seed, self._iter = order, base_seed, None
        self._entry = {"order_rng": order_rng, "fingerprint": zlib.crc32(repr(order).encode()), "drew_base": drew_base}

    def checkpoint(self) -> dict:
        """The RNG states the running (else the next) pass's order is drawn from."""
        entry = self._entry if self.order is not None else {"order_rng": self._rng_states()}
        return {**entry, "base_drawn": self.base_drawn}

    def restore(self, epoch: int, state: dict, need_batch: bool) -> Any:
        """Set the generators, or redraw the order of the pass to go on with from its RNG states (warns when it
        differs); returns the batch to reuse, rebuilt from its indices, when asked."""
        sampler = self.wrapped.sampler
        if not self._sharded and isinstance(sampler, RandomSampler) and sampler.generator is None and not self._warned:
            self._warned = True
            warnings.warn("LazySamplingLoader: the DataLoader shuffles with the global torch RNG, which checkpoints do "
                          "not restore: later epochs will not repeat an uninterrupted run. Pass generator="
                          "torch.Generator().manual_seed(s) to the DataLoader for fully exact resumes.", stacklevel=3)
        self.base_drawn, order_rng, gens = bool(state["base_drawn"]), state["order_rng"], self._generators()
        if order_rng is not None and len(gens) == len(order_rng["gens"]):
            for generator, saved in zip(gens, order_rng["gens"]):
                generator.set_state(saved)
        if state["pos"] == 0:
            return None
        with torch.random.fork_rng(devices=[]):  # the trainer's global RNG is not part of the data state
            if order_rng is not None:
                torch.set_rng_state(order_rng["global"])
            self._draw_order(epoch, order_rng, bool(state["drew_base"]))
        if state["fingerprint"] != self._entry["fingerprint"]:
            warnings.warn(f"LazySamplingLoader: exact resume is impossible: the DataLoader's sample order of epoch "
                          f"{epoch} could not be redrawn from the checkpoint, so the rest of it differs from the "
                          "uninterrupted run. Exact resume needs an index order that depends only on torch generators "
                          "(e.g. shuffle=True with generator=torch.Generator().manual_seed(s)).", RuntimeWarning, 3)
        if not need_batch or state["ids"] is None:
            return None
        ids = [int(i) for i in state["ids"].tolist()]
        return next(self._load([ids] if self.auto_collation else ids, self._base_seed))

    def _load(self, items: list, base_seed: int) -> Iterable:
        """The batches of ``items`` (index batches, or indices), loaded as the wrapped DataLoader would."""
        if self._inner is None:
            loader = self.wrapped
            kwargs = {name: getattr(loader, name) for name in _INNER_LOADER_ARGS if hasattr(loader, name)}
            if hasattr(loader, "in_order"):
                kwargs["in_order"] = True  # the k-th batch received must be the k-th index batch handed out
            feed = {"batch_sampler": self._feed} if self.auto_collation else {"batch_size": None, "sampler": self._feed}
            self._inner = DataLoader(loader.dataset, generator=torch.Generator(), **feed, **kwargs)
        self._feed[:] = items
        self._inner.generator.manual_seed(base_seed & _SEED_MASK)  # type: ignore[union-attr]
        return iter(self._inner)

    def draw(self, k: int, samples_seen: int) -> tuple[Any, Tensor, int, None]:
        assert self.order is not None
        if self._iter is None:
            self._iter = self._load(self.order[k:], self._base_seed)
        batch, item = next(self._iter), self.order[k]
        ids = torch.tensor(item if self.auto_collation else [item], dtype=torch.long)
        return batch, ids, int(ids.numel()), None

    def end(self) -> None:
        self.order = self._iter = None


def _leading_dim(batch: Any) -> Optional[int]:
    """Samples in a batch: the first dimension of its first tensor (a list of scalars: its length)."""
    first = next((x for x in tree_flatten(batch)[0] if isinstance(x, Tensor) and x.dim() > 0), None)
    if first is not None:
        return int(first.shape[0])
    return len(batch) if isinstance(batch, (list, tuple)) and batch else None


class IterSource:
    """Any other iterable: sample ids count the samples read (the first dimension of each batch)."""

    kind = "iterable"

    def __init__(self, iterable: Iterable) -> None:
        self.wrapped, self._iter, self._warned = iterable, None, False
        self.stateful = all(callable(getattr(iterable, n, None)) for n in ("state_dict", "load_state_dict"))

    def num_batches(self) -> Optional[int]:
        return sized_len(self.wrapped)

    def checkpoint(self) -> dict:
        return {}

    def begin(self, epoch: int = 0) -> None:
        self._iter = None

    end = begin  # both start the next pass from the beginning

    def draw(self, k: int, samples_seen: int) -> tuple[Any, Optional[Tensor], int, Any]:
        if self._iter is None:
            self._iter = iter(self.wrapped)
        batch = next(self._iter)
        count = _leading_dim(batch)
        ids = None if count is None else torch.arange(samples_seen, samples_seen + count, dtype=torch.long)
        return batch, ids, int(count or 0), self.wrapped.state_dict() if self.stateful else None  # type: ignore

    def restore(self, epoch: int, state: dict, need_batch: bool) -> Any:
        """A new pass after the saved one's fresh draws; returns the last of them when asked and possible."""
        self._iter, k = None, int(state["fresh"])
        if state["pos"] == 0:
            return None
        if self.stateful and state["wrapped_state"] is not None:
            self.wrapped.load_state_dict(state["wrapped_state"])  # type: ignore[attr-defined]
            self._iter = iter(self.wrapped)
            return None
        if k > 0 and not isinstance(self.wrapped, (list, tuple)) and not self._warned:
            self._warned = True
            warnings.warn(f"LazySamplingLoader: resuming an iterable by reading its first {k} batch(es) again: exact "
                          "only if it yields the same batches on every pass; give a stream state_dict/load_state_dict "
                          "methods to resume it without re-reading.", stacklevel=3)
        self._iter, last = iter(self.wrapped), None
        for _ in range(k):
            last = next(self._iter)
        return last if need_batch else None
