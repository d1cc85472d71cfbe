"""Lazy sampling for Clapping, as a Lightning data component.

At every training step a lazy sampler draws a fresh mini-batch with probability ``p`` and otherwise hands out the
previous mini-batch again, unchanged (same objects, so the micro-batch split and order stay the same). Every pipeline
stage runs in its own process and builds the same wrapper with the same ``seed``; the decisions only depend on
``(seed, step)``, so all stages agree on every decision without talking to each other.

Public API: :class:`LazySamplingDataModule` (wraps a data module or a bare train loader), :class:`LazySamplingLoader`
(the iterable Lightning trains on; ``batch_info(batch_idx)`` gives the :class:`BatchInfo` of the batch
``training_step`` received with that ``batch_idx``) and :func:`find_lazy_loader` (the running loader of a ``Trainer``).
This module holds all that talks to a ``Trainer`` (its private parts through ``_compat``); the engine, free of
Lightning, is :mod:`lightning_clapping.lazy` (``sampler``: decisions, epochs, checkpoint state; ``source``: drawing from
map-style and iterable sources and going back to a saved position).
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


class LazySamplingLoader(LazySampler):
    """Lazy-sampling view of a train loader: fresh batch with probability ``p``, else the previous batch again.

    Args:
        source: what to draw fresh batches from: a ``torch.utils.data.DataLoader`` (map-style or iterable dataset)
            or any iterable of batches (a list, a stream).
        p: probability of drawing a fresh batch at a step, in (0, 1]. ``p = 1`` reproduces ``source`` exactly.
        seed: seed of the decision stream; every pipeline stage must use the same one.
        num_replicas, replica_rank: data-parallel replicas of the pipeline. With ``num_replicas > 1`` the indices of
            a map-style ``source`` are sharded like ``DistributedSampler(shuffle=<source shuffles>, seed=seed)``
            (padded so all replicas have the same number of batches); the decisions do not depend on the rank.

    Decisions: step t is fresh when it is the first step of an epoch (so r_0 = 1) or when ``u(seed, t) < p`` (a
    counter-based SplitMix64 uniform: separate processes agree and runs repeat). A reused step yields the very same
    objects as the step before, so the split, order and shapes never change inside a window (a ragged last batch
    only appears at a fresh step). Do not modify a batch in place: the next step may get it again.

    Epochs: an epoch is one pass of the wrapped loader by fresh draws. It ends at the first fresh decision that finds
    the wrapped loader exhausted; that step opens the next epoch. So every batch of the wrapped loader is drawn once
    per epoch and the last keeps its full reuse window. When the source has a length, ``len(loader)`` is the exact
    number of steps of the current (between epochs: the next) epoch; it varies from epoch to epoch, so a loader bound
    to a fitting trainer tells the fit loop each epoch's length at its first step. If Lightning stops an epoch early
    (``limit_train_batches``), the next ``iter()`` starts a new pass.

    Metadata and sample ids: ``batch_info(batch_idx)`` is the :class:`BatchInfo` of the batch Lightning passes to
    ``training_step`` with that ``batch_idx`` (also with its prefetching and after a resume). The loader's
    ``step``/``distinct_samples`` are as of the latest batch *yielded*, which may be the prefetched one. For a map-style
    ``DataLoader`` the sample ids are dataset indices: the lazy loader draws each epoch's index order when the epoch
    begins (as ``DataLoader.__iter__`` would) and feeds it to an inner DataLoader with the wrapped one's dataset,
    collate_fn, workers and pinning (its own ``__iter__`` is bypassed; with workers the batches are the same but the
    workers' seeds, so random augmentation, differ). For iterables the ids count the samples read (first dimension of
    the batch; ``None`` without tensors); a stream is read only at fresh steps, and no batch but the current is kept.

    Resume: ``state_dict``/``load_state_dict`` are stored by Lightning with the fit loop (and by
    :class:`LazySamplingDataModule` in its own state, which Lightning restores before it reads the loader's length),
    so a run resumed with ``ckpt_path=`` mid-epoch, even mid-window, repeats the uninterrupted one. The state is taken
    at the batch the bound trainer has consumed (``find_lazy_loader`` and the data module bind it; a bare loader
    passed to ``Trainer.fit`` needs ``loader.bind_trainer(trainer)`` before ``fit``). It holds counters, the epoch
    position, the batch to reuse (when it holds only tensors/numbers/strings in lists/tuples/dicts; else it is rebuilt
    from its indices or by re-reading an iterable) and the RNG states the epoch's order was drawn from. A map-style
    loader needs an index order that depends only on torch generators: pass a seeded ``generator=`` to also repeat
    the epochs after the resumed one (the global RNG is not restored). Iterables with ``state_dict``/
    ``load_state_dict`` are restored through them, others re-read up to the position. Warnings say when a resume
    cannot be exact.
    """

    def __init__(
        self, source: Iterable, p: float = 0.5, seed: int = 0, num_replicas: int = 1, replica_rank: int = 0
    ) -> None:
        settings = _check_settings(p, seed, num_replicas, replica_rank)
        if isinstance(source, LazySamplingLoader):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        super().__init__(source, *settings)
        self._trainer_ref: Optional[Callable[[], Any]] = None
        self._warned_sync = False

    def bind_trainer(self, trainer: Any) -> None:
        """Link the loader to the trainer that trains on it (held weakly; done by LazySamplingDataModule).

        The loader then checkpoints the batch the trainer has consumed (Lightning fetches ahead), maps Lightning's
        ``batch_idx`` after a resume, and tells the fit loop the length of each epoch. Call it before ``fit``.
        """
        try:
            self._trainer_ref = None if trainer is None else weakref.ref(trainer)
        except TypeError:  # objects without weakref support (test doubles)
            self._trainer_ref = lambda: trainer

    def _bound_trainer(self) -> Any:
        return self._trainer_ref() if self._trainer_ref is not None else None

    def _fitting_trainer(self) -> Any:
        trainer = self._bound_trainer()
        return trainer if trainer is not None and getattr(trainer.state, "fn", None) == "fit" else None

    def _trainer_ready(self) -> Optional[int]:
        try:
            trainer = self._fitting_trainer()
            return None if trainer is None else _compat.train_batches_ready(trainer)
        except Exception:
            return None

    def _sync_trainer_length(self, length: int) -> None:
        """Lightning reads a train loader's length once and keeps it; lazy epochs differ. So at the first step of
        each epoch the fit loop's batch count is updated (and a fraction-based ``val_check_batch``), unless
        ``limit_train_batches`` is set or the loader is combined with others."""
        try:
            trainer = self._fitting_trainer()
            if trainer is None or not (isinstance(trainer.limit_train_batches, float)
                                       and trainer.limit_train_batches == 1.0):
                return
            combined = _compat.fit_combined_loader(trainer)
            if combined is None or len(combined.flattened) != 1 or _search(combined.flattened[0]) is not self:
                return
            if _compat.set_train_epoch_length(trainer, length):
                _compat.rescale_val_check_batch(trainer, length)
        except Exception as err:  # pragma: no cover - only on an incompatible Lightning
            if not self._warned_sync:
                self._warned_sync = True
                rank_zero_warn(
                    f"LazySamplingLoader: could not update Lightning's epoch length ({err!r}); epochs longer than the "
                    "first may be cut short. Set Trainer(reload_dataloaders_every_n_epochs=1) as a workaround.")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_trainer_ref": None}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(p={self.p}, seed={self.seed}, num_replicas={self.num_replicas}, "
                f"replica_rank={self.replica_rank}, source={type(self.source).__name__}, step={self.step}, "
                f"fresh_draws={self.fresh_draws}, distinct_samples={self.distinct_samples})")


_PASS_THROUGH_IF_DEFINED = ("val_dataloader", "test_dataloader", "predict_dataloader", "transfer_batch_to_device",
                            "on_before_batch_transfer", "on_after_batch_transfer")


class LazySamplingDataModule(LightningDataModule):
    """Lazy sampling around an existing ``LightningDataModule`` (or a bare train DataLoader / iterable).

    Args:
        datamodule_or_train_dataloader: the data module to wrap, or the train loader itself.
        p: probability of a fresh mini-batch at each training step, in (0, 1]; ``p = 1`` is exactly the wrapped module.
        seed: seed of the decision stream, the same on every pipeline stage.
        num_replicas, replica_rank: data-parallel pipeline replicas; see :class:`LazySamplingLoader`.

    ``train_dataloader()`` returns a :class:`LazySamplingLoader` over the wrapped ``train_dataloader()`` (created once
    and reused; if you asked Lightning to reload dataloaders, the wrapped module's new loader is used from the next
    epoch on), bound (weakly) to the trainer. ``val/test/predict_dataloader``, the batch-transfer hooks,
    ``prepare_data``, ``setup``, ``teardown``, ``state_dict``/``load_state_dict`` and ``on_exception`` go to the wrapped
    module; hooks it does not define stay undefined here. Unknown attributes are looked up on the wrapped module. The
    loader's position is also kept in this module's ``state_dict``, because Lightning restores data modules before it
    reads the train loader's length, and the fit loop's copy of the loader state only after that.
    """

    def __init__(self, datamodule_or_train_dataloader: Any, p: float = 0.5, seed: int = 0, num_replicas: int = 1,
                 replica_rank: int = 0) -> None:
        super().__init__()
        self.p, self.seed, self.num_replicas, self.replica_rank = _check_settings(p, seed, num_replicas, replica_rank)
        wrapped = datamodule_or_train_dataloader
        if isinstance(wrapped, LazySamplingDataModule):
            raise ValueError("The data module is already a LazySamplingDataModule; wrap the inner one instead.")
        self._wrapped: Optional[LightningDataModule] = None
        self._train_source: Optional[Iterable] = None
        if isinstance(wrapped, LightningDataModule):
            self._wrapped = wrapped
            self.prepare_data_per_node = wrapped.prepare_data_per_node
            self.allow_zero_length_dataloader_with_multiple_devices = (
                wrapped.allow_zero_length_dataloader_with_multiple_devices)
            for name in _PASS_THROUGH_IF_DEFINED:
                if is_overridden(name, wrapped, LightningDataModule):
                    setattr(self, name, getattr(wrapped, name))
        elif isinstance(wrapped, Iterable):
            self._train_source = wrapped
        else:
            raise TypeError("LazySamplingDataModule wraps a LightningDataModule or a train DataLoader/iterable, got "
                            f"{type(wrapped).__name__}.")
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

    def prepare_data(self) -> None:
        if self._wrapped is not None:
            self._wrapped.prepare_data()

    def setup(self, stage: str) -> None:
        self._share_trainer()
        if self._wrapped is not None:
            self._wrapped.setup(stage)

    def teardown(self, stage: str) -> None:
        if self._wrapped is not None:
            self._wrapped.teardown(stage)

    def on_exception(self, exception: BaseException) -> None:
        if self._wrapped is not None:
            self._wrapped.on_exception(exception)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"wrapped": self._wrapped.state_dict() if self._wrapped is not None else {}}
        if self._loader is not None:
            state["lazy_loader"] = self._loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._wrapped is not None:
            self._wrapped.load_state_dict(state_dict.get("wrapped", {}))
        # Applied now, len() of the resumed epoch is right; the fit loop loads the same state again later.
        loader_state = state_dict.get("lazy_loader")
        if loader_state is not None and self._loader is not None:
            self._loader.load_state_dict(loader_state)
        elif loader_state is not None:
            self._pending_loader_state = loader_state

    def _wrapped_train_loader(self) -> Iterable:
        if self._wrapped is None:
            assert self._train_source is not None
            return self._train_source
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
        inner = type(self._wrapped).__name__ if self._wrapped is not None else type(self._train_source).__name__
        return f"{type(self).__name__}({inner}, p={self.p}, seed={self.seed})"

    __str__ = __repr__


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
    else:  # a strategy may wrap the loader in its own object
        children = _compat.loader_wrapper_children(obj)
    return next((found for child in children if (found := _search(child, depth + 1)) is not None), None)


def find_lazy_loader(trainer: Any) -> Optional[LazySamplingLoader]:
    """The :class:`LazySamplingLoader` the trainer trains on, or ``None``.

    Looks at ``trainer.train_dataloader`` (the loader itself, or inside a list/dict/CombinedLoader), then at
    ``trainer.datamodule`` when it is a :class:`LazySamplingDataModule`. The loader found is bound to the trainer so
    that its checkpoints account for Lightning's prefetching.
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
    if found is not None and found._bound_trainer() is not trainer:
        found.bind_trainer(trainer)
    return found
