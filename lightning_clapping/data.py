"""Lazy sampling in Lightning's fit loop (``Trainer`` internals through ``_compat``); the engine is in ``lazy/``."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_clapping import _compat
from lightning_clapping.lazy.sampler import BatchInfo, LazySampler, check_settings
from lightning_clapping.shuffle import SharedShuffle

__all__ = ["BatchInfo", "LazySamplingDataModule", "LazySamplingLoader", "find_lazy_loader"]


class LazySamplingLoader(LazySampler):
    """Lazy-sampling view of a train loader: a fresh batch with probability ``p``, else the very objects of the step
    before (do not modify a batch in place). Epochs, ``len()`` and exact resumes: README, "Lazy sampling".

    Args:
        source: a ``torch.utils.data.DataLoader`` (map-style or iterable dataset) or any iterable of batches.
        p: probability of a fresh batch at a step, in (0, 1] (1: ``source`` exactly), or a schedule ``{first_step: p}``.
        seed: seed of the decision stream; every pipeline stage must use the same one.
        num_replicas, replica_rank: data-parallel replicas sharding a map-style ``source``; decisions ignore the rank.
    """

    _trainer_ref: Any = None  # a weak reference to the bound trainer

    def bind_trainer(self, trainer: Any) -> None:
        """Link the loader (weakly) to its trainer before ``fit``: epoch lengths and checkpoints follow the fit loop."""
        try:
            self._trainer_ref = weakref.ref(trainer)
        except TypeError:  # None, or an object without weak references (a test double): unbound
            self._trainer_ref = None

    def _trainer_ready(self) -> Optional[int]:
        trainer = self._trainer_ref and self._trainer_ref()
        return None if trainer is None else _compat.train_batches_ready(trainer)

    def _sync_trainer_length(self, length: int) -> None:  # Lightning reads a loader's length once per setup
        trainer = self._trainer_ref and self._trainer_ref()
        limit = getattr(trainer, "limit_train_batches", None)
        combined = _compat.fit_combined_loader(trainer) if isinstance(limit, float) and limit == 1.0 else None
        if combined is not None and len(combined.flattened) == 1 and _search(combined.flattened[0]) is self:
            if _compat.set_train_epoch_length(trainer, length):
                _compat.rescale_val_check_batch(trainer, length)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_trainer_ref": None}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(p={self.p}, seed={self.seed}, num_replicas={self.num_replicas}, "
                f"replica_rank={self.replica_rank}, source={type(self.source).__name__}, step={self.step}, "
                f"fresh_draws={self.fresh_draws}, distinct_samples={self.distinct_samples})")


class LazySamplingDataModule(LightningDataModule):
    """Lazy sampling around a ``LightningDataModule`` or a train loader: a :class:`LazySamplingLoader` (same arguments)
    over its ``train_dataloader()``; ``setup``, ``state_dict``, hooks it defines and unknown attributes pass through."""

    PASS_THROUGH = ("prepare_data", "teardown", "on_exception", "val_dataloader", "test_dataloader",
                    "predict_dataloader", "transfer_batch_to_device", "on_before_batch_transfer",
                    "on_after_batch_transfer")

    def __init__(self, datamodule_or_train_dataloader: Any, p: float | dict[int, float] = 0.5, seed: int = 0,
                 num_replicas: int = 1, replica_rank: int = 0) -> None:
        super().__init__()
        self.p, self.seed, self.num_replicas, self.replica_rank = check_settings(p, seed, num_replicas, replica_rank)
        wrapped = datamodule_or_train_dataloader
        if isinstance(wrapped, LazySamplingDataModule):
            raise ValueError("The data module is already a LazySamplingDataModule; wrap the inner one instead.")
        if not isinstance(wrapped, (LightningDataModule, Iterable)):
            raise TypeError("LazySamplingDataModule wraps a LightningDataModule or a train DataLoader/iterable, got "
                            f"{type(wrapped).__name__}.")
        self.wrapped = wrapped if isinstance(wrapped, LightningDataModule) else None  # None: a bare loader was given
        self._train_source = wrapped
        self.loader: Optional[LazySamplingLoader] = None  # built by train_dataloader()
        self._loader_state: Optional[dict] = None  # loaded, not yet given to the loader
        if self.wrapped is not None:
            for name in ("prepare_data_per_node", "allow_zero_length_dataloader_with_multiple_devices"):
                setattr(self, name, getattr(wrapped, name))
            for name in self.PASS_THROUGH:  # hooks the wrapped module defines (the others stay undefined here)
                if is_overridden(name, wrapped, LightningDataModule):
                    setattr(self, name, getattr(wrapped, name))

    def __getattr__(self, name: str) -> Any:  # only when normal lookup fails: the wrapped module's attributes
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(wrapped, name)

    def setup(self, stage: str) -> None:
        if self.wrapped is not None:
            self.wrapped.trainer = self.trainer
            self.wrapped.setup(stage)

    def state_dict(self) -> dict[str, Any]:  # the loader's too: the fit loop's copy is restored after len() is read
        state = {"wrapped": self.wrapped.state_dict() if self.wrapped is not None else {}}
        return state if self.loader is None else {**state, "lazy_loader": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.wrapped is not None:
            self.wrapped.load_state_dict(state_dict.get("wrapped", {}))
        self._loader_state = state_dict.get("lazy_loader")  # by train_dataloader(), before Lightning reads len()

    def _inner_loader(self) -> Iterable:  # seeded by a pipeline strategy before a resumed state is loaded into it
        if self.wrapped is not None:
            self.wrapped.trainer = self.trainer
        inner = self._train_source if self.wrapped is None else self.wrapped.train_dataloader()
        strategy = getattr(self.trainer, "strategy", None)
        return strategy.process_dataloader(inner) if isinstance(strategy, SharedShuffle) else inner

    def train_dataloader(self) -> LazySamplingLoader:
        if self.loader is None:
            self.loader = LazySamplingLoader(self._inner_loader(), self.p, self.seed, self.num_replicas,
                                             self.replica_rank)
        elif self.wrapped is not None and getattr(self.trainer, "reload_dataloaders_every_n_epochs", 0):
            self.loader.replace_source(self._inner_loader())
        if self._loader_state is not None:
            self.loader.load_state_dict(self._loader_state)
            self._loader_state = None
        if self.trainer is not None:
            self.loader.bind_trainer(self.trainer)
        return self.loader

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self._train_source).__name__}, p={self.p}, seed={self.seed})"

    __str__ = __repr__


def _search(obj: Any, depth: int = 0) -> Optional[LazySamplingLoader]:
    """The first lazy loader in ``obj``: itself, in its lists/dicts, a CombinedLoader or a strategy's wrapper."""
    for leaf in _compat.tree_flatten(obj)[0]:
        if isinstance(leaf, LazySamplingLoader):
            return leaf
        inner = leaf.flattened if isinstance(leaf, CombinedLoader) else _compat.loader_wrapper_children(leaf)
        if depth < 4 and (found := _search([x for x in inner if x is not None], depth + 1)) is not None:
            return found
    return None


def find_lazy_loader(trainer: Any) -> Optional[LazySamplingLoader]:
    """The :class:`LazySamplingLoader` the trainer trains on (else the data module's), bound to it; or ``None``."""
    found = _search(getattr(trainer, "train_dataloader", None))
    if found is None and isinstance(getattr(trainer, "datamodule", None), LazySamplingDataModule):
        found = trainer.datamodule.loader
    if found is not None:
        found.bind_trainer(trainer)
    return found
