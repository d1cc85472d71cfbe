"""Where the lazy loader's fresh batches come from, and how a source gets back to a saved position.

* :class:`MapSource`: a torch ``DataLoader`` over a map-style dataset with a sized index sampler. It draws each pass's
  index order itself, the way ``DataLoader.__iter__`` would (so p = 1 gives the same batches), and feeds it to an inner
  DataLoader with the same dataset, collate_fn, workers and pinning: every batch looks as before and its dataset
  indices are known. A checkpoint redraws the order from the RNG states it was drawn from.
* :class:`IterSource`: any other iterable (a stream, a list of batches, a generator). Batches are pulled one at a time,
  only on fresh decisions; a resume goes through the iterable's own ``state_dict``/``load_state_dict`` or re-reads it.

Both answer ``num_batches()``, ``begin(epoch)``, ``draw(k, samples_seen)`` (the pass's k-th batch: batch, sample ids,
sample count, the iterable's state), ``entry()`` (what a checkpoint of the pass keeps), ``restore(epoch, entry)`` (at
``load_state_dict``), ``seek(k, ids, wrapped_state, need_batch)`` (at the first step after it: go on after k batches,
and rebuild the batch to reuse when asked), ``end()`` and, for a pass not begun yet, ``capture_rng()``,
``apply_generator_states(saved)`` and ``uses_global_rng()``.
"""

from __future__ import annotations

import warnings
import zlib
from array import array
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler
from torch.utils.data import SequentialSampler

_SEED_MASK = 0x7FFFFFFFFFFFFFFF


def sized_len(obj: object) -> Optional[int]:
    """``len(obj)``, or None when it has no length."""
    try:
        return int(len(obj))  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def make_source(source: Iterable, num_replicas: int, replica_rank: int, seed: int) -> "MapSource | IterSource":
    """Map-style when ``source`` is a DataLoader over a map dataset with a sized index sampler, else iterable."""
    if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset) and sized_len(
            source.batch_sampler if source.batch_sampler is not None else source.sampler) is not None:
        return MapSource(source, num_replicas, replica_rank, seed)
    if num_replicas > 1:
        raise ValueError("num_replicas > 1 can only shard a torch DataLoader over a map-style dataset; shard an "
                         "iterable source yourself (each replica reading its own stream) and keep num_replicas=1.")
    return IterSource(source)


def _fingerprint(order: list) -> int:
    """A checksum of a pass's index order, to tell whether a resume redrew the same one."""
    flat = array("q", [int(i) for item in order for i in (item if isinstance(item, list) else [item])])
    sizes = array("q", [len(item) if isinstance(item, list) else -1 for item in order])
    return (zlib.crc32(sizes.tobytes()) << 32) | zlib.crc32(flat.tobytes(), len(order))


class _Feed:
    """Index sampler of the inner DataLoader: the index batches it is to load in this pass (set per pass)."""

    def __init__(self) -> None:
        self.batches: list = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class MapSource:
    """A torch ``DataLoader`` over a map-style dataset; with ``num_replicas > 1`` sharded like ``DistributedSampler``."""

    kind = "map"

    def __init__(self, loader: DataLoader, num_replicas: int, replica_rank: int, seed: int) -> None:
        self.wrapped = loader
        self.auto_collation = loader.batch_sampler is not None
        self.base_drawn = False  # with persistent workers a DataLoader draws its workers' base seed only once
        self.order: Optional[list] = None  # the running pass's index batches (or indices), in order
        self._entry: dict = {}
        self._feed, self._inner, self._iter = _Feed(), None, None
        self._sharded: Optional[BatchSampler] = None
        if num_replicas > 1:
            if not self.auto_collation or loader.batch_size is None:
                raise ValueError(
                    "num_replicas > 1 shards a DataLoader built with batch_size/shuffle/drop_last; this one uses a "
                    "custom batch_sampler or batch_size=None. Shard the data yourself and keep num_replicas=1.")
            if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
                raise ValueError(
                    "num_replicas > 1 needs a DataLoader with a RandomSampler (shuffle=True) or a SequentialSampler "
                    f"(shuffle=False), got {type(loader.sampler).__name__}. Shard the data yourself and keep "
                    "num_replicas=1.")
            shards = DistributedSampler(loader.dataset, num_replicas, replica_rank, seed=seed, drop_last=False,
                                        shuffle=isinstance(loader.sampler, RandomSampler))
            self._sharded = BatchSampler(shards, loader.batch_size, loader.drop_last)

    def _index_sampler(self) -> Any:
        if self._sharded is not None:
            return self._sharded
        return self.wrapped.batch_sampler if self.auto_collation else self.wrapped.sampler

    def num_batches(self) -> Optional[int]:
        return len(self.order) if self.order is not None else sized_len(self._index_sampler())

    # -- the RNG states an order is drawn from -----------------------------------------------------------------------

    def _generators(self) -> list:
        loader = self.wrapped
        found = (loader.generator, getattr(loader.sampler, "generator", None),
                 getattr(getattr(loader.batch_sampler, "sampler", None), "generator", None))
        return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())

    def uses_global_rng(self) -> bool:
        sampler = self.wrapped.sampler
        return self._sharded is None and isinstance(sampler, RandomSampler) and sampler.generator is None

    def capture_rng(self) -> Optional[dict]:
        if self._sharded is not None:
            return None  # the shards' order is a function of (seed, epoch)
        return {"global": torch.get_rng_state(), "gens": [g.get_state() for g in self._generators()]}

    def apply_generator_states(self, saved: Optional[dict]) -> None:
        gens = self._generators()
        if saved and len(gens) == len(saved["gens"]):
            for generator, state in zip(gens, saved["gens"]):
                generator.set_state(state)

    # -- a pass's order ----------------------------------------------------------------------------------------------

    def begin(self, epoch: int) -> None:
        persistent = self.wrapped.num_workers > 0 and self.wrapped.persistent_workers
        self._draw_order(epoch, self.capture_rng(), drew_base=not (persistent and self.base_drawn))

    def _draw_order(self, epoch: int, order_rng: Optional[dict], drew_base: bool) -> None:
        loader = self.wrapped
        if self._sharded is not None:
            self._sharded.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            order, base_seed = [list(b) for b in self._sharded], (epoch * 0x9E3779B1 + 12345) & _SEED_MASK
        else:
            samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
            for sampler in {id(s): s for s in samplers if callable(getattr(s, "set_epoch", None))}.values():
                sampler.set_epoch(epoch)  # what Lightning does for a train DataLoader it owns
            indices = iter(self._index_sampler())
            # DataLoader.__iter__ draws its workers' base seed right after creating the sampler iterator (before the
            # sampler runs): doing the same keeps the shuffle identical to iterating the wrapped loader.
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()) \
                if drew_base else 0
            order = [list(b) if self.auto_collation else int(b) for b in indices]
        self.base_drawn = self.base_drawn or drew_base
        self.order, self._base_seed, self._iter = order, base_seed, None
        self._entry = {"order_rng": order_rng, "fingerprint": _fingerprint(order), "drew_base": drew_base}

    def entry(self) -> dict:
        return self._entry

    def restore(self, epoch: int, entry: dict) -> None:
        """Redraw a checkpointed pass's order from the RNG states it was drawn from (warns when it differs)."""
        order_rng, global_before = entry.get("order_rng"), torch.get_rng_state()
        try:
            if order_rng is not None:
                torch.set_rng_state(order_rng["global"])
                self.apply_generator_states(order_rng)
            self._draw_order(epoch, order_rng, bool(entry.get("drew_base", True)))
        finally:
            torch.set_rng_state(global_before)  # the trainer's global RNG is not part of the data state
        expected = entry.get("fingerprint")
        if expected is not None and int(expected) != self._entry["fingerprint"]:
            warnings.warn(
                "LazySamplingLoader: exact resume is impossible: the wrapped DataLoader's sample order for epoch "
                f"{epoch} could not be reproduced from the checkpoint, so the rest of this epoch will not use the same "
                "batches as the uninterrupted run. Exact resume needs an index order that depends only on torch "
                "generators: e.g. DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(s)) or the "
                "default RandomSampler/SequentialSampler; custom samplers must not use other randomness.",
                RuntimeWarning, stacklevel=2)

    def seek(self, k: int, ids: Optional[Tensor], wrapped_state: Any, need_batch: bool) -> Any:
        """The order was redrawn by :meth:`restore` and :meth:`draw` starts at the k-th batch: rebuild the reused
        batch from its indices when asked."""
        return self.fetch(ids) if need_batch and ids is not None else None

    # -- drawing -----------------------------------------------------------------------------------------------------

    def _inner_loader(self) -> DataLoader:
        if self._inner is None:
            loader = self.wrapped
            kwargs: dict[str, Any] = dict(
                num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=torch.Generator(),
                multiprocessing_context=loader.multiprocessing_context, persistent_workers=loader.persistent_workers)
            if loader.num_workers > 0:
                kwargs["prefetch_factor"] = loader.prefetch_factor
            if getattr(loader, "pin_memory_device", ""):
                kwargs["pin_memory_device"] = loader.pin_memory_device
            if hasattr(loader, "in_order"):
                kwargs["in_order"] = True  # the k-th batch received must be the k-th index batch handed out
            if self.auto_collation:
                self._inner = DataLoader(loader.dataset, batch_sampler=self._feed, **kwargs)
            else:
                self._inner = DataLoader(loader.dataset, batch_size=None, sampler=self._feed, **kwargs)
        return self._inner

    def draw(self, k: int, samples_seen: int) -> tuple[Any, Tensor, int, None]:
        assert self.order is not None
        if self._iter is None:
            inner = self._inner_loader()
            self._feed.batches = self.order[k:]
            inner.generator.manual_seed(self._base_seed & _SEED_MASK)  # type: ignore[union-attr]
            self._iter = iter(inner)
        batch = next(self._iter)
        item = self.order[k]
        ids = torch.tensor(item if self.auto_collation else [item], dtype=torch.long)
        return batch, ids, int(ids.numel()), None

    def fetch(self, ids: Tensor) -> Any:
        """A batch rebuilt from its indices (on resume, when the checkpoint does not hold the batch itself)."""
        idx, dataset, collate = [int(i) for i in ids.tolist()], self.wrapped.dataset, self.wrapped.collate_fn
        if not self.auto_collation:
            return collate(dataset[idx[0]])
        getitems = getattr(dataset, "__getitems__", None)
        return collate(getitems(idx) if callable(getitems) else [dataset[i] for i in idx])

    def end(self) -> None:
        self.order = self._iter = None


def _leading_dim(batch: Any) -> Optional[int]:
    """Samples in a batch: the first dimension of its first tensor, breadth first (a list of scalars: its length)."""
    queue = [batch]
    for obj in queue:  # grows while it is read
        if isinstance(obj, Tensor):
            if obj.dim() > 0:
                return int(obj.shape[0])
        elif isinstance(obj, Mapping):
            queue.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            if obj and not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in obj):
                return len(obj)
            queue.extend(obj)
    return None


class IterSource:
    """Any other iterable; its sample ids are a running count of the samples read (first dimension of a batch)."""

    kind = "iterable"
    base_drawn = False

    def __init__(self, iterable: Iterable) -> None:
        self.wrapped = iterable
        self.stateful = all(callable(getattr(iterable, n, None)) for n in ("state_dict", "load_state_dict"))
        self._iter: Any = None
        self._warned_replay = False

    def num_batches(self) -> Optional[int]:
        return sized_len(self.wrapped)

    def uses_global_rng(self) -> bool:
        return False

    def capture_rng(self) -> None:
        return None

    def apply_generator_states(self, saved: Any) -> None:
        pass

    def begin(self, epoch: int) -> None:
        self._iter = None

    def entry(self) -> dict:
        return {"order_rng": None, "fingerprint": None, "drew_base": False}

    def restore(self, epoch: int, entry: dict) -> None:
        pass  # the iterable is repositioned at the first step (seek)

    def draw(self, k: int, samples_seen: int) -> tuple[Any, Optional[Tensor], int, Any]:
        if self._iter is None:
            self._iter = iter(self.wrapped)
        batch = next(self._iter)
        count = _leading_dim(batch)
        ids = None if count is None else torch.arange(samples_seen, samples_seen + count, dtype=torch.long)
        return batch, ids, int(count or 0), self.wrapped.state_dict() if self.stateful else None  # type: ignore

    def seek(self, k: int, ids: Optional[Tensor], wrapped_state: Any, need_batch: bool) -> Any:
        """A new iterator after the pass's first ``k`` batches; with the last of them when asked and possible."""
        if self.stateful and wrapped_state is not None:
            self.wrapped.load_state_dict(wrapped_state)  # type: ignore[attr-defined]
            self._iter = iter(self.wrapped)
            return None
        self._iter = iter(self.wrapped)
        if k > 0 and not isinstance(self.wrapped, (list, tuple)) and not self._warned_replay:
            self._warned_replay = True
            warnings.warn(
                f"LazySamplingLoader: resuming an iterable source by reading its first {k} batch(es) again. This is "
                "exact only if the source yields the same batches in the same order on every pass; give an online "
                "stream `state_dict`/`load_state_dict` methods to resume it without re-reading.", stacklevel=2)
        last = None
        for _ in range(k):
            last = next(self._iter)
        return last if need_batch else None

    def end(self) -> None:
        self._iter = None
