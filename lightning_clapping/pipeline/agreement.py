"""The run-time guard: the stages agree on the values each of them recomputes instead of receiving.

Every stage runs the parent's code. A value that depends only on the batch (an attention mask, position ids, rotary
tables) a later stage recomputes from its own copy of the batch rather than receiving it
(:mod:`lightning_clapping.pipeline.crossings`). That is right only while the value really depends on nothing else:
a random stream the tracker does not know of, state that differs between the processes, or code that reads the rank
would make the stages compute with different values, and the run would train something else than one process,
without an error. This guard is the safety net for such patterns, including those nobody listed.

**When.** On the first step of each kind (training, validation, test, predict), in the pass that finds the crossing
values: every stage runs its micro-batch 0 once without sending (stage 0 too, for this guard). Each stage summarises
(:func:`summary`) every recomputed value its own code uses after its entry; the stage whose part of the code makes the
value for real compares it with its own (:func:`check`). A mismatch stops the run on every stage with the operation,
its position in the step and the two stages named. Cost: stage 0's extra forward of one micro-batch and two small
all-gathers, once per kind of step.

**Again every N training steps** (:class:`Recheck`, ``recheck_every``, default 100): on micro-batch 0 of such a step
every stage summarises the same values as at the first step (a consumer its recomputed ones, their maker its own),
and one asynchronous all-gather of 6 integers per value carries them; it is read at the next step, where every stage
reaches the same verdict, so a value that drifts later (state a hook changes on one stage only) stops the run at most
one step after the check. Cost per check: the summaries (one pass over each compared tensor) and that gather; no
step waits on it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_clapping._compat import tree_flatten
from lightning_clapping.pipeline.crossing_plan import CrossingError, where

_EXACT, _FLOAT = 0, 1
_F64 = struct.Struct("<d")
_REL = 1e-5  # floats computed from the same inputs by the same code agree far closer than this on every device


def _bits(x: float) -> int:
    return struct.unpack("<q", _F64.pack(x))[0]


def _float(bits: int) -> float:
    return _F64.unpack(struct.pack("<q", bits))[0]


def summary(t: Tensor) -> tuple[int, int, int, int, int]:
    """A tensor in five integers: for integer and bool tensors a CRC of their bytes (compared exactly); for floating
    ones a CRC of where they hold inf, -inf and NaN (compared exactly), then the float64 sum, sum of magnitudes and a
    position-weighted sum (so a permutation shows) of the finite values, compared with a relative tolerance
    (:func:`agree`), since kernels may round differently on different devices."""
    flat = t.detach().reshape(-1)
    if not (flat.dtype.is_floating_point or flat.dtype.is_complex):
        return (_EXACT, _crc(flat), flat.numel(), 0, 0)
    x = (flat if not flat.dtype.is_complex else torch.view_as_real(flat).reshape(-1)).double()
    finite = torch.isfinite(x)
    pattern = torch.where(finite, 0, torch.where(torch.isnan(x), 1, torch.where(x > 0, 2, 3))).to(torch.uint8)
    x = torch.where(finite, x, 0.0)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device).remainder_(97).add_(1)
    return (_FLOAT, _crc(pattern), _bits(float(x.sum())), _bits(float(x.abs().sum())),
            _bits(float((x * weights).sum())))


def _crc(t: Tensor) -> int:
    return zlib.crc32(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two :func:`summary` values describe the same tensor (floats: to a relative 1e-5 of its magnitude)."""
    if a[0] != b[0] or a[1] != b[1]:
        return False
    if a[0] == _EXACT:
        return tuple(a) == tuple(b)
    sa, ma, wa = map(_float, a[2:])
    sb, mb, wb = map(_float, b[2:])
    scale = max(ma, mb) * 98 + 1e-30
    return all(abs(u - v) <= _REL * scale for u, v in ((sa, sb), (ma, mb), (wa, wb)))


def _leaf(out: Any, leaf: int) -> Tensor | None:
    flat = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
    value = flat[leaf] if 0 <= leaf < len(flat) else None
    return value if isinstance(value, Tensor) else None


def check(uses: dict[tuple[int, int], tuple[int, Tensor]], own: dict[int, Any], names: dict[int, str], stage: int,
          exchange: Callable[[Tensor], list[Tensor]]) -> list[tuple[int, int, int, int]]:
    """Collective over the pipeline, after the pass that found the crossing values.

    ``uses``: the recomputed values this stage's code used after its entry, (event, leaf) -> (region that makes it,
    the value); ``own``: event -> output of every operation this stage ran inside its part; ``names``: event ->
    operation; ``exchange`` all-gathers an int64 (n, k) tensor whose n may differ between stages."""
    rows = [(e, leaf, region, stage, *summary(t)) for (e, leaf), (region, t) in sorted(uses.items())]
    wrong, keys = [], []
    for block in exchange(torch.tensor(rows, dtype=torch.int64).reshape(-1, 9)):
        for e, leaf, region, consumer, *theirs in block.tolist():
            keys.append((e, leaf, region, consumer))
            if region != stage or e not in own:
                continue
            mine = _leaf(own[e], leaf)
            if mine is not None and not agree(summary(mine), tuple(theirs)):
                wrong.append((e, leaf, consumer, stage))
    reports = [r for block in exchange(torch.tensor(wrong, dtype=torch.int64).reshape(-1, 4)) for r in block.tolist()]
    if reports:
        raise _mismatch(reports, names, "")
    return sorted(keys)


def _mismatch(reports: list, names: dict[int, str], when: str) -> CrossingError:
    e, leaf, consumer, origin = min(reports)
    op = names.get(e, "an operation")
    return CrossingError(
        f"stage {consumer} recomputes the value made by `{op}` at {where(e)} of the step (output {leaf}) from its "
        f"own copy of the batch, and gets another value than stage {origin}, which computes it for real: the "
        "stages would train on different values. The value depends on more than the batch and the code: a random "
        "stream the pipeline does not follow, state that differs between processes (set in a hook that runs on "
        "one stage only, or read from the rank or the environment), or a non-deterministic kernel. Compute it "
        "from the batch and the module's parameters and buffers only, or draw it with torch's random functions, "
        f"whose values the pipeline sends from where they are drawn ({len(reports)} value(s) differ{when}).")


class Recheck:
    """The guard again every ``every`` training steps (see the module docstring), over the values the first training
    step compared (``keys``: event, output, the stage that makes it, the stage that recomputes it)."""

    def __init__(self, stage: int, every: int | None) -> None:
        self.stage, self.every = stage, every
        self.keys: list[tuple[int, int, int, int]] = []
        self._rows: Tensor | None = None
        self._pending: tuple[Any, list[Tensor], dict[int, str], int] | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and bool(self.keys) and step > 0 and step % int(self.every) == 0

    def summarise(self, uses: dict[tuple[int, int], tuple[int, Tensor]], own: dict[int, Any]) -> None:
        """After micro-batch 0 of a due step: this stage's summary of each key it recomputes or makes."""
        rows = torch.zeros((len(self.keys), 6), dtype=torch.int64)
        for i, (e, leaf, region, consumer) in enumerate(self.keys):
            value = uses.get((e, leaf), (0, None))[1] if consumer == self.stage else \
                _leaf(own[e], leaf) if region == self.stage and e in own else None
            if value is not None:
                rows[i] = torch.tensor((1, *summary(value)), dtype=torch.int64)
        self._rows = rows

    def start(self, group: Any, num_stages: int, device: torch.device, names: dict[int, str], step: int) -> None:
        """At the end of the due step: the asynchronous all-gather of every stage's summaries over ``group``."""
        mine = (self._rows if self._rows is not None else torch.zeros((len(self.keys), 6), dtype=torch.int64))
        mine = mine.to(device)
        gathered = [torch.zeros_like(mine) for _ in range(num_stages)]
        work = torch.distributed.all_gather(gathered, mine, group=group, async_op=True)
        self._pending, self._rows = (work, gathered, dict(names), step), None

    def finish(self, block_of_stage: Callable[[int], int]) -> None:
        """At the next step: wait for the gather (every stage started it) and compare; every stage raises alike."""
        if self._pending is None:
            return
        work, gathered, names, step = self._pending
        self._pending = None
        work.wait()
        blocks = [b.cpu().tolist() for b in gathered]
        wrong = []
        for i, (e, leaf, region, consumer) in enumerate(self.keys):
            theirs, mine = blocks[block_of_stage(consumer)][i], blocks[block_of_stage(region)][i]
            if theirs[0] and mine[0] and not agree(tuple(mine[1:]), tuple(theirs[1:])):
                wrong.append((e, leaf, consumer, region))
        if wrong:
            raise _mismatch(wrong, names, f", at the check of step {step}; they agreed at the first step")


__all__ = ["Recheck", "agree", "check", "summary"]
