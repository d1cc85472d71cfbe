"""The lazy-sampling engine behind :class:`lightning_clapping.LazySamplingLoader`: decisions, epochs, the
:class:`BatchInfo` of each batch and the checkpoint state, over a source of :mod:`lightning_clapping.lazy.source`.

Lightning fetches one batch ahead of a source without length and checkpoints at the batch it has consumed, so the
sampler keeps the infos of its latest batches and its states after the last two yields, under the ``batch_idx``
Lightning gives the batch (``offset`` + position in the epoch). A state holds the current batch only when the next
step reuses it, so no older batch stays alive.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable
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
    """What the pipeline knows about one training batch.

    Attributes:
        fresh: drawn fresh at this step (r_t = 1); ``False``: the previous batch again.
        batch_id: fresh draws since training began, minus one: the same for every step of a reuse window.
        sample_ids: ``LongTensor`` of the batch's samples, in order: dataset indices for a map-style ``DataLoader``,
            a running count of the samples read for other sources; ``None`` when unknown.
        distinct_samples: samples read so far, this batch included (a reused batch adds nothing, a sample drawn
            again in a later epoch counts again): the data budget to report next to the step.
        step: batches the loader yielded before this one since training began.
    """

    fresh: bool
    batch_id: int
    sample_ids: Optional[Tensor] = field(compare=False)
    distinct_samples: int
    step: int


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
    """Fresh batch with probability ``p``, else the previous one again; epochs, batch infos and checkpoints.

    ``step``, ``fresh_draws`` and ``distinct_samples`` count, since training began, the batches yielded (Lightning may
    have fetched the latest ahead), the fresh draws and the samples read. An epoch is not begun (position 0),
    restored (position > 0, not running) or running.
    """

    def __init__(self, source: Iterable, p: float, seed: int, num_replicas: int, replica_rank: int) -> None:
        self.p, self.seed, self.num_replicas, self.replica_rank = p, seed, num_replicas, replica_rank
        self._base = _mix64((seed * _GAMMA + 0x632BE59BD9B4E019) & _MASK64)
        self._source = make_source(source, num_replicas, replica_rank, seed)
        self.step = self.fresh_draws = self.distinct_samples = 0
        self._epoch = 0  # the running or restored epoch, else the next one
        self._infos: OrderedDict[int, BatchInfo] = OrderedDict()  # by Lightning's batch_idx
        self._states: OrderedDict[int, tuple] = OrderedDict()  # after the latest yields, by the next batch_idx
        self._offset = 0  # Lightning's batch_idx minus the position (not 0 after some resumes of a source without len)
        self._length = (-1, -1, 0)  # (first step, batches, steps) of the last epoch simulated
        self._leave_epoch(ended=False)

    def _trainer_ready(self) -> Optional[int]:
        """Hook: batches the trainer took from the current epoch (its next batch_idx); None without a trainer."""
        return None

    def _sync_trainer_length(self, length: int) -> None:
        """Hook, at the first step of every epoch of known length: tell the trainer its number of batches."""

    def _fresh_at(self, step: int) -> bool:
        """Step t is fresh when ``u(seed, t) < p``, ``u`` the t-th uniform of a counter-based SplitMix64 stream: it
        depends on (seed, t) only, so processes agree, nothing is saved and the future can be simulated."""
        return (_mix64((self._base + (step + 1) * _GAMMA) & _MASK64) >> 11) / (1 << 53) < self.p

    @property
    def source(self) -> Iterable:
        """The wrapped train loader / iterable."""
        return self._source.wrapped

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
        if self._running or self._pos:
            self._leave_epoch()
        self._source = make_source(source, self.num_replicas, self.replica_rank, self.seed)

    def _epoch_length(self) -> Optional[int]:
        """Steps of the current epoch (None without length): it ends at the first fresh decision that finds every
        batch of the source drawn, and that step opens the next epoch."""
        start, n = self.step - self._pos, self._source.num_batches()
        if n is not None and self._length[:2] != (start, n):
            t, found = start, 0
            while found < n:
                t += 1
                found += self._fresh_at(t)
            self._length = (start, n, t - start)
        return None if n is None else self._length[2]

    def _at_epoch_end(self) -> bool:
        length = self._epoch_length()
        return length is not None and self._pos >= length

    def _leave_epoch(self, ended: bool = True) -> None:
        """Forget the running or restored epoch and close the pass (the infos stay for its last batches)."""
        self._source.end()
        self._epoch += int(ended)
        self._running = self._open = False
        self._pos = self._fresh = 0  # batches yielded and fresh draws in the epoch
        self._batch = self._ids = self._wrapped_state = None
        self._states.clear()

    def __len__(self) -> int:
        if self._running and self._at_epoch_end():
            self._leave_epoch()  # after its last step, len() describes the next epoch
        length = self._epoch_length()
        if length is None:
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
                self._leave_epoch()  # restored after an epoch's last step: on with the next, as a new pass would
                self._open = True
            self._begin()
        t = self.step
        if self._pos == 0 or self._batch is None or self._fresh_at(t):
            n = self._source.num_batches()
            try:
                if n is not None and self._fresh >= n:
                    raise StopIteration
                self._batch, self._ids, count, self._wrapped_state = self._source.draw(self._fresh,
                                                                                      self.distinct_samples)
            except StopIteration:
                self._leave_epoch()
                raise
            self._fresh, self.fresh_draws, self.distinct_samples = (self._fresh + 1, self.fresh_draws + 1,
                                                                    self.distinct_samples + count)
            fresh = True
        else:
            fresh = False
        self._infos[self._offset + self._pos] = BatchInfo(fresh, self.fresh_draws - 1, self._ids,
                                                          self.distinct_samples, t)
        while len(self._infos) > INFO_WINDOW:
            self._infos.popitem(last=False)
        self.step, self._pos = t + 1, self._pos + 1
        self._remember_state()
        return self._batch

    def _begin(self) -> None:
        if self._pos == 0:
            self._source.begin(self._epoch)
        ready = self._trainer_ready()
        self._offset = 0 if ready is None else ready - self._pos
        self._running = True
        self._infos.clear()
        self._states.clear()
        self._remember_state()
        length = self._epoch_length()
        if length is not None:
            self._sync_trainer_length(self._offset + length)

    def _remember_state(self) -> None:
        """Keep what a checkpoint right after the latest yield needs, under the batch_idx of the batch after it."""
        reused_next = self._batch is not None and not self._fresh_at(self.step)
        self._states[self._offset + self._pos] = (self.step, self.fresh_draws, self.distinct_samples, self._pos,
                                                  self._fresh, self._ids, self._batch if reused_next else None,
                                                  self._wrapped_state)
        while len(self._states) > 2:  # Lightning is at most one batch behind the latest yield
            self._states.popitem(last=False)

    def _settings(self) -> dict:
        return {"p": self.p, "seed": self.seed, "num_replicas": self.num_replicas, "replica_rank": self.replica_rank,
                "source_kind": self._source.kind}

    def state_dict(self) -> dict:
        """All it takes to go on exactly after the batch the trainer consumed last (without one: the latest yielded):
        counters, the epoch and position in it (0: begin it), the batch to reuse (when plain, else None: rebuilt on
        load) and what the source needs (the RNG states the epoch's order is drawn from, an iterable's state)."""
        if self._running or self._pos:
            state = self._states.get(self._trainer_ready()) or next(reversed(self._states.values()))  # type: ignore
        else:
            state = (self.step, self.fresh_draws, self.distinct_samples, 0, 0, None, None, None)
        saved = dict(zip(_STATE_KEYS, state), version=_STATE_VERSION, epoch=self._epoch, **self._settings(),
                     **self._source.checkpoint())
        saved["batch"] = saved["batch"] if _is_plain(saved["batch"]) else None
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Go on from a ``state_dict``: the source is put back now, the next ``iter()`` resumes at the saved batch."""
        state = dict(state_dict)
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"LazySamplingLoader: the checkpoint holds lazy-sampling state of version {state.get('version')!r}, "
                f"this code reads version {_STATE_VERSION} (the layout changed when lazy sampling was rewritten). "
                "Resume it with the release that wrote it, or start a new run from its weights "
                "(`Model.load_from_checkpoint(path)` and fit without ckpt_path).")
        for key, value in self._settings().items():
            if state.get(key) != value:
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
            warnings.warn("LazySamplingLoader: exact resume is impossible: the checkpoint does not hold the batch to "
                          "reuse and it cannot be rebuilt (keep batches to tensors, numbers and strings in lists, "
                          "tuples and dicts, or use a map-style DataLoader); a fresh batch is drawn instead.",
                          RuntimeWarning)
        if self._pos:
            self._remember_state()
