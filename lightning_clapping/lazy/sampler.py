"""The lazy-sampling state machine behind :class:`lightning_clapping.data.LazySamplingLoader`, and its per-batch
:class:`BatchInfo` (both exported by :mod:`lightning_clapping.data`).

:class:`LazySampler` owns the decision stream, the counters, the current epoch and the checkpoint format; it draws
from a source of :mod:`lightning_clapping.lazy.source`, and each epoch's bookkeeping is an
:class:`~lightning_clapping.lazy.epoch.Epoch`. Everything that talks to a Lightning ``Trainer`` lives in the public
subclass, behind two hooks: ``_trainer_ready`` and ``_sync_trainer_length``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_clapping.lazy.epoch import Epoch
from lightning_clapping.lazy.source import make_source

_STATE_VERSION = 1


@dataclass(frozen=True)
class BatchInfo:
    """What the pipeline needs to know about one training batch.

    Attributes:
        fresh: ``True`` when the batch was freshly drawn at this step (r_t = 1), ``False`` when it is the previous
            batch handed out again.
        batch_id: Identity of the batch: the number of fresh draws since the start of training, minus one. It is the
            same for every step of a reuse window and unique per distinct batch.
        sample_ids: ``LongTensor`` of the samples in the batch, in batch order: dataset indices for a map-style
            ``DataLoader``, a running count of samples read for iterable sources; ``None`` when unknown.
        distinct_samples: Samples read from the data source so far, this batch included. A reused batch adds nothing;
            a sample drawn again in a later epoch counts again. This is the data budget to report next to the step.
        step: Global step of this batch: the number of batches the loader yielded before it since training started.
    """

    fresh: bool
    batch_id: int
    sample_ids: Optional[Tensor] = field(compare=False)
    distinct_samples: int
    step: int


# --------------------------------------------------------------------------------------------------------------------
# Decisions: a counter-based generator (SplitMix64). The decision of step t depends only on (seed, t), so it is the
# same in every process, needs no state to checkpoint, and the future can be simulated without consuming anything.
# --------------------------------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_TWO_POW_M53 = 1.0 / (1 << 53)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class _Decisions:
    def __init__(self, seed: int, p: float) -> None:
        self.p = p
        self._base = _mix64((seed * _GAMMA + 0x632BE59BD9B4E019) & _MASK64)

    def uniform(self, step: int) -> float:
        """The step-th uniform in [0, 1) of this seed's stream (53-bit resolution)."""
        return (_mix64((self._base + (step + 1) * _GAMMA) & _MASK64) >> 11) * _TWO_POW_M53

    def fresh(self, step: int) -> bool:
        return self.uniform(step) < self.p

    def epoch_steps(self, start: int, num_batches: int) -> int:
        """Steps an epoch takes that starts (fresh) at global step ``start`` and holds ``num_batches`` batches.

        The epoch ends at the first fresh decision that finds all its batches drawn; that step is not part of it.
        """
        if num_batches <= 0:
            return 0
        if self.p >= 1.0:
            return num_batches
        drawn, t = 1, start + 1
        while True:
            if self.fresh(t):
                if drawn == num_batches:
                    return t - start
                drawn += 1
            t += 1


class _LazyIterator(Iterator):
    def __init__(self, loader: "LazySampler", epoch: Epoch) -> None:
        self._loader = loader
        self._epoch = epoch

    def __iter__(self) -> "_LazyIterator":
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)


class LazySampler:
    """Fresh batch with probability ``p``, else the previous one again; epochs, counters and checkpoints.

    The public subclass validates the arguments and links a trainer through the two hooks below.
    """

    def __init__(self, source: Iterable, p: float, seed: int, num_replicas: int, replica_rank: int) -> None:
        self.p, self.seed, self.num_replicas, self.replica_rank = p, seed, num_replicas, replica_rank
        self._decisions = _Decisions(seed, p)
        self._source = make_source(source, num_replicas, replica_rank, seed)
        self._step = 0  # batches yielded since the start of training
        self._fresh_total = 0  # fresh draws since the start of training
        self._distinct = 0  # samples read from the source
        self._epochs_begun = 0  # index of the next epoch
        self._epoch: Optional[Epoch] = None
        self._warned_global_rng = False

    def _trainer_ready(self) -> Optional[int]:
        """Batches the trainer has taken from the current epoch (Lightning's next batch_idx); None without one."""
        return None

    def _sync_trainer_length(self, ep: Epoch) -> None:
        """Called at the first step of every epoch, once its length is known: tell the trainer."""

    def replace_source(self, source: Iterable) -> None:
        """Draw from ``source`` from the next epoch on (decision stream and counters continue)."""
        ep = self._epoch
        if ep is not None and not ep.started:
            self._epoch = None
        self._source = make_source(source, self.num_replicas, self.replica_rank, self.seed)

    # -- epochs ------------------------------------------------------------------------------------------------------

    def _next_epoch(self) -> Epoch:
        """Close the current epoch (if any) and plan the next one, with its exact length when the source has one."""
        if self._epoch is not None:
            self._close(self._epoch)
        n = self._source.num_batches()
        total = None if n is None else self._decisions.epoch_steps(self._step, n)
        self._epoch = Epoch(self._epochs_begun, self._step, n, total)
        return self._epoch

    def _adopt_order_length(self, ep: Epoch) -> None:
        """A map-style epoch has as many batches as the order drawn for it (a sampler may change its length)."""
        n = ep.src.num_batches
        if n is not None and n != ep.num_batches:
            ep.num_batches, ep.total = n, self._decisions.epoch_steps(ep.start, n)

    def _close(self, ep: Epoch) -> None:
        ep.finished = True
        if ep.src is not None:
            self._source.close(ep.src)

    def __len__(self) -> int:
        # The epoch len() describes: the running one, else the one the next iter() will run.
        ep = self._epoch
        if ep is None or ep.finished or (ep.started and ep.complete):
            ep = self._next_epoch()
        if ep.total is None:
            raise TypeError("LazySamplingLoader has no length: the wrapped source has none.")
        return ep.total

    def __iter__(self) -> Iterator:
        ep = self._epoch
        if ep is None or ep.started or ep.finished:
            ep = self._next_epoch()
        # An unstarted epoch (planned by len(), restored by load_state_dict, or left by an iter() nobody pulled from,
        # like Lightning's iterability check) is used as is: nothing happens before the first next().
        return _LazyIterator(self, ep)

    # -- the step ----------------------------------------------------------------------------------------------------

    def _begin(self, ep: Epoch) -> None:
        ep.started = True
        ready = self._trainer_ready()
        if ready is not None:
            ep.offset = ready - ep.pos
        self._epochs_begun = ep.index + 1
        if ep.restored is not None:
            self._resume(ep)
        else:
            ep.src = self._source.begin(ep.index)
            self._adopt_order_length(ep)
        ep.remember(self._step, self._fresh_total, self._distinct)
        self._sync_trainer_length(ep)

    def _next(self, it: _LazyIterator) -> Any:
        ep = it._epoch
        if self._epoch is not ep or ep.finished:
            raise StopIteration
        if not ep.started and ep.restored is not None and ep.complete:
            # Resumed from a checkpoint taken after the last step of an epoch: this iterator carries on with the
            # next epoch, as a new pass of a plain DataLoader would.
            ep = it._epoch = self._next_epoch()
        if not ep.started:
            self._begin(ep)
        t = self._step
        fresh = ep.pos == 0 or not ep.has_batch or self._decisions.fresh(t)
        if fresh:
            if ep.num_batches is not None and ep.fresh >= ep.num_batches:
                self._close(ep)
                raise StopIteration
            try:
                batch, ids, count, wrapped_state = self._source.draw(ep.src, ep.fresh, self._distinct)
            except StopIteration:
                self._close(ep)
                raise
            self._fresh_total += 1
            self._distinct += count
            ep.take(batch, ids, wrapped_state)
        ep.remember_info(BatchInfo(fresh, self._fresh_total - 1, ep.ids, self._distinct, t))
        self._step += 1
        ep.pos += 1
        ep.remember(self._step, self._fresh_total, self._distinct)
        return ep.batch

    # -- checkpointing -----------------------------------------------------------------------------------------------

    def _settings(self) -> dict:
        return {"p": self.p, "seed": self.seed, "num_replicas": self.num_replicas, "replica_rank": self.replica_rank,
                "source_kind": self._source.kind}

    def _state(self, counters: tuple[int, int, int], next_epoch: int, generators: Optional[dict],
               epoch: Optional[dict] = None) -> dict:
        step, fresh_total, distinct = counters
        return {"version": _STATE_VERSION, **self._settings(), "step": step, "fresh_total": fresh_total,
                "distinct": distinct, "next_epoch": next_epoch, "epoch": epoch, "generators": generators,
                "base_drawn": getattr(self._source, "base_drawn", False)}

    def state_dict(self) -> dict:
        """Everything needed to continue exactly from the batch the trainer consumed last (see class docstring)."""
        ep = self._epoch
        if ep is None or not ep.started:
            if ep is not None and ep.restored is not None:
                return dict(ep.restored)  # restored but not iterated yet: unchanged
            counters = (self._step, self._fresh_total, self._distinct)
            return self._state(counters, self._epochs_begun, self._source.capture_rng())
        snap = ep.snapshot_for(self._trainer_ready())
        counters = (snap.step, snap.fresh_total, snap.distinct)
        if snap.pos == 0:
            rng = ep.src.order_rng if ep.src is not None else self._source.capture_rng()
            return self._state(counters, ep.index, rng)
        if ep.finished and ep.total is None and snap is ep.snapshots.get(ep.pos):
            # A source without length that was found exhausted: Lightning starts a new epoch on resume.
            return self._state(counters, ep.index + 1, self._source.capture_rng())
        return self._state(counters, ep.index + 1, None, ep.entry(snap))

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from a ``state_dict``; the next ``iter()`` resumes the saved epoch at the saved position."""
        state = dict(state_dict)
        if int(state.get("version", -1)) != _STATE_VERSION:
            raise ValueError(f"LazySamplingLoader: unsupported state version {state.get('version')!r}.")
        for key, value in self._settings().items():
            if state.get(key) != value:
                rank_zero_warn(
                    f"LazySamplingLoader: the checkpoint was written with {key}={state.get(key)!r}, this loader has "
                    f"{key}={value!r}; the resumed run will not repeat the uninterrupted one."
                )
        if self._epoch is not None:
            self._close(self._epoch)
        self._step = int(state["step"])
        self._fresh_total = int(state["fresh_total"])
        self._distinct = int(state["distinct"])
        self._epochs_begun = int(state["next_epoch"])
        if hasattr(self._source, "base_drawn"):
            self._source.base_drawn = bool(state.get("base_drawn", False))
        if self._source.uses_global_rng() and not self._warned_global_rng:
            self._warned_global_rng = True
            rank_zero_warn(
                "LazySamplingLoader: the wrapped DataLoader shuffles with the global torch RNG, which the checkpoint "
                "does not restore: the current epoch resumes exactly, but later epochs use a different order than "
                "an uninterrupted run. Pass generator=torch.Generator().manual_seed(s) to the DataLoader for fully "
                "exact resumes."
            )
        entry = state.get("epoch")
        if entry is None:
            self._source.apply_generator_states(state.get("generators"))
            self._epoch = None
            return
        ep = Epoch.from_entry(entry)
        ep.restored = state
        self._epochs_begun = ep.index + 1
        # A map-style source redraws the epoch's order now: this puts the DataLoader's generators where the
        # uninterrupted run had them, even if Lightning never asks this epoch for another batch (resume at its last
        # step). An iterable is repositioned at the first step (see _resume).
        ep.src = self._source.restore(ep.index, entry)
        if ep.src is not None:
            self._adopt_order_length(ep)
        self._epoch = ep

    def _resume(self, ep: Epoch) -> None:
        """First step after load_state_dict: bring back the source's position and the batch a reuse step needs."""
        entry = ep.restored["epoch"]  # type: ignore[index]
        ep.restored = None
        need_batch = not entry["has_batch"] and not self._decisions.fresh(self._step)
        ep.src, rebuilt = self._source.resume(ep.src, ep.index, ep.fresh, ep.ids, ep.wrapped_state, need_batch)
        if entry["has_batch"]:
            ep.batch, ep.has_batch = entry["batch"], True
        elif rebuilt is not None:
            ep.batch, ep.has_batch = rebuilt, True
        elif need_batch:
            rank_zero_warn(
                "LazySamplingLoader: exact resume is impossible: the checkpoint does not hold the reused batch and it "
                "cannot be rebuilt (keep batches to tensors/numbers/strings in lists, tuples and dicts, or use a "
                "map-style DataLoader). The first step after the resume draws a fresh batch instead.",
                category=RuntimeWarning,
            )

