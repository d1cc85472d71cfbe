"""The lazy-sampling engine: decisions, epochs, each batch's :class:`BatchInfo` and the checkpoint state."""

from __future__ import annotations

import bisect
import math
import numbers
import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

from lightning_clapping.lazy.source import make_source

INFO_WINDOW = 16  # batches ``batch_info`` still answers for (Lightning looks at most one batch back)
_STATE_VERSION = 2
_STATE_KEYS = ("step", "fresh_total", "distinct", "pos", "fresh", "ids", "batch", "wrapped_state")
_MASK64, _GAMMA = (1 << 64) - 1, 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class BatchInfo:
    """What the pipeline knows about one training batch."""

    fresh: bool  #: drawn fresh at this step (r_t = 1); ``False``: the previous batch again
    batch_id: int  #: fresh draws since training began, minus one: the same for every step of a reuse window
    #: ``LongTensor`` of the batch's samples in order: dataset indices for a map-style ``DataLoader``, a running count
    #: of the samples read for other sources; ``None`` when unknown
    sample_ids: Optional[Tensor] = field(compare=False)
    distinct_samples: int  #: samples read so far, this batch included; a reused batch adds nothing (the data budget)
    step: int  #: batches the loader yielded before this one since training began


def _as_schedule(p: Any) -> Any:  # a float p is the schedule {0: p}: both spellings of one p compare equal
    return p if isinstance(p, Mapping) else {0: p}


def check_settings(p: Any, seed: Any, num_replicas: Any, replica_rank: Any) -> tuple[Any, int, int, int]:
    """The settings checked; ``p`` a float, or a schedule ``{first_step: p}`` as a dict sorted by step."""
    schedule = _as_schedule(p)
    ints = [isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (seed, num_replicas, replica_rank)]
    for step in schedule:
        if not (isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"a schedule of p maps loader steps (ints >= 0: batches the loader has yielded since "
                             f"training began) to probabilities, got the key {step!r} in {dict(p)!r}")
    if 0 not in schedule:
        raise ValueError(f"a schedule of p must say what p is from step 0, e.g. {{0: 0.5, 1000: 1.0}}; got {dict(p)!r}")
    for step, q in sorted(schedule.items()):
        if not (isinstance(q, numbers.Real) and not isinstance(q, bool) and math.isfinite(q) and 0.0 < q <= 1.0):
            raise ValueError(f"{'p' if schedule is not p else f'p from step {step}'} must be a number in the range "
                             "(0, 1]: it is the probability of drawing a fresh mini-batch at each training step (p = 1:"
                             f" no reuse; smaller p: about 1/p steps per batch). Got {q!r}.")
    if not ints[0]:
        raise ValueError(f"seed must be an int (shared by all pipeline stages), got {seed!r}.")
    if not ints[1] or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    if not ints[2] or not 0 <= replica_rank < num_replicas:
        raise ValueError(f"replica_rank must be an int in [0, num_replicas={num_replicas}), got {replica_rank!r}.")
    p = {int(step): float(q) for step, q in sorted(schedule.items())} if schedule is p else float(p)
    return p, int(seed), int(num_replicas), int(replica_rank)


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _is_plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` survives ``torch.load(weights_only=True)`` (tensors, numbers, strings, list/tuple/dict)."""
    if type(obj) in (list, tuple):
        return depth < 32 and all(_is_plain(x, depth + 1) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return depth < 32 and all(type(k) in (str, int) and _is_plain(v, depth + 1) for k, v in obj.items())
    return obj is None or type(obj) in (bool, int, float, str, Tensor)


class LazySampler:
    """``LazySamplingLoader`` without a trainer. An epoch is not begun (position 0), restored or running."""

    def __init__(self, source: Iterable, p: float | dict[int, float] = 0.5, seed: int = 0, num_replicas: int = 1,
                 replica_rank: int = 0) -> None:
        self.p, self.seed, self.num_replicas, self.replica_rank = check_settings(p, seed, num_replicas, replica_rank)
        self._p_steps, self._p_values = zip(*_as_schedule(self.p).items())
        if isinstance(source, LazySampler):
            raise ValueError("source is already a LazySamplingLoader; wrap the underlying loader instead.")
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of batches (e.g. a DataLoader), got {type(source).__name__}.")
        self._base = _mix64((seed * _GAMMA + 0x632BE59BD9B4E019) & _MASK64)
        self._source = make_source(source, num_replicas, replica_rank, seed)
        self.step = self.fresh_draws = self.distinct_samples = 0
        self._epoch = 0  # the running or restored epoch, else the next one
        self._infos: deque = deque(maxlen=INFO_WINDOW)  # (Lightning's batch_idx, BatchInfo)
        self._states: deque = deque(maxlen=2)  # (next batch_idx, state) after the last two yields
        self._offset = 0  # Lightning's batch_idx minus the position (not 0 after some resumes of a source without len)
        self._length = (-1, -1, 0)  # (first step, batches, steps) of the last epoch simulated
        self._leave_epoch(ended=False)

    def _trainer_ready(self) -> Optional[int]:  # the next batch_idx of a trainer (it fetches one ahead), else None
        return None

    def _sync_trainer_length(self, length: int) -> None:  # at an epoch's first step, its length for the trainer
        pass

    def p_at(self, step: int) -> float:
        """The probability of a fresh batch at loader step ``step`` (``p``, or the schedule's entry in force)."""
        return self._p_values[bisect.bisect_right(self._p_steps, step) - 1]

    def mean_p(self, first: int, end: float) -> float:
        """The mean of ``p_at(t)`` over loader steps ``first <= t < end``: the fraction of them expected to be fresh
        (``end`` infinite: the p that holds for ever; ``end <= first``: ``p_at(first)``)."""
        if end <= first or not math.isfinite(end):
            return self.p_at(first if math.isfinite(end) else math.inf)
        spans = zip(self._p_steps, (*self._p_steps[1:], math.inf), self._p_values)
        return sum(max(0.0, min(stop, end) - max(start, first)) * p for start, stop, p in spans) / (end - first)

    def _fresh_at(self, step: int) -> bool:
        """Step t is fresh when ``u(seed, t) < p_at(t)``, ``u`` the t-th uniform of a counter-based SplitMix64 stream:
        it depends on (seed, t) only, so processes agree, nothing is saved and the future can be simulated."""
        return (_mix64((self._base + (step + 1) * _GAMMA) & _MASK64) >> 11) / (1 << 53) < self.p_at(step)

    @property
    def source(self) -> Iterable:  # the wrapped train loader / iterable
        return self._source.wrapped

    @property
    def epoch(self) -> int:  # the current epoch (between epochs: the next one)
        return self._epoch + int(self._running and self._at_epoch_end())

    def batch_info(self, batch_idx: int) -> BatchInfo:
        """The :class:`BatchInfo` of the batch at position ``batch_idx`` of the epoch (Lightning's ``batch_idx``)."""
        if (info := next((info for idx, info in self._infos if idx == batch_idx), None)) is None:
            raise KeyError(f"LazySamplingLoader.batch_info: no batch at position {batch_idx} of the current epoch among"
                           f" the last {INFO_WINDOW} yielded (known: {[idx for idx, _ in self._infos]}); batch_idx is "
                           "the one Lightning passes to training_step.")
        return info

    def replace_source(self, source: Iterable) -> None:
        """Draw from ``source`` from the next epoch on (decision stream and counters continue)."""
        if self._running or self._pos:
            self._leave_epoch()
        self._source = make_source(source, self.num_replicas, self.replica_rank, self.seed)

    def _epoch_length(self) -> Optional[int]:  # up to the fresh decision that finds every batch drawn (None: no len)
        start, n = self.step - self._pos, self._source.num_batches()
        if n is not None and self._length[:2] != (start, n):
            t, found = start, 0
            while found < n:
                t += 1
                found += self._fresh_at(t)
            self._length = (start, n, t - start)
        return None if n is None else self._length[2]

    def _at_epoch_end(self) -> bool:
        return (length := self._epoch_length()) is not None and self._pos >= length

    def _leave_epoch(self, ended: bool = True, reopen: bool = False) -> None:  # the infos stay for its last batches
        self._source.end()
        self._epoch += int(ended)
        self._running, self._open = False, reopen
        self._pos = self._fresh = 0  # batches yielded and fresh draws in the epoch
        self._batch = self._ids = self._wrapped_state = None
        self._remember_state(clear=True)  # what a checkpoint between epochs holds

    def __len__(self) -> int:
        if self._running and self._at_epoch_end():
            self._leave_epoch()  # after its last step, len() describes the next epoch
        if (length := self._epoch_length()) is None:
            raise TypeError("LazySamplingLoader has no length: the wrapped source has none.")
        return length

    def __iter__(self) -> "LazySampler":
        if self._running:
            self._leave_epoch()  # a new pass: the rest of a running epoch is dropped
        self._open = True  # an epoch not begun or restored starts at the first next() (an unused iter() is harmless)
        return self

    def __next__(self) -> Any:
        if not self._open:
            raise StopIteration
        if not self._running:
            if self._pos and self._at_epoch_end():
                self._leave_epoch(reopen=True)  # restored after an epoch's last step: on with the next, as a new pass
            if self._pos == 0:
                self._source.begin(self._epoch)
            ready = self._trainer_ready()
            self._offset, self._running = 0 if ready is None else ready - self._pos, True
            self._infos.clear()
            self._remember_state(clear=True)
            if (length := self._epoch_length()) is not None:
                self._sync_trainer_length(self._offset + length)
        t = self.step
        fresh = self._pos == 0 or self._batch is None or self._fresh_at(t)
        if fresh:
            try:  # a source raises StopIteration after its last batch of the pass
                self._batch, self._ids, count, self._wrapped_state = self._source.draw(self._fresh,
                                                                                      self.distinct_samples)
            except StopIteration:
                self._leave_epoch()
                raise
            self._fresh, self.fresh_draws, self.distinct_samples = (self._fresh + 1, self.fresh_draws + 1,
                                                                    self.distinct_samples + count)
        self._infos.append((self._offset + self._pos, BatchInfo(fresh, self.fresh_draws - 1, self._ids,
                                                                self.distinct_samples, t)))
        self.step, self._pos = t + 1, self._pos + 1
        self._remember_state()
        return self._batch

    def _remember_state(self, clear: bool = False) -> None:  # a checkpoint's state now, by the next batch_idx
        if clear:
            self._states.clear()
        reused_next = self._batch is not None and not self._fresh_at(self.step)
        self._states.append((self._offset + self._pos, (self.step, self.fresh_draws, self.distinct_samples, self._pos,
                             self._fresh, self._ids, self._batch if reused_next else None, self._wrapped_state)))

    def _settings(self) -> dict:
        return {"p": self.p, "seed": self.seed, "num_replicas": self.num_replicas, "replica_rank": self.replica_rank,
                "source_kind": self._source.kind}

    def state_dict(self) -> dict:
        """All it takes to go on exactly after the batch the trainer took last (else the latest yielded)."""
        ready = self._trainer_ready()
        state = next((state for idx, state in self._states if idx == ready), self._states[-1][1])
        saved = dict(zip(_STATE_KEYS, state), version=_STATE_VERSION, epoch=self._epoch, **self._settings(),
                     **self._source.checkpoint())
        saved["batch"] = saved["batch"] if _is_plain(saved["batch"]) else None
        return saved

    def load_state_dict(self, state: dict) -> None:
        """The source is put back now; the next ``iter()`` resumes at the saved batch."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"LazySamplingLoader: the checkpoint holds lazy-sampling state of version "
                             f"{state.get('version')!r}, this code reads version {_STATE_VERSION}. Resume it with the "
                             "release that wrote it, or fit anew from `Model.load_from_checkpoint(path)`.")
        for key, value in self._settings().items():
            if (_as_schedule(state.get(key)) != _as_schedule(value)) if key == "p" else state.get(key) != value:
                warnings.warn(f"LazySamplingLoader: the checkpoint was written with {key}={state.get(key)!r}, this "
                              f"loader has {key}={value!r}; the resumed run will not repeat the uninterrupted one.")
        self._leave_epoch(ended=False)
        self.step, self.fresh_draws, self.distinct_samples, self._pos, self._fresh = (
            int(state[key]) for key in _STATE_KEYS[:5])
        self._epoch, self._ids, self._wrapped_state = int(state["epoch"]), state["ids"], state["wrapped_state"]
        need_batch = self._pos > 0 and state["batch"] is None and not self._fresh_at(self.step)
        rebuilt = self._source.restore(self._epoch, state, need_batch)
        self._batch = rebuilt if state["batch"] is None else state["batch"]
        if need_batch and rebuilt is None:
            warnings.warn("LazySamplingLoader: exact resume is impossible: the batch to reuse is not in the checkpoint "
                          "and cannot be rebuilt (keep batches to tensors, numbers and strings in lists, tuples and "
                          "dicts, or use a map-style DataLoader); a fresh batch is drawn instead.", RuntimeWarning)
        self._remember_state(clear=True)
