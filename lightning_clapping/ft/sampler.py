"""Each replica group's shard of a map-style training set, and a shard that resumes mid-epoch.

A group trains on ``DistributedSampler(dataset, num_replica_groups, replica_group)`` (shuffled when the loader
shuffled). A group that rejoins in the middle of an epoch skips the batches the others have already taken this
epoch, once, so that every group's epoch still ends at the same step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, RandomSampler, Sampler


class ShardSampler(Sampler[int]):
    """A group's shard (``DistributedSampler``); :meth:`skip_once` drops the first indices of the next pass."""

    def __init__(self, dataset: Any, num_groups: int, group: int, shuffle: bool, seed: int) -> None:
        self.shard = DistributedSampler(dataset, num_replicas=num_groups, rank=group, shuffle=shuffle, seed=seed)
        self._skip = 0

    def skip_once(self, samples: int) -> None:
        self._skip = max(0, int(samples))

    def set_epoch(self, epoch: int) -> None:
        self.shard.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        for i, index in enumerate(self.shard):
            if i >= skip:
                yield index


def shard_loader(loader: Any, num_groups: int, group: int, seed: int) -> ShardSampler:
    """Give a map-style ``DataLoader`` built with ``batch_size`` (its ``BatchSampler`` over a ``RandomSampler`` or
    ``SequentialSampler``) this group's shard; returns the shard's sampler. Raises for other loaders."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

    batches = getattr(loader, "batch_sampler", None)
    if not (isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
            and type(batches) is BatchSampler and isinstance(batches.sampler, (RandomSampler, SequentialSampler))):
        raise ValueError(
            "fault_tolerance shards the training data over the replica groups itself, and can do it for a "
            "DataLoader over a map-style dataset built with batch_size and shuffle=True/False; this train loader is "
            f"{type(loader).__name__} with sampler {type(getattr(batches, 'sampler', None)).__name__}. Use such a "
            "DataLoader, or lightning_clapping.LazySamplingDataModule (which shards and resumes itself)."
        )
    sampler = ShardSampler(loader.dataset, num_groups, group, isinstance(batches.sampler, RandomSampler), seed)
    batches.sampler = sampler  # a BatchSampler reads its sampler at each pass (DataLoader fixes only its own fields)
    return sampler
