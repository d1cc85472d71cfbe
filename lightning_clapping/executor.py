"""Runs one stage's share of a schedule: forwards, backwards, and the messages between them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping import schedule as schedules
from lightning_clapping.channel import FLAG_REQUIRES_GRAD, Part, PeerChannel, from_raw_bytes, pack, raw_bytes, unpack
from lightning_clapping.stage import SplitError, StageExit, StageRunner, check_finite

PURPOSE_TRAIN_FWD = 1
PURPOSE_TRAIN_BWD = 2
PURPOSE_EVAL_FWD = 3


class RawCodec:
    """Sends every tensor as its own bytes (the uncompressed wire format)."""

    def encode(self, tensors: list[Tensor], direction: str, slot: int) -> list[Part]:
        return [
            Part(0, t.dtype, tuple(t.shape), raw_bytes(t), FLAG_REQUIRES_GRAD if t.requires_grad else 0)
            for t in tensors
        ]

    def decode(self, parts: list[Part], direction: str, slot: int) -> list[Tensor]:
        return [from_raw_bytes(p.payload, p.dtype, p.shape) for p in parts]


@dataclass
class StepStats:
    """What one step sent from this rank, in bytes (headers and resize messages included)."""

    fwd_bytes: int = 0
    bwd_bytes: int = 0
    fwd_messages: int = 0
    bwd_messages: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class PipelineExecutor:
    """One stage's executor. ``rank_of_stage`` maps stage indices to global ranks."""

    def __init__(
        self,
        runner: StageRunner,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        schedule: str = "1f1b",
        group: dist.ProcessGroup | None = None,
        prepost: bool = True,
        timeout: timedelta | None = None,
        codec: Any = None,
        eval_codec: Any = None,
    ) -> None:
        self.runner = runner
        self.stage = runner.stage
        self.num_stages = runner.num_stages
        self.schedule_fn = schedules.get_schedule(schedule)
        self.device = device
        self.codec = codec or RawCodec()
        self.eval_codec = eval_codec or RawCodec()
        self.first_step = True
        s, n = self.stage, self.num_stages

        def chan(peer_stage: int, purpose: int) -> PeerChannel | None:
            if not 0 <= peer_stage < n:
                return None
            return PeerChannel(rank_of_stage(peer_stage), purpose, device, group, prepost, timeout)

        self.fwd_out, self.fwd_in = chan(s + 1, PURPOSE_TRAIN_FWD), chan(s - 1, PURPOSE_TRAIN_FWD)
        self.bwd_out, self.bwd_in = chan(s - 1, PURPOSE_TRAIN_BWD), chan(s + 1, PURPOSE_TRAIN_BWD)
        self.eval_out, self.eval_in = chan(s + 1, PURPOSE_EVAL_FWD), chan(s - 1, PURPOSE_EVAL_FWD)
        self.prepost = prepost

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # ------------------------------------------------------------------ training
    def train_step(
        self,
        microbatches: list[Any],
        step_fn: Callable[[Any, int], Any],
        loss_weights: list[float],
    ) -> tuple[list[Any], StepStats]:
        """Forward and backward every micro-batch. Returns the last stage's step outputs (else []) and the stats.

        ``step_fn(microbatch, index)`` is the user's step; on the last stage it must return the loss (a scalar
        tensor or a dict with ``"loss"``), which is multiplied by ``loss_weights[index]`` before its backward.
        """
        n = len(microbatches)
        plan = self.schedule_fn(self.num_stages, n)[self.stage]
        before = self._counters()
        if self.prepost:
            for j in range(n):
                if self.fwd_in is not None:
                    self.fwd_in.post(j)
                if self.bwd_in is not None:
                    self.bwd_in.post(j)
        saved: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        outputs: dict[int, Any] = {}
        for action in plan:
            j = action.microbatch
            if action.kind == "F":
                received: list[Tensor] = []
                out = self._forward(microbatches[j], j, step_fn, self.fwd_in, self.codec, received)
                if self.is_last:
                    loss = _loss_of(out)
                    if self.first_step:
                        check_finite([loss.detach()], f"loss of micro-batch {j} on the last stage", True)
                    outputs[j] = out
                    saved[j] = ([loss * loss_weights[j]], received)
                else:
                    sent = out
                    self._send(self.fwd_out, j, sent, self.codec, "fwd", check=True)
                    saved[j] = ([t for t in sent if t.requires_grad], received)
            else:
                roots, received = saved.pop(j)
                if self.is_last:
                    grads = None
                else:
                    grads = self._recv(self.bwd_in, j, self.codec, "bwd")
                    if len(grads) != len(roots):
                        raise SplitError(
                            f"stage {self.stage} got {len(grads)} gradients for micro-batch {j} but sent "
                            f"{len(roots)} tensors that require grad"
                        )
                if roots:
                    torch.autograd.backward(roots, grads)
                if not self.is_first:
                    leaves = [t for t in received if t.requires_grad]
                    gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
                    self._send(self.bwd_out, j, gin, self.codec, "bwd", check=False)
        self._flush()
        self.first_step = False
        return [outputs[j] for j in sorted(outputs)], self._stats(before)

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, microbatches: list[Any], step_fn: Callable[[Any, int], Any]) -> tuple[list[Any], StepStats]:
        """Forward only (validation, test, predict). Returns the last stage's step outputs (else [])."""
        n = len(microbatches)
        before = self._counters()
        if self.prepost and self.eval_in is not None:
            for j in range(n):
                self.eval_in.post(j)
        outputs = []
        for j in range(n):
            out = self._forward(microbatches[j], j, step_fn, self.eval_in, self.eval_codec, None)
            if self.is_last:
                outputs.append(out)
            else:
                self._send(self.eval_out, j, out, self.eval_codec, "eval", check=True)
        self._flush()
        return outputs, self._stats(before)

    # ------------------------------------------------------------------ pieces
    def _forward(self, mb: Any, j: int, step_fn, chan: PeerChannel | None, codec, received: list[Tensor] | None):
        def provide() -> list[Tensor]:
            assert chan is not None
            tensors = self._recv(chan, j, codec, "fwd" if received is not None else "eval")
            if received is not None:
                tensors = [t.requires_grad_(True) if _wants_grad(t, f) else t for t, f in tensors]
                received.extend(tensors)
            else:
                tensors = [t for t, _ in tensors]
            return tensors

        with self.runner.microbatch(provide if chan is not None else None):
            try:
                out = step_fn(mb, j)
            except StageExit:
                return self.runner.captured_tensors()
        if not self.is_last:
            self.runner.captured_tensors()  # raises: the exit module was never called
        return out

    def _send(self, chan: PeerChannel, j: int, tensors: list[Tensor], codec, direction: str, check: bool) -> None:
        if check:
            check_finite([t.detach() for t in tensors], f"stage {self.stage} output for micro-batch {j}",
                         self.first_step)
        chan.send(j, pack(codec.encode(tensors, direction, j), self.device))

    def _recv(self, chan: PeerChannel, j: int, codec, direction: str):
        parts = unpack(chan.recv(j))
        tensors = codec.decode(parts, direction, j)
        if direction == "bwd":
            return tensors
        return list(zip(tensors, [p.flags for p in parts]))

    def _flush(self) -> None:
        for chan in (self.fwd_out, self.bwd_out, self.eval_out):
            if chan is not None:
                chan.flush()

    def _counters(self) -> tuple[int, int, int, int]:
        f = (self.fwd_out.bytes_sent + self.eval_out.bytes_sent) if self.fwd_out else 0
        fm = (self.fwd_out.messages_sent + self.eval_out.messages_sent) if self.fwd_out else 0
        b = self.bwd_out.bytes_sent if self.bwd_out else 0
        bm = self.bwd_out.messages_sent if self.bwd_out else 0
        return f, b, fm, bm

    def _stats(self, before: tuple[int, int, int, int]) -> StepStats:
        now = self._counters()
        return StepStats(now[0] - before[0], now[1] - before[1], now[2] - before[2], now[3] - before[3])


def _wants_grad(t: Tensor, flags: int) -> bool:
    return bool(flags & FLAG_REQUIRES_GRAD) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _loss_of(out: Any) -> Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise SplitError(
            "with a pipeline strategy, training_step must return the loss (a scalar tensor, or a dict with 'loss') "
            f"for every micro-batch; got {type(out).__name__}. Skipping a batch by returning None is not supported."
        )
    return loss.reshape(())
