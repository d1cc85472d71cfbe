"""Every stage of a pipeline reads the same batches, however the model draws from torch's global RNG on each.

A ``DataLoader`` with ``shuffle=True`` and no ``generator=`` draws each epoch's order (and its workers' base seed)
from the global RNG, which the stages consume differently (dropout with ``freeze_rng=False``, noise drawn in a hook),
so from the second epoch on each stage would read other batches. :class:`SharedShuffle`, Lightning's
``process_dataloader`` hook of the strategy, gives such a loader (or the one a lazy loader wraps) a generator of its
own, seeded alike on every rank: from rank 0's ``torch.initial_seed()`` (Lightning's seed after ``seed_everything``),
agreed once, and the loader's number in the run, so a reloaded loader does not repeat the previous one's orders.

With ``freeze_rng=False`` the loader is left as it is: there every stage ends each step with the last stage's
generator state (:mod:`lightning_clapping.pipeline.streams`), which is the one a single process has at that point, so
the loader draws each epoch's order (and its workers' seed) from the global RNG exactly as one process does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_clapping.lazy.sampler import LazySampler

_SEED_MASK = 0x7FFFFFFFFFFFFFFF


class SharedShuffle:
    """Mixin of the strategy (which has ``root_device``): samplers drawing from the global RNG get a shared one."""

    _shuffle_seed: int | None = None
    _shuffled_loaders = 0

    def process_dataloader(self, dataloader: object) -> object:
        """Give ``dataloader`` (or the loader a lazy loader wraps) a generator seeded alike on every rank, when it has
        none: its sampler and its workers' seeds then draw from it."""
        if not self.options.freeze_rng:  # type: ignore[attr-defined]  # the stages' streams agree (see above)
            return dataloader
        if self._shuffle_seed is None:  # every rank comes here at the same points: agree on rank 0's seed once
            seed = torch.tensor(torch.initial_seed() & _SEED_MASK, device=self.root_device)  # type: ignore
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(seed, src=0)
            self._shuffle_seed = int(seed)
        loader = dataloader.source if isinstance(dataloader, LazySampler) else dataloader
        if isinstance(loader, DataLoader) and loader.generator is None:
            self._shuffled_loaders += 1
            loader.generator = torch.Generator().manual_seed(
                (self._shuffle_seed + 0x9E3779B97F4A7C15 * self._shuffled_loaders) & _SEED_MASK)
            for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
                if getattr(sampler, "generator", False) is None:  # RandomSampler, SubsetRandomSampler, ...
                    sampler.generator = loader.generator
        return dataloader
