"""``CodecScheduler``: change the training messages' codecs as training goes, the way Lightning's
``GradientAccumulationScheduler`` changes accumulation.

    trainer = L.Trainer(strategy=ClappingStrategy(variant="clapping-fc", forward_codec="q1", backward_codec="q1"),
                        callbacks=[CodecScheduler({300: ("q4", "q8")})])   # 1 bit until step 300, then q4/q8

``scheduling`` maps an optimizer step (``trainer.global_step``) to the ``(forward, backward)`` codecs used from that
step on; before its first key the strategy's own ``forward_codec`` / ``backward_codec`` apply. Each change happens
between two steps on every rank (every rank runs the callback at the same step), on every boundary the strategy
compresses (a boundary a codec map leaves uncompressed stays so); the rebuilt messages start with empty error-feedback
buffers, so the first messages after a change go as the variant sends a first message (in full with ``warm_start``).
The codecs in force are saved in checkpoints and adopted when a run resumes, so a resumed run continues exactly.

Evaluation messages, ``fresh_codec`` and autotune are not scheduled: with ``autotune=True`` (which chooses the codecs
itself) or ``variant="uncompressed"`` the callback refuses to start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_clapping.codecs import Codec, get_codec
from lightning_clapping.tuning import check_schedulable

__all__ = ["CodecScheduler"]


class CodecScheduler(pl.Callback):
    """``scheduling``: ``{step: (forward_codec, backward_codec)}``, codecs by registry string or as ``Codec``."""

    def __init__(self, scheduling: Mapping[int, Sequence[str | Codec]]) -> None:
        if not isinstance(scheduling, Mapping) or not scheduling:
            raise ValueError(f"CodecScheduler: scheduling must be a non-empty dict {{step: (forward_codec, "
                             f"backward_codec)}}, e.g. {{300: ('q4', 'q8')}}; got {scheduling!r}")
        steps: dict[int, tuple[Codec, Codec]] = {}
        for step, pair in scheduling.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"CodecScheduler: the keys are optimizer steps (integers >= 0), got {step!r}")
            if isinstance(pair, (str, Codec)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"CodecScheduler: step {step} must map to (forward_codec, backward_codec), e.g. "
                                 f"('q4', 'q8'); got {pair!r}")
            steps[step] = (_by_name(pair[0], step), _by_name(pair[1], step))
        self.scheduling = dict(sorted(steps.items()))

    def codecs_at(self, step: int) -> tuple[Codec, Codec] | None:
        """The codecs the schedule sets for optimizer step ``step`` (``None``: before its first key)."""
        due = [pair for start, pair in self.scheduling.items() if start <= step]
        return due[-1] if due else None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not callable(getattr(trainer.strategy, "set_codecs", None)):
            raise ValueError(f"CodecScheduler schedules the codecs of ClappingStrategy; this Trainer runs "
                             f"{type(trainer.strategy).__name__}: pass strategy=ClappingStrategy(...)")
        check_schedulable(trainer.strategy.options)  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        pair = self.codecs_at(trainer.global_step)
        if pair is not None:  # the same codecs as in force change nothing (a resumed run keeps its buffers)
            trainer.strategy.set_codecs(*pair)  # type: ignore[attr-defined]


def _by_name(spec: str | Codec, step: int) -> Codec:
    """The codec, if its name gives it back: a checkpoint keeps the codecs in force by name."""
    try:
        codec = get_codec(spec)
        again = get_codec(codec.name)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"CodecScheduler: step {step}: {err}") from err
    if type(again) is not type(codec) or again.name != codec.name:
        raise ValueError(f"CodecScheduler: step {step}: the codec {codec!r} cannot be built again from its name "
                         f"{codec.name!r}, which is what a checkpoint keeps; register it with "
                         "lightning_clapping.register_codec, or pass its registry string")
    return codec
