"""Every-step averaging: each stage's gradients averaged over its replicas before each optimizer step, as under DDP
(:class:`~lightning_clapping.comm.replicas.GradientAverager`, optionally through a DDP communication hook)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_clapping.comm.replicas import GradientAverager
from lightning_clapping.sync.base import ReplicaSync


class EveryStepSync(ReplicaSync):
    name = "every-step"

    def __init__(self, averager: GradientAverager) -> None:
        super().__init__()
        self.averager = averager
        self.counted = averager.counted

    def after_backward(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        self.averager.start(params)  # overlaps the pipeline's drain
        self.count(self.averager.sent_bytes, self.averager.raw_bytes)

    def before_step(self) -> None:
        self.averager.finish()
