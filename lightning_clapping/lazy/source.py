"""Where fresh batches come from: ``draw(k, samples_seen)`` is the k-th batch of a pass of the wrapped loader."""

from __future__ import annotations

import warnings
import zlib
from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import Any, Optional

import torch
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
        self._entry, self._feed = {}, []  # the pass's checkpoint entry; what the inner DataLoader still loads
        self._inner, self._iter, self._warned = None, None, False
        self._indices = loader.batch_sampler if self.auto_collation else sampler
        self._sharded = num_replicas > 1
        if self._sharded:
            if loader.batch_size is None or not isinstance(sampler, (RandomSampler, SequentialSampler)):
                raise ValueError(f"num_replicas > 1 shards a DataLoader built with batch_size, shuffle and drop_last, "
                                 f"got sampler={type(sampler).__name__}, batch_size={loader.batch_size}. Shard the "
                                 "data yourself and keep num_replicas=1.")
            shards = DistributedSampler(loader.dataset, num_replicas, replica_rank, seed=seed, drop_last=False,
                                        shuffle=isinstance(sampler, RandomSampler))
            self._indices = BatchSampler(shards, loader.batch_size, loader.drop_last)

    def num_batches(self) -> Optional[int]:
        return len(self.order) if self.order is not None else sized_len(self._indices)

    def _generators(self) -> list:  # looked up when used: a strategy may give the loader one after it was wrapped
        found = (self.wrapped.generator, getattr(self.wrapped.sampler, "generator", None),
                 getattr(getattr(self.wrapped.batch_sampler, "sampler", None), "generator", None))
        return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())

    def _rng_states(self) -> Optional[dict]:  # what an order is drawn from now (sharded: from seed and epoch)
        return None if self._sharded else {"global": torch.get_rng_state(),
                                           "gens": [g.get_state() for g in self._generators()]}

    def begin(self, epoch: int) -> None:
        persistent = self.wrapped.num_workers > 0 and self.wrapped.persistent_workers
        self._draw_order(epoch, self._rng_states(), drew_base=not (persistent and self.base_drawn))

    def _draw_order(self, epoch: int, order_rng: Optional[dict], drew_base: bool) -> None:
        samplers = (getattr(self._indices, "sampler", None), self.wrapped.sampler)
        for sampler in {id(s): s for s in samplers if callable(getattr(s, "set_epoch", None))}.values():
            sampler.set_epoch(epoch)  # what Lightning does for a train DataLoader it owns
        indices = iter(self._indices)
        # DataLoader.__iter__ draws its workers' base seed after creating the sampler iterator, before the sampler
        # runs: in that order the shuffle is the one iterating the wrapped loader gives (sharded: seed and epoch's)
        base_seed = (epoch * 0x9E3779B1 + 12345) & _SEED_MASK if self._sharded else 0
        if drew_base and not self._sharded:
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.wrapped.generator))
        order = [list(b) if self.auto_collation else int(b) for b in indices]
        self.base_drawn = self.base_drawn or drew_base
        self.order, self._base_seed, self._iter = order, base_seed, None
        self._entry = {"order_rng": order_rng, "fingerprint": zlib.crc32(repr(order).encode()), "drew_base": drew_base}

    def checkpoint(self) -> dict:  # the RNG states the running (else the next) pass's order is drawn from
        entry = self._entry if self.order is not None else {"order_rng": self._rng_states()}
        return {**entry, "base_drawn": self.base_drawn}

    def restore(self, epoch: int, state: dict, need_batch: bool) -> Any:
        """Set the generators, or redraw the running pass's order; returns the batch to reuse when asked."""
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
            warnings.warn(f"LazySamplingLoader: exact resume is impossible: the sample order of epoch {epoch} could not"
                          " be redrawn from the checkpoint. It must come from torch generators only (e.g. shuffle=True "
                          "with generator=torch.Generator().manual_seed(s)).", RuntimeWarning, 3)
        if not need_batch or state["ids"] is None:
            return None
        ids = [int(i) for i in state["ids"].tolist()]
        return next(self._load([ids] if self.auto_collation else ids))

    def _load(self, items: list) -> Iterable:  # the batches of these index batches, loaded as the wrapped loader would
        if self._inner is None:
            kwargs = {name: getattr(self.wrapped, name) for name in _INNER_LOADER_ARGS if hasattr(self.wrapped, name)}
            if hasattr(self.wrapped, "in_order"):
                kwargs["in_order"] = True  # the k-th batch received must be the k-th index batch handed out
            feed = {"batch_sampler": self._feed} if self.auto_collation else {"batch_size": None, "sampler": self._feed}
            self._inner = DataLoader(self.wrapped.dataset, generator=torch.Generator(), **feed, **kwargs)
        self._feed[:] = items
        self._inner.generator.manual_seed(self._base_seed & _SEED_MASK)  # type: ignore[union-attr]
        return iter(self._inner)

    def draw(self, k: int, samples_seen: int) -> tuple[Any, torch.Tensor, int, None]:
        if self._iter is None:
            self._iter = self._load(self.order[k:])
        batch, item = next(self._iter), self.order[k]
        ids = torch.tensor(item if self.auto_collation else [item], dtype=torch.long)
        return batch, ids, int(ids.numel()), None

    def end(self) -> None:
        self.order = self._iter = None


class IterSource:
    """Any other iterable: sample ids count the samples read; a resume uses its ``state_dict`` or reads it again."""

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

    def draw(self, k: int, samples_seen: int) -> tuple[Any, Optional[torch.Tensor], int, Any]:
        if (n := self.num_batches()) is not None and k >= n:
            raise StopIteration  # a sized iterable yielding more than len() batches: len() stays exact
        if self._iter is None:
            self._iter = iter(self.wrapped)
        batch = next(self._iter)
        first = next((x for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        count = int(first.shape[0]) if first is not None else len(batch) if isinstance(batch, (list, tuple)) else None
        ids = None if count is None else torch.arange(samples_seen, samples_seen + count, dtype=torch.long)
        return batch, ids, int(count or 0), self.wrapped.state_dict() if self.stateful else None  # type: ignore

    def restore(self, epoch: int, state: dict, need_batch: bool) -> Any:
        """A new pass after the saved one's fresh draws; returns the last of them when asked and possible."""
        self._iter, k = None, int(state["fresh"])
        if state["pos"] == 0:
            return None
        if self.stateful and state["wrapped_state"] is not None:
            self.wrapped.load_state_dict(state["wrapped_state"])  # type: ignore[attr-defined]
            k = 0  # the iterable goes on after the saved batch (kept in the checkpoint when plain)
        elif k > 0 and not isinstance(self.wrapped, (list, tuple)) and not self._warned:
            self._warned = True
            warnings.warn(f"LazySamplingLoader: resuming an iterable by reading its first {k} batch(es) again: exact "
                          "only if every pass yields the same batches (else give it state_dict/load_state_dict).",
                          stacklevel=3)
        self._iter = iter(self.wrapped)
        last = deque(islice(self._iter, k), maxlen=1)
        return last[0] if need_batch and last else None
