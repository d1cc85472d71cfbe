"""Lazy sampling as a Lightning data component: :class:`LazySamplingDataModule`, :class:`LazySamplingLoader`,
:func:`find_lazy_loader`. All that talks to a ``Trainer`` is here (its private parts through ``_compat``); the
Lightning-free engine is :mod:`lightning_clapping.lazy`.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_clapping import _compat
from lightning_clapping.lazy.sampler import BatchInfo, LazySampler
from lightning_clapping.shuffle import SharedShuffle

__all__ = ["BatchInfo", "LazySamplingDataModule", "LazySamplingLoader", "find_lazy_loader"]


def _check_settings(p: Any, seed: Any, num_replicas: Any, replica_rank: Any) -> tuple[float, int, int, int]:
    def is_int(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not (isinstance(p, numbers.Real) and not isinstance(p, bool) and math.isfinite(p) and 0.0 < p <= 1.0):
        raise ValueError(
            f"p must be a number in the range (0, 1]: it is the probability of drawing a fresh mini-batch at each "
            f"training step (p = 1 draws a fresh batch every step, i.e. no reuse; smaller p reuses each batch for "
            f"1/p steps on average). Got p={p!r}.")
    if not is_int(seed):
        raise ValueError(f"seed must be an int (shared by all pipeline stages), got {seed!r}.")
    if not is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    if not is_int(replica_rank) or not 0 <= replica_rank < num_replicas:
        raise ValueError(f"replica_rank must be an int in [0, num_replicas={num_replicas}), got {replica_rank!r}.")
    return float(p), int(seed), int(num_replicas), int(replica_rank)


def _no_trainer() -> None:
    """The trainer of an unbound loader (a module function, so that a pickled loader keeps it)."""


class LazySamplingLoader(LazySampler):
    """Lazy-sampling view of a train loader: a fresh batch with probability ``p``, else the previous batch again.

    Args:
        source: a ``torch.utils.data.DataLoader`` (map-style or iterable dataset) or any iterable of batches.
        p: probability of a fresh batch at a step, in (0, 1]; ``p = 1`` reproduces ``source`` exactly.
        seed: seed of the decision stream; every pipeline stage must use the same one.
        num_replicas, replica_rank: data-parallel replicas. With ``num_replicas > 1`` a map-style ``source`` is
            sharded like ``DistributedSampler(shuffle=<source shuffles>, seed=seed)``; decisions ignore the rank.

    An epoch's first step is fresh; step t is fresh when ``u(seed, t) < p``. A reused step yields the very same
    objects as the step before (do not modify a batch in place). An epoch is one pass of the source by fresh draws:
    it ends at the first fresh decision that finds the source exhausted. ``len()`` is the exact number of steps of
    the current (between epochs: the next) epoch; a loader bound to a fitting trainer sets the fit loop's batch count
    at each epoch's first step. ``batch_info(batch_idx)`` is the :class:`BatchInfo` of the batch ``training_step``
    gets with that ``batch_idx``; sample ids are dataset indices for a map-style ``DataLoader`` (the order of each
    epoch is drawn as ``DataLoader.__iter__`` would and loaded by an inner DataLoader built alike) and count the
    samples read for iterables (a stream is read only at fresh steps).

    Resume: ``state_dict()`` (which Lightning stores with the fit loop) is taken at the batch the bound trainer has
    consumed (a bare loader given to ``Trainer.fit`` needs ``bind_trainer(trainer)``), so a run resumed mid-epoch,
    even mid-window, repeats the uninterrupted one. The batch to reuse is saved when it holds only tensors, numbers
    and strings in lists/tuples/dicts, else rebuilt from its indices or by reading an iterable again; an order is
    redrawn from saved RNG states (shuffling with the global RNG, later epochs do not repeat: pass a seeded
    ``generator=``, as the pipeline strategy does); iterables with ``state_dict``/``load_state_dict`` are restored
    through them. Warnings say when a resume cannot be exact.
    """

    def __init__(self, source: Iterable, p: float = 0.5, seed: int = 0, num_replicas: int = 1,
                 replica_rank: int = 0) -> None:
        settings = _check_settings(p, seed, num_replicas, replica_rank)
        if isinstance(source, LazySamplingLoader):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        super().__init__(source, *settings)
        self._trainer_ref: Any = _no_trainer
        self._warned_sync = False

    def bind_trainer(self, trainer: Any) -> None:
        """Link the loader (weakly) to the trainer that trains on it, before ``fit``: it then checkpoints the batch the
        trainer has consumed, maps its ``batch_idx`` after a resume and tells it each epoch's length."""
        try:
            self._trainer_ref = weakref.ref(trainer)
        except TypeError:  # None, or an object without weak references (a test double): unbound
            self._trainer_ref = _no_trainer

    def _fitting_trainer(self) -> Any:
        trainer = self._trainer_ref()
        return trainer if getattr(getattr(trainer, "state", None), "fn", None) == "fit" else None

    def _trainer_ready(self) -> Optional[int]:
        trainer = self._fitting_trainer()
        return None if trainer is None else _compat.train_batches_ready(trainer)

    def _sync_trainer_length(self, length: int) -> None:
        """Lightning reads a train loader's length once: set the fit loop's batch count (and a fraction's
        ``val_check_batch``) to this epoch's, unless ``limit_train_batches`` is set or loaders are combined."""
        trainer = self._fitting_trainer()
        limit = getattr(trainer, "limit_train_batches", None)
        if not (isinstance(limit, float) and limit == 1.0):
            return
        try:
            combined = _compat.fit_combined_loader(trainer)
            if combined is not None and len(combined.flattened) == 1 and _search(combined.flattened[0]) is self:
                if _compat.set_train_epoch_length(trainer, length):
                    _compat.rescale_val_check_batch(trainer, length)
        except Exception as err:  # pragma: no cover - only on an incompatible Lightning
            if not self._warned_sync:
                self._warned_sync = True
                rank_zero_warn(f"LazySamplingLoader: could not update Lightning's epoch length ({err!r}); epochs "
                               "longer than the first may be cut short. Trainer(reload_dataloaders_every_n_epochs=1) "
                               "works around it.")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_trainer_ref": _no_trainer}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(p={self.p}, seed={self.seed}, num_replicas={self.num_replicas}, "
                f"replica_rank={self.replica_rank}, source={type(self.source).__name__}, step={self.step}, "
                f"fresh_draws={self.fresh_draws}, distinct_samples={self.distinct_samples})")


class LazySamplingDataModule(LightningDataModule):
    """Lazy sampling around a ``LightningDataModule`` (or a bare train DataLoader / iterable).

    ``p``, ``seed``, ``num_replicas`` and ``replica_rank`` are those of :class:`LazySamplingLoader`; ``p = 1`` is
    exactly the wrapped module. ``train_dataloader()`` returns one :class:`LazySamplingLoader` over the wrapped
    ``train_dataloader()``, bound to the trainer (with ``reload_dataloaders_every_n_epochs`` it draws from the new
    loader from the next epoch on). ``setup``, ``state_dict``/``load_state_dict`` and the hooks the wrapped module
    defines go to it, and unknown attributes are looked up on it. This module's ``state_dict`` keeps the loader's
    state too: Lightning restores data modules before it reads the train loader's length, the fit loop's copy after.
    """

    #: hooks of the wrapped module that stay undefined here unless it defines them
    PASS_THROUGH = ("prepare_data", "teardown", "on_exception", "val_dataloader", "test_dataloader",
                    "predict_dataloader", "transfer_batch_to_device", "on_before_batch_transfer",
                    "on_after_batch_transfer")

    def __init__(self, datamodule_or_train_dataloader: Any, p: float = 0.5, seed: int = 0, num_replicas: int = 1,
                 replica_rank: int = 0) -> None:
        super().__init__()
        self.p, self.seed, self.num_replicas, self.replica_rank = _check_settings(p, seed, num_replicas, replica_rank)
        wrapped = datamodule_or_train_dataloader
        if isinstance(wrapped, LazySamplingDataModule):
            raise ValueError("The data module is already a LazySamplingDataModule; wrap the inner one instead.")
        if not isinstance(wrapped, (LightningDataModule, Iterable)):
            raise TypeError("LazySamplingDataModule wraps a LightningDataModule or a train DataLoader/iterable, got "
                            f"{type(wrapped).__name__}.")
        self.wrapped = wrapped if isinstance(wrapped, LightningDataModule) else None  # None: a bare loader was given
        self._train_source = wrapped
        self.loader: Optional[LazySamplingLoader] = None  # built by train_dataloader()
        self._loader_state: Optional[dict] = None  # loaded before the loader existed
        if self.wrapped is not None:
            self.prepare_data_per_node = wrapped.prepare_data_per_node
            self.allow_zero_length_dataloader_with_multiple_devices = (
                wrapped.allow_zero_length_dataloader_with_multiple_devices)
            for name in self.PASS_THROUGH:
                if is_overridden(name, wrapped, LightningDataModule):
                    setattr(self, name, getattr(wrapped, name))

    def __getattr__(self, name: str) -> Any:  # only when normal lookup fails: the wrapped module's attributes
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(wrapped, name)

    def _share_trainer(self) -> None:
        if self.wrapped is not None and self.trainer is not None:
            self.wrapped.trainer = self.trainer

    def setup(self, stage: str) -> None:
        self._share_trainer()
        if self.wrapped is not None:
            self.wrapped.setup(stage)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"wrapped": self.wrapped.state_dict() if self.wrapped is not None else {}}
        if self.loader is not None:
            state["lazy_loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.wrapped is not None:
            self.wrapped.load_state_dict(state_dict.get("wrapped", {}))
        self._loader_state = state_dict.get("lazy_loader")  # applied now, so len() of the resumed epoch is right
        if self.loader is not None and self._loader_state is not None:
            self.loader.load_state_dict(self._loader_state)
            self._loader_state = None

    def _inner_loader(self) -> Iterable:
        """The wrapped train loader, seeded by a pipeline strategy before a resume's state is loaded into it."""
        self._share_trainer()
        inner = self._train_source if self.wrapped is None else self.wrapped.train_dataloader()
        strategy = getattr(self.trainer, "strategy", None)
        return strategy.process_dataloader(inner) if isinstance(strategy, SharedShuffle) else inner

    def train_dataloader(self) -> LazySamplingLoader:
        trainer = self.trainer
        if self.loader is None:
            self.loader = LazySamplingLoader(self._inner_loader(), self.p, self.seed, self.num_replicas,
                                             self.replica_rank)
            if self._loader_state is not None:
                self.loader.load_state_dict(self._loader_state)
                self._loader_state = None
        elif self.wrapped is not None and getattr(trainer, "reload_dataloaders_every_n_epochs", 0):
            self.loader.replace_source(self._inner_loader())
        if trainer is not None:
            self.loader.bind_trainer(trainer)
        return self.loader

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self._train_source).__name__}, p={self.p}, seed={self.seed})"

    __str__ = __repr__


def _search(obj: Any, depth: int = 0) -> Optional[LazySamplingLoader]:
    if isinstance(obj, LazySamplingLoader):
        return obj
    if obj is None or depth > 6 or isinstance(obj, (str, bytes, Tensor)):
        return None
    if isinstance(obj, CombinedLoader):
        children: Iterable = obj.flattened
    elif isinstance(obj, (Mapping, list, tuple)):
        children = obj.values() if isinstance(obj, Mapping) else obj
    else:  # a strategy may wrap the loader in its own object
        children = _compat.loader_wrapper_children(obj)
    return next((found for child in children if (found := _search(child, depth + 1)) is not None), None)


def find_lazy_loader(trainer: Any) -> Optional[LazySamplingLoader]:
    """The :class:`LazySamplingLoader` the trainer trains on, or ``None``: in ``trainer.train_dataloader`` (itself or
    inside a list/dict/CombinedLoader), the fit loop's loader, or ``trainer.datamodule``'s. It is bound to the
    trainer, so its checkpoints account for Lightning's prefetching."""
    try:
        found = _search(getattr(trainer, "train_dataloader", None))
    except Exception:
        found = None
    if found is None:
        try:
            found = _search(_compat.fit_combined_loader(trainer))
        except AttributeError:  # not a Lightning trainer
            found = None
    if found is None and isinstance(getattr(trainer, "datamodule", None), LazySamplingDataModule):
        found = trainer.datamodule.loader
    if found is not None and found._trainer_ref() is not trainer:
        found.bind_trainer(trainer)
    return found
