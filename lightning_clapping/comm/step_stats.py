"""What one training step sent from a rank: the numbers every stage gathers into the byte totals
(:mod:`lightning_clapping.comm.step_results`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """What one step sent from this rank (bytes include headers and resize messages)."""

    fwd_bytes: int = 0
    bwd_bytes: int = 0
    fwd_raw_bytes: int = 0  # what the same messages would have taken uncompressed (fp32 for float tensors)
    bwd_raw_bytes: int = 0
    fwd_diff_sq: float = 0.0
    fwd_value_sq: float = 0.0
    bwd_diff_sq: float = 0.0
    bwd_value_sq: float = 0.0
    skipped: int = 0
    feedback_bytes: int = 0  # error-feedback state held on this rank (both ends of its boundaries)
    control_bytes: int = 0  # the step results forwarded with the last gradient message (part of bwd_bytes)
    compute_s: float = 0.0  # forward and backward time on this rank, waits for messages left out
    crossing_raw_bytes: float = 0.0  # the values crossing cuts outside the cut modules' inputs, and their gradients,
    #                                  uncompressed (part of the raw bytes; see pipeline.crossings)
    replica_bytes: float = 0.0  # what this rank sends in its replicas' gradient average (comm.replicas.GradientAverager)
    replica_raw_bytes: float = 0.0  # the same in fp32

    def count_sent(self, direction: str, sent: int, raw: int) -> None:
        """A message of ``direction`` ("fwd" or "bwd"): ``sent`` bytes handed to torch.distributed, ``raw`` as fp32."""
        if direction == "fwd":
            self.fwd_bytes, self.fwd_raw_bytes = self.fwd_bytes + sent, self.fwd_raw_bytes + raw
        else:
            self.bwd_bytes, self.bwd_raw_bytes = self.bwd_bytes + sent, self.bwd_raw_bytes + raw

    def count_difference(self, direction: str, diff_sq: float, value_sq: float, skipped: int) -> None:
        """What the rule sending ``direction`` ("fwd" or "bwd") reports after the step: the squared norms of what it
        left out and of what it compressed, and the messages it skipped."""
        if direction == "fwd":
            self.fwd_diff_sq, self.fwd_value_sq = diff_sq, value_sq
        else:
            self.bwd_diff_sq, self.bwd_value_sq = diff_sq, value_sq
        self.skipped += skipped

    def as_list(self) -> list[float]:
        return [float(getattr(self, f)) for f in self.__dataclass_fields__]

    @classmethod
    def from_list(cls, values: list[float]) -> StepStats:
        return cls(*values)


__all__ = ["StepStats"]
