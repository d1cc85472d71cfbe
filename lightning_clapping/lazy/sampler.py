"""The lazy-sampling engine behind :class:`lightning_clapping.LazySamplingLoader`: decisions, epochs, the per-batch
:class:`BatchInfo` and the checkpoint state. It draws from a source of :mod:`lightning_clapping.lazy.source`; the
public subclass in :mod:`lightning_clapping.data` links a Lightning trainer through two hooks, ``_trainer_ready`` and
``_sync_trainer_length``.

Lightning fetches one batch ahead for a source without length and checkpoints at the batch it has consumed, so the
sampler keeps the infos of its latest batches and the state right after each of its last two, both under the
``batch_idx`` Lightning gives the batch (``offset`` + position in the epoch). Such a state holds the current batch only
when the next step reuses it, so no older batch is kept alive.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

from lightning_clapping.lazy.source import make_source

_STATE_VERSION = 1
INFO_WINDOW = 16  # batches ``batch_info`` still answers for (Lightning looks at most one batch back)
_END = object()  # what ``_next`` returns when the epoch is over


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


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Decisions:
    """Step t is fresh when ``u(seed, t) < p``, ``u`` the t-th uniform of a counter-based SplitMix64 stream: it
    depends on (seed, t) only, so processes agree, nothing is saved, and the future can be simulated."""

    def __init__(self, seed: int, p: float) -> None:
        self.p = p
        self._base = _mix64((seed * _GAMMA + 0x632BE59BD9B4E019) & _MASK64)

    def fresh(self, step: int) -> bool:
        return (_mix64((self._base + (step + 1) * _GAMMA) & _MASK64) >> 11) / (1 << 53) < self.p

    def epoch_steps(self, start: int, num_batches: int) -> int:
        """Steps of an epoch of ``num_batches`` batches that begins at ``start``: it ends at the first fresh decision
        that finds all of them drawn (that step is the next epoch's first)."""
        if num_batches <= 0 or self.p >= 1.0:
            return max(num_batches, 0)
        drawn, t = 1, start + 1
        while True:
            if self.fresh(t):
                if drawn == num_batches:
                    return t - start
                drawn += 1
            t += 1


def _is_plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` survives ``torch.load(weights_only=True)`` (tensors, numbers, strings, list/tuple/dict)."""
    if depth > 32:
        return False
    if obj is None or type(obj) in (bool, int, float, str, Tensor):
        return True
    if type(obj) in (list, tuple):
        return all(_is_plain(x, depth + 1) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return all(type(k) in (str, int) and _is_plain(v, depth + 1) for k, v in obj.items())
    return False


class LazySampler:
    """Fresh batch with probability ``p``, else the previous one again; epochs, counters, batch infos, checkpoints."""

    def __init__(self, source: Iterable, p: float, seed: int, num_replicas: int, replica_rank: int) -> None:
        self.p, self.seed, self.num_replicas, self.replica_rank = p, seed, num_replicas, replica_rank
        self._decisions = Decisions(seed, p)
        self._source = make_source(source, num_replicas, replica_rank, seed)
        self._step = self._fresh_total = self._distinct = 0  # since training began: yields, fresh draws, samples
        self._epoch = 0  # the running epoch, else the next one
        self._infos: OrderedDict[int, BatchInfo] = OrderedDict()
        self._states: OrderedDict[int, tuple] = OrderedDict()
        self._passes = 0  # bumped whenever an epoch is left: the iterators over it stop
        self._length = (-1, -1, 0)  # (start, batches, steps) of the last epoch simulated
        self._offset = 0  # Lightning's batch_idx minus the position (not 0 after some resumes of a source without length)
        self._warned_global_rng = False
        self._leave_epoch()

    # -- hooks of the Lightning side ---------------------------------------------------------------------------------

    def _trainer_ready(self) -> Optional[int]:
        """Batches the trainer has taken from the current epoch (Lightning's next batch_idx); None without one."""
        return None

    def _sync_trainer_length(self, length: int) -> None:
        """Called at the first step of every epoch of known length: tell the trainer its number of batches."""

    # -- what the loader tells -----------------------------------------------------------------------------------------

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
        return self._epoch + int(self._running and self._at_epoch_end())

    def batch_info(self, batch_idx: int) -> BatchInfo:
        """Metadata of the batch yielded at position ``batch_idx`` of the current epoch (Lightning's ``batch_idx``)."""
        info = self._infos.get(int(batch_idx))
        if info is None:
            raise KeyError(
                f"LazySamplingLoader.batch_info: no batch at position {batch_idx} of the current epoch among the "
                f"last {INFO_WINDOW} yielded (known positions: {list(self._infos)}). batch_idx is the index Lightning "
                "passes to training_step, i.e. the number of batches yielded before it in this epoch.")
        return info

    def replace_source(self, source: Iterable) -> None:
        """Draw from ``source`` from the next epoch on (decision stream and counters continue)."""
        if self._running or self._restored is not None:
            self._end_epoch()
        self._source = make_source(source, self.num_replicas, self.replica_rank, self.seed)

    # -- epochs --------------------------------------------------------------------------------------------------------

    def _epoch_length(self) -> Optional[int]:
        """Steps of the current epoch (restored, running, or the next one), None when the source has no length."""
        start, n = self._step - self._pos, self._source.num_batches()
        if n is None:
            return None
        if self._length[:2] != (start, n):
            self._length = (start, n, self._decisions.epoch_steps(start, n))
        return self._length[2]

    def _at_epoch_end(self) -> bool:
        length = self._epoch_length()
        return length is not None and self._pos >= length

    def _leave_epoch(self) -> None:
        """Forget the running or restored epoch (its infos stay for the batch_info of its last batches)."""
        self._source.end()
        self._running, self._restored = False, None
        self._pos = self._fresh = 0  # batches yielded and fresh draws in the epoch
        self._batch = self._ids = self._wrapped_state = None
        self._has_batch = False
        self._states.clear()
        self._passes += 1

    def _end_epoch(self) -> None:
        self._leave_epoch()
        self._epoch += 1

    def __len__(self) -> int:
        if self._running and self._at_epoch_end():
            self._end_epoch()  # after its last step, len() describes the next epoch
        length = self._epoch_length()
        if length is None:
            raise TypeError("LazySamplingLoader has no length: the wrapped source has none.")
        return length

    def __iter__(self) -> Iterator:
        if self._running:
            self._end_epoch()  # a new pass: the rest of a running epoch is dropped
        # An epoch not begun (planned by len(), restored by load_state_dict, or left by an iter() nobody pulled from,
        # like Lightning's iterability check) is used as is: nothing happens before the first next().
        return self._batches(self._passes)

    def _batches(self, passes: int) -> Iterator:
        while passes == self._passes:
            batch = self._next()
            if batch is _END:
                return
            passes = self._passes  # _next may have moved on from a restored epoch that was over: carry on with it
            yield batch

    # -- the step ------------------------------------------------------------------------------------------------------

    def _begin(self) -> None:
        restored, self._restored = self._restored, None
        if restored is None:
            self._source.begin(self._epoch)
        else:
            self._resume(restored["epoch"])
        ready = self._trainer_ready()
        self._offset = 0 if ready is None else ready - self._pos
        self._running = True
        self._infos.clear()
        self._remember_state()
        length = self._epoch_length()
        if length is not None:
            self._sync_trainer_length(self._offset + length)

    def _next(self) -> Any:
        if not self._running:
            if self._restored is not None and self._at_epoch_end():
                # Resumed from a checkpoint after an epoch's last step: go on with the next epoch, as a new pass of a
                # plain DataLoader would.
                self._end_epoch()
            self._begin()
        t = self._step
        fresh = self._pos == 0 or not self._has_batch or self._decisions.fresh(t)
        if fresh:
            n = self._source.num_batches()
            try:
                if n is not None and self._fresh >= n:
                    raise StopIteration
                self._batch, self._ids, count, self._wrapped_state = self._source.draw(self._fresh, self._distinct)
            except StopIteration:
                self._end_epoch()
                return _END
            self._has_batch = True
            self._fresh_total, self._fresh, self._distinct = self._fresh_total + 1, self._fresh + 1, self._distinct + count
        self._infos[self._offset + self._pos] = BatchInfo(fresh, self._fresh_total - 1, self._ids, self._distinct, t)
        while len(self._infos) > INFO_WINDOW:
            self._infos.popitem(last=False)
        self._step += 1
        self._pos += 1
        self._remember_state()
        return self._batch

    def _remember_state(self) -> None:
        """Keep what a checkpoint right after the latest yield needs, under the batch_idx of the batch after it."""
        reuse_next = self._has_batch and not self._decisions.fresh(self._step)
        self._states[self._offset + self._pos] = (self._step, self._fresh_total, self._distinct, self._pos,
                                                  self._fresh, self._ids, self._batch if reuse_next else None,
                                                  self._wrapped_state)
        while len(self._states) > 2:  # Lightning is at most one batch behind the latest yield
            self._states.popitem(last=False)

    # -- checkpointing -------------------------------------------------------------------------------------------------

    def _settings(self) -> dict:
        return {"p": self.p, "seed": self.seed, "num_replicas": self.num_replicas, "replica_rank": self.replica_rank,
                "source_kind": self._source.kind}

    def _state(self, step: int, fresh_total: int, distinct: int, next_epoch: int, generators: Any,
               epoch: Optional[dict] = None) -> dict:
        return {"version": _STATE_VERSION, **self._settings(), "step": step, "fresh_total": fresh_total,
                "distinct": distinct, "next_epoch": next_epoch, "epoch": epoch, "generators": generators,
                "base_drawn": self._source.base_drawn}

    def state_dict(self) -> dict:
        """Everything needed to continue exactly after the batch the trainer consumed last (else the latest yielded)."""
        if self._restored is not None:
            return dict(self._restored)  # loaded, not iterated yet: unchanged
        if not self._running:
            return self._state(self._step, self._fresh_total, self._distinct, self._epoch, self._source.capture_rng())
        state = self._states.get(self._trainer_ready()) or next(reversed(self._states.values()))  # type: ignore
        step, fresh_total, distinct, pos, fresh, ids, batch, wrapped_state = state
        source = self._source.entry()
        if pos == 0:  # the epoch has begun but yielded nothing: a resume begins it again from the same RNG states
            return self._state(*state[:3], self._epoch, source["order_rng"])
        has_batch = batch is not None and _is_plain(batch)
        return self._state(*state[:3], self._epoch + 1, None, {
            "index": self._epoch, "start": step - pos, "num_batches": self._source.num_batches(),
            "total": self._epoch_length(), "pos": pos, "fresh": fresh, "ids": ids, "has_batch": has_batch,
            "batch": batch if has_batch else None, "wrapped_state": wrapped_state, **source})

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from a ``state_dict``; the next ``iter()`` resumes the saved epoch at the saved position."""
        state = dict(state_dict)
        if int(state.get("version", -1)) != _STATE_VERSION:
            raise ValueError(f"LazySamplingLoader: unsupported state version {state.get('version')!r}.")
        for key, value in self._settings().items():
            if state.get(key) != value:
                warnings.warn(f"LazySamplingLoader: the checkpoint was written with {key}={state.get(key)!r}, this "
                              f"loader has {key}={value!r}; the resumed run will not repeat the uninterrupted one.")
        self._leave_epoch()
        self._step, self._fresh_total, self._distinct = (int(state[k]) for k in ("step", "fresh_total", "distinct"))
        self._epoch = int(state["next_epoch"])
        self._source.base_drawn = bool(state.get("base_drawn", False))
        if self._source.uses_global_rng() and not self._warned_global_rng:
            self._warned_global_rng = True
            warnings.warn(
                "LazySamplingLoader: the wrapped DataLoader shuffles with the global torch RNG, which the checkpoint "
                "does not restore: the current epoch resumes exactly, but later epochs use a different order than an "
                "uninterrupted run. Pass generator=torch.Generator().manual_seed(s) to the DataLoader for fully exact "
                "resumes.")
        entry = state.get("epoch")
        if entry is None:
            self._source.apply_generator_states(state.get("generators"))
            return
        self._epoch, self._pos, self._fresh = int(entry["index"]), int(entry["pos"]), int(entry["fresh"])
        self._restored = state
        # A map-style source redraws the epoch's order now: the DataLoader's generators are then where the
        # uninterrupted run had them, even if Lightning never asks this epoch for another batch (resume at its end).
        self._source.restore(self._epoch, entry)

    def _resume(self, entry: dict) -> None:
        """First step after load_state_dict: put the source back and bring back the batch a reuse step needs."""
        self._ids, self._wrapped_state = entry["ids"], entry.get("wrapped_state")
        need_batch = not entry["has_batch"] and not self._decisions.fresh(self._step)
        rebuilt = self._source.seek(self._fresh, self._ids, self._wrapped_state, need_batch)
        self._batch = entry["batch"] if entry["has_batch"] else rebuilt
        self._has_batch = bool(entry["has_batch"]) or rebuilt is not None
        if need_batch and rebuilt is None:
            warnings.warn(
                "LazySamplingLoader: exact resume is impossible: the checkpoint does not hold the reused batch and it "
                "cannot be rebuilt (keep batches to tensors/numbers/strings in lists, tuples and dicts, or use a "
                "map-style DataLoader). The first step after the resume draws a fresh batch instead.", RuntimeWarning)
