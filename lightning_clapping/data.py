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

See the :class:`LazySamplingLoader` docstring for epoch semantics, resume, sharding and limits. This module holds the
public API and all that talks to a ``Trainer`` (its private parts through ``_compat``). Behind it: ``_lazy_sampler``
(decisions, steps, epochs, checkpoint format), ``_lazy_epoch`` (one epoch's windows of infos and snapshots) and
``_lazy_source`` (drawing from map-style and iterable sources, and going back to a saved position).
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
from lightning_clapping.lazy.epoch import INFO_WINDOW, Epoch
from lightning_clapping.lazy.sampler import BatchInfo, LazySampler

__all__ = ["BatchInfo", "LazySamplingDataModule", "LazySamplingLoader", "find_lazy_loader"]


# --------------------------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


def _check_settings(p: Any, seed: Any, num_replicas: Any, replica_rank: Any) -> tuple[float, int, int, int]:
    """The validated ``(p, seed, num_replicas, replica_rank)`` shared by the loader and the data module."""
    p = _check_p(p)
    if not _is_int(seed):
        raise ValueError(f"seed must be an int (shared by all pipeline stages), got {seed!r}.")
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    if not _is_int(replica_rank) or not 0 <= replica_rank < num_replicas:
        raise ValueError(f"replica_rank must be an int in [0, num_replicas={num_replicas}), got {replica_rank!r}.")
    return p, int(seed), int(num_replicas), int(replica_rank)


# --------------------------------------------------------------------------------------------------------------------
# The lazy loader
# --------------------------------------------------------------------------------------------------------------------


class LazySamplingLoader(LazySampler):
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
        settings = _check_settings(p, seed, num_replicas, replica_rank)
        if isinstance(source, LazySamplingLoader):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        super().__init__(source, *settings)
        self._trainer_ref: Optional[Callable[[], Any]] = None
        self._warned_sync = False

    # -- public properties -------------------------------------------------------------------------------------------

    @property
    def source(self) -> Iterable:
        """The wrapped train loader / iterable."""
        return self._source.wrapped

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
        if ep is not None and ep.started and not ep.complete:
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
                f"last {INFO_WINDOW} yielded (known positions: {known}). batch_idx is the index Lightning passes to "
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

    # -- the bound trainer -------------------------------------------------------------------------------------------

    def _bound_trainer(self) -> Any:
        return self._trainer_ref() if self._trainer_ref is not None else None

    def _fitting_trainer(self) -> Any:
        """The bound trainer while it runs ``fit`` (None otherwise; raises if it is not trainer-shaped)."""
        trainer = self._bound_trainer()
        if trainer is None or getattr(trainer.state, "fn", None) != "fit":
            return None
        return trainer

    def _trainer_ready(self) -> Optional[int]:
        """Batches the bound trainer has taken from the current epoch (Lightning's next batch_idx), if fitting."""
        try:
            trainer = self._fitting_trainer()
            return None if trainer is None else _compat.train_batches_ready(trainer)
        except Exception:
            return None

    def _sync_trainer_length(self, ep: Epoch) -> None:
        """Tell a fitting Lightning trainer how many batches this epoch has.

        Lightning reads the length of a train loader once, when it loads it, and keeps it for later epochs; lazy
        epochs differ in length. So at the first step of each epoch the loader updates the fit loop's batch count,
        the CombinedLoader limit, the fetcher's length and a fraction-based ``val_check_batch``. This is left alone
        when ``limit_train_batches`` is set or the loader is combined with others.
        """
        if ep.total is None:
            return
        try:
            trainer = self._fitting_trainer()
            if trainer is None:
                return
            limit = trainer.limit_train_batches
            if not (isinstance(limit, float) and limit == 1.0):
                return
            combined = _compat.fit_combined_loader(trainer)
            if combined is None or len(combined.flattened) != 1 or _search(combined.flattened[0]) is not self:
                return
            want = ep.offset + ep.total
            if _compat.set_train_epoch_length(trainer, want):
                _compat.rescale_val_check_batch(trainer, want)
        except Exception as err:  # pragma: no cover - only on an incompatible Lightning
            if not self._warned_sync:
                self._warned_sync = True
                rank_zero_warn(
                    f"LazySamplingLoader: could not update Lightning's epoch length ({err!r}); epochs longer than the "
                    "first may be cut short. Set Trainer(reload_dataloaders_every_n_epochs=1) as a workaround."
                )

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
        self.p, self.seed, self.num_replicas, self.replica_rank = _check_settings(p, seed, num_replicas, replica_rank)
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
    else:  # a strategy may wrap the loader in its own object
        children = _compat.loader_wrapper_children(obj)
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
    try:
        found = _search(getattr(trainer, "train_dataloader", None))
    except Exception:
        found = None
    if found is None:
        try:
            combined = _compat.fit_combined_loader(trainer)
        except AttributeError:  # not a Lightning trainer
            combined = None
        found = _search(combined)
    if found is None:
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, LazySamplingDataModule):
            found = datamodule.loader
    if found is not None and found._bound_trainer() is not trainer:
        found.bind_trainer(trainer)
    return found
