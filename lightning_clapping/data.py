"""Lazy sampling for Clapping, as a Lightning data component.

At every training step a fresh mini-batch is drawn with probability ``p``, otherwise the previous one is handed out
again, unchanged. Each pipeline stage runs in its own process with the same ``seed``; decisions depend only on
``(seed, step)``, so all stages agree without talking. Public: :class:`LazySamplingDataModule`,
:class:`LazySamplingLoader`, :class:`BatchInfo`, :func:`find_lazy_loader`. This module holds all that talks to a
``Trainer`` (its private parts through ``_compat``); the Lightning-free engine is :mod:`lightning_clapping.lazy`.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_clapping import _compat
from lightning_clapping.lazy.sampler import BatchInfo, LazySampler

__all__ = ["BatchInfo", "LazySamplingDataModule", "LazySamplingLoader", "find_lazy_loader"]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_settings(p: Any, seed: Any, num_replicas: Any, replica_rank: Any) -> tuple[float, int, int, int]:
    """The validated ``(p, seed, num_replicas, replica_rank)`` shared by the loader and the data module."""
    if not (isinstance(p, numbers.Real) and not isinstance(p, bool) and math.isfinite(p) and 0.0 < p <= 1.0):
        raise ValueError(
            f"p must be a number in the range (0, 1]: it is the probability of drawing a fresh mini-batch at each "
            f"training step (p = 1 draws a fresh batch every step, i.e. no reuse; smaller p reuses each batch for "
            f"1/p steps on average). Got p={p!r}.")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int (shared by all pipeline stages), got {seed!r}.")
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    if not _is_int(replica_rank) or not 0 <= replica_rank < num_replicas:
        raise ValueError(f"replica_rank must be an int in [0, num_replicas={num_replicas}), got {replica_rank!r}.")
    return float(p), int(seed), int(num_replicas), int(replica_rank)


def _no_trainer() -> None:
    """The trainer of an unbound loader (a module function, so that a pickled loader keeps it)."""


class LazySamplingLoader(LazySampler):
    """Lazy-sampling view of a train loader: fresh batch with probability ``p``, else the previous batch again.

    Args:
        source: a ``torch.utils.data.DataLoader`` (map-style or iterable dataset) or any iterable of batches.
        p: probability of a fresh batch at a step, in (0, 1]; ``p = 1`` reproduces ``source`` exactly.
        seed: seed of the decision stream; every pipeline stage must use the same one.
        num_replicas, replica_rank: data-parallel replicas. With ``num_replicas > 1`` a map-style ``source`` is
            sharded like ``DistributedSampler(shuffle=<source shuffles>, seed=seed)``; decisions ignore the rank.

    Step t is fresh when it opens an epoch (so r_0 = 1) or when ``u(seed, t) < p`` (counter-based, so processes agree).
    A reused step yields the very same objects as the step before (split, order and shapes stay; a ragged last batch
    only comes at a fresh step): do not modify a batch in place. An epoch is one pass of the source by fresh draws; it
    ends at the first fresh decision that finds the source exhausted, which opens the next epoch. With a sized source
    ``len()`` is the exact number of steps of the current (between epochs: the next) epoch; lengths vary, so a loader
    bound to a fitting trainer sets the fit loop's batch count at each epoch's first step. An epoch that Lightning
    stops early (``limit_train_batches``) is dropped at the next ``iter()``.

    ``batch_info(batch_idx)`` is the :class:`BatchInfo` of the batch ``training_step`` gets with that ``batch_idx``
    (also with Lightning's prefetching and after a resume). Sample ids of a map-style ``DataLoader`` are dataset
    indices: each epoch's index order is drawn when it begins, as ``DataLoader.__iter__`` would, and loaded by an inner
    DataLoader built like the wrapped one (with workers the batches are the same but the workers' seeds differ). For
    iterables the ids count the samples read; a stream is read only at fresh steps.

    Resume: Lightning stores ``state_dict()`` with the fit loop (and :class:`LazySamplingDataModule` keeps a copy), so
    a run resumed with ``ckpt_path=`` mid-epoch, even mid-window, repeats the uninterrupted one. The state is taken at
    the batch the bound trainer has consumed (the data module binds it; a bare loader given to ``Trainer.fit`` needs
    ``bind_trainer(trainer)`` first). The batch to reuse is saved when it holds only tensors, numbers and strings in
    lists/tuples/dicts, else rebuilt from its indices or by re-reading an iterable; a map-style order is redrawn from
    saved RNG states (pass a seeded ``generator=`` to repeat later epochs too: the global RNG is not restored);
    iterables with ``state_dict``/``load_state_dict`` are restored through them. Warnings say when it cannot be exact.
    """

    def __init__(self, source: Iterable, p: float = 0.5, seed: int = 0, num_replicas: int = 1,
                 replica_rank: int = 0) -> None:
        settings = _check_settings(p, seed, num_replicas, replica_rank)
        if isinstance(source, LazySamplingLoader):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        super().__init__(source, *settings)
        self._trainer_ref: Callable[[], Any] = _no_trainer
        self._warned_sync = False

    def bind_trainer(self, trainer: Any) -> None:
        """Link the loader (weakly) to the trainer that trains on it, before ``fit``: it then checkpoints the batch the
        trainer has consumed, maps its ``batch_idx`` after a resume and tells it each epoch's length."""
        try:
            self._trainer_ref = weakref.ref(trainer) if trainer is not None else _no_trainer
        except TypeError:  # objects without weakref support (test doubles)
            self._trainer_ref = lambda: trainer

    def _fitting_trainer(self) -> Any:
        trainer = self._trainer_ref()
        return trainer if trainer is not None and getattr(trainer.state, "fn", None) == "fit" else None

    def _trainer_ready(self) -> Optional[int]:
        try:
            trainer = self._fitting_trainer()
            return None if trainer is None else _compat.train_batches_ready(trainer)
        except Exception:
            return None

    def _sync_trainer_length(self, length: int) -> None:
        """Lightning reads a train loader's length once and keeps it: set the fit loop's batch count (and a fraction's
        ``val_check_batch``) to this epoch's, unless ``limit_train_batches`` is set or loaders are combined."""
        try:
            trainer = self._fitting_trainer()
            limit = None if trainer is None else trainer.limit_train_batches
            if not (isinstance(limit, float) and limit == 1.0):
                return
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


# Hooks of the wrapped module that stay undefined here unless it defines them.
_PASS_THROUGH_IF_DEFINED = ("prepare_data", "teardown", "on_exception", "val_dataloader", "test_dataloader",
                            "predict_dataloader", "transfer_batch_to_device", "on_before_batch_transfer",
                            "on_after_batch_transfer")


class LazySamplingDataModule(LightningDataModule):
    """Lazy sampling around an existing ``LightningDataModule`` (or a bare train DataLoader / iterable).

    ``p``, ``seed``, ``num_replicas`` and ``replica_rank`` are those of :class:`LazySamplingLoader`; ``p = 1`` is
    exactly the wrapped module. ``train_dataloader()`` returns a :class:`LazySamplingLoader` over the wrapped
    ``train_dataloader()``, created once (with ``reload_dataloaders_every_n_epochs`` the wrapped module's new loader is
    used from the next epoch on) and bound to the trainer. ``setup``, ``state_dict``/``load_state_dict`` and the hooks
    the wrapped module defines (``prepare_data``, ``teardown``, ``on_exception``, ``val/test/predict_dataloader``, the
    batch-transfer hooks) go to it; unknown attributes are looked up on it. The loader's state is also kept in this
    module's ``state_dict``: Lightning restores data modules before it reads the train loader's length, and the fit
    loop's copy of the loader state only after that.
    """

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
        self._wrapped = wrapped if isinstance(wrapped, LightningDataModule) else None
        self._train_source = None if self._wrapped is not None else wrapped
        if self._wrapped is not None:
            self.prepare_data_per_node = wrapped.prepare_data_per_node
            self.allow_zero_length_dataloader_with_multiple_devices = (
                wrapped.allow_zero_length_dataloader_with_multiple_devices)
            for name in _PASS_THROUGH_IF_DEFINED:
                if is_overridden(name, wrapped, LightningDataModule):
                    setattr(self, name, getattr(wrapped, name))
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

    def _share_trainer(self) -> None:
        if self._wrapped is not None and self.trainer is not None:
            self._wrapped.trainer = self.trainer

    def setup(self, stage: str) -> None:
        self._share_trainer()
        if self._wrapped is not None:
            self._wrapped.setup(stage)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"wrapped": self._wrapped.state_dict() if self._wrapped is not None else {}}
        if self._loader is not None:
            state["lazy_loader"] = self._loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._wrapped is not None:
            self._wrapped.load_state_dict(state_dict.get("wrapped", {}))
        self._pending_loader_state = state_dict.get("lazy_loader")  # applied now, len() of the resumed epoch is right
        if self._loader is not None and self._pending_loader_state is not None:
            self._loader.load_state_dict(self._pending_loader_state)
            self._pending_loader_state = None

    def _wrapped_train_loader(self) -> Iterable:
        if self._wrapped is None:
            return self._train_source  # type: ignore[return-value]
        self._share_trainer()
        return self._wrapped.train_dataloader()

    def train_dataloader(self) -> LazySamplingLoader:
        trainer = self.trainer
        if self._user_reloads is None and trainer is not None:
            self._user_reloads = bool(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))
        if self._loader is None:
            self._loader = LazySamplingLoader(self._wrapped_train_loader(), self.p, self.seed, self.num_replicas,
                                              self.replica_rank)
            if self._pending_loader_state is not None:
                self._loader.load_state_dict(self._pending_loader_state)
                self._pending_loader_state = None
        elif self._user_reloads and self._wrapped is not None:
            self._loader.replace_source(self._wrapped_train_loader())
        if trainer is not None:
            self._loader.bind_trainer(trainer)
        return self._loader

    def __repr__(self) -> str:
        inner = self._wrapped if self._wrapped is not None else self._train_source
        return f"{type(self).__name__}({type(inner).__name__}, p={self.p}, seed={self.seed})"

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
    inside a list/dict/CombinedLoader), the fit loop's loader, or ``trainer.datamodule`` when it is a
    :class:`LazySamplingDataModule`. It is bound to the trainer, so its checkpoints account for Lightning's prefetching.
    """
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
