"""``RankScheduler``: widen the code of every :class:`~lightning_clapping.Bottleneck` as training goes, the way
:class:`~lightning_clapping.CodecScheduler` changes the codecs.

    model = ...  # Bottleneck(128, 64) at each cut
    trainer = L.Trainer(strategy=ClappingStrategy(split_points=[...]),
                        callbacks=[RankScheduler({0: 16, 320: 64})])   # 16 values per position, then 64 from step 320

``scheduling`` maps an optimizer step (``trainer.global_step``) to the number of values per position each bottleneck
codes from that step on (``Bottleneck.set_code_width``); the cut then carries that many, so the bytes on the wire
follow the schedule. It must start at step 0 and never narrow: a code only widens. Columns of ``up`` not yet in use
are zero and get no gradient, so a widening adds values that start at zero contribution (the model's function does
not jump at the change), and the model computes the same function at any width: a checkpoint saved mid-schedule runs
the same in one process at full rank, and a resumed run takes the width of its step. Narrowing is refused because the
values it drops are ones the next stage has learned to read, and an optimizer's momentum would go on moving their
weights after they left the code.

The width due is set before the sanity check's validation and at the start of every training batch, once the run's
step is known (a resumed run takes its step's width). At step 0 the first width applies to whatever the model holds
(a fresh model's unused columns are its random start); a run resumed at a later step whose checkpoint holds non-zero
columns past the width due (one trained with a wider code) is refused, rather than those columns being erased.

Every width must fit every plain bottleneck of the model (``width <= rank``); a model with none (also one that
builds its layers in ``configure_model``: they are looked for once it has run), or with a residual bottleneck (whose
encoder always codes its full rank), is refused when fitting starts, before the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from lightning_clapping.pipeline.bottleneck import Bottleneck, bottlenecks_of

__all__ = ["RankScheduler"]

WHO = "RankScheduler"


class RankScheduler(pl.Callback):
    """``scheduling``: ``{step: code width}``, starting at step 0, widths that never decrease."""

    def __init__(self, scheduling: Mapping[int, int]) -> None:
        example = "e.g. {0: 16, 320: 64}"
        if not isinstance(scheduling, Mapping) or 0 not in scheduling:
            raise ValueError(f"{WHO}: scheduling must be a dict {{step: code width}} with a width for step 0, "
                             f"{example}; got {scheduling!r}")
        for step, width in scheduling.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"{WHO}: the keys are optimizer steps (integers >= 0), got {step!r}")
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"{WHO}: step {step} must map to a code width (an integer >= 1), got {width!r}")
        self.scheduling = dict(sorted(scheduling.items()))
        widths = list(self.scheduling.values())
        if any(b < a for a, b in zip(widths, widths[1:])):
            raise ValueError(f"{WHO}: the code may only widen as training goes, got {self.scheduling}; a narrower "
                             f"code drops values the next stage has learned to read")
        self._bottlenecks: list[Bottleneck] = []

    def width_at(self, step: int) -> int:
        """The code width the schedule sets for optimizer step ``step``."""
        return [w for start, w in self.scheduling.items() if start <= step][-1]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = bottlenecks_of(pl_module, WHO)
        widest = max(self.scheduling.values())
        for name, b in found.items():
            if b.residual:
                raise ValueError(f"{WHO}: {name} is a residual bottleneck, whose encoder always codes its full "
                                 f"rank; schedule the code of plain ones (Bottleneck(..., residual=False))")
            if widest > b.rank:
                raise ValueError(f"{WHO}: the schedule's widest code ({widest} values) is wider than {name}'s rank "
                                 f"{b.rank}; build the bottlenecks with a rank of at least {widest}")
        self._bottlenecks = list(found.values())

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer.global_step, check=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer.global_step, check=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._apply(trainer.global_step, check=False)

    def _apply(self, step: int, check: bool) -> None:
        """Every bottleneck at the width due at ``step``; with ``check`` (before training goes on), a resumed run's
        weights must not hold values past that width."""
        width = self.width_at(step)
        for b in self._bottlenecks:
            up = b.up.weight
            if check and step > 0 and not up.is_meta and bool(up[:, width:].detach().ne(0).any()):
                raise ValueError(f"{WHO}: at step {step} the schedule codes {width} values, but the weights hold "
                                 f"trained values past them (up's columns from {width} on are not zero): the "
                                 f"checkpoint was trained with a wider code. Resume it with a schedule that gives "
                                 f"step {step} the width it was trained with, or without RankScheduler")
            b.set_code_width(width)
