"""Tied parameters across stages: every stage that uses a tied tensor trains a copy, and the copies stay identical.

A tensor shared by units of several stages (GPT-2's ``lm_head.weight is transformer.wte.weight``: the input
embedding on the first stage, the output head on the last) is a :class:`TiedGroup` of the partition. Each of its
stages keeps its own copy (releasing the other stages' units replaces the parameter on those modules only),
computes its part of the gradient, and then, after the last backward of a step and before clipping and the
optimizer step, :meth:`TiedGradients.sum_gradients` makes every copy's gradient the whole one:

* every member sends its gradient to every other member, point to point over the pipeline's group;
* every member adds the members' gradients **in stage order**, starting from the first member's, so all of them
  compute the same sum from the same bits: the copies' gradients are bit-identical, and so are the copies after the
  (identical) optimizer step. One process accumulates the two contributions in autograd's order instead: the values
  agree to rounding.

With a codec (``tied_codec=``) each member sends ``C(g + e)`` and keeps the residual ``e = g + e - D(C(g + e))``
(error feedback, on the sender only); every member decodes every member's payload, its own included, with the same
codec and seed and adds the decoded values in stage order, so the copies stay identical under compression too. A
gradient holding inf or NaN (an overflow step under 16-bit loss scaling), which no codec takes, is sent as a payload
flagged non-finite (one byte after the codec's): every member adds NaN for it, so every copy shows the overflow and
the loss scaler skips the step everywhere; the residual is kept for the next step.

Per step and group of ``k`` copies the pipeline sends ``k (k - 1)`` payloads (uncompressed: the tensor's bytes), once
per optimizer step (not per accumulated batch). :meth:`TiedGradients.step_bytes` says how many, for the byte totals.

Why :class:`TiedGroup` is defined here, and the codec is typed by :class:`~lightning_clapping.comm.wire.PayloadCodec`:
``comm/`` sits below ``pipeline/`` and ``codecs/`` and imports neither. The partition
(:mod:`lightning_clapping.pipeline.partition`, which re-exports the name) builds the groups this module sums over, and
any codec of :mod:`lightning_clapping.codecs` has what the sum asks of it (encode, decode, sizes, the check of a
payload that arrived).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_clapping.comm.p2p import P2PQueue
from lightning_clapping.comm.wire import PayloadCodec, WireError, decode_payload

#: tags of the tied messages: ``TAG_BASE + group index`` (the pipeline's own tags are below 4_000_000)
TAG_BASE = 4_000_000


@dataclass(frozen=True)
class TiedGroup:
    """One tensor that units of several stages share (tied weights, e.g. an input embedding and an output head).

    Every stage in :attr:`stages` holds its own copy (each trains it; their gradients are summed over those stages
    every step, see :class:`TiedGradients`, so the copies stay identical); a checkpoint saves it once. The partition
    (:func:`lightning_clapping.pipeline.partition.build_partition`) finds them.
    """

    #: the tensor's state-dict keys, in registration order, and the stage of each
    keys: tuple[str, ...]
    key_stages: tuple[int, ...]

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages that hold a copy, in order."""
        return tuple(sorted(set(self.key_stages)))

    def key_on(self, stage: int) -> str | None:
        """The first of the keys that ``stage`` holds (None: it holds no copy)."""
        return next((k for k, s in zip(self.keys, self.key_stages) if s == stage), None)


class TiedGradients:
    """This stage's part of keeping the partition's tied copies identical (see the module docstring).

    ``rank_of_stage`` maps a stage of this rank's pipeline to its global rank; ``group`` is the pipeline's process
    group (``None``: the default group).
    """

    def __init__(self, groups: Sequence[TiedGroup], stage: int, rank_of_stage: Callable[[int], int], group: Any,
                 device: torch.device, codec: PayloadCodec | None = None, timeout: timedelta | None = None) -> None:
        self.groups = list(groups)
        self.stage = stage
        self.rank_of_stage = rank_of_stage
        self.group = group
        self.device = device
        self.codec = codec
        self.timeout = timeout
        #: error-feedback residual per group index (compressed only), on this stage
        self.residuals: dict[int, Tensor] = {}
        self._before: dict[int, Tensor] = {}  # the residuals before the last sum (see :meth:`discard_step`)
        self._synced = False

    def held(self) -> list[tuple[int, TiedGroup]]:
        """The groups this stage holds a copy of, with their index in the partition (the same on every stage)."""
        return [(i, g) for i, g in enumerate(self.groups) if self.stage in g.stages]

    def _param(self, module: nn.Module, group: TiedGroup) -> nn.Parameter:
        key = group.key_on(self.stage)
        assert key is not None
        return module.get_parameter(key)

    # ------------------------------------------------------------------ the sum
    def sum_gradients(self, module: nn.Module, step: int) -> None:
        """Collective over the members of every group this stage holds: each copy's ``.grad`` becomes the sum of all
        copies' gradients (a copy without a gradient counts as zeros). Call on every stage, after the last backward
        of an optimizer step; ``step`` (the same on every stage) seeds stochastic codecs."""
        held = self.held()
        if not held:
            return
        self._before = dict(self.residuals)  # _encode replaces a residual, never writes into it
        ops, mine, theirs = [], {}, {}
        for i, g in held:
            p = self._param(module, g)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            payload, decoded = self._encode(i, grad, step)
            mine[i] = (p, grad, payload, decoded)
            for s in g.stages:
                if s == self.stage:
                    continue
                buf = torch.empty_like(payload)
                theirs[(i, s)] = buf
                ops.append(dist.P2POp(dist.irecv, buf, self.rank_of_stage(s), self.group, TAG_BASE + i))
                ops.append(dist.P2POp(dist.isend, payload, self.rank_of_stage(s), self.group, TAG_BASE + i))
        self._exchange(ops)
        for i, g in held:
            p, grad, payload, decoded = mine[i]
            parts = [decoded if s == self.stage else self._decode(theirs[(i, s)], grad, step, i, s) for s in g.stages]
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            if p.grad is None:
                p.grad = total
            else:
                p.grad.copy_(total)

    def discard_step(self) -> None:
        """The optimizer step after the last :meth:`sum_gradients` was not taken (torchft's vote refused it): the
        residuals go back to what they were before that sum. The residual assumes that ``D(C(g + e))`` reached the
        weights; a refused step applied none of it, and its gradient may be undefined (a failed all-reduce)."""
        self.residuals = dict(self._before)

    def _encode(self, index: int, grad: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(what this stage sends, the value every member adds for it)."""
        if self.codec is None:
            flat = grad.detach().contiguous()
            return flat, flat
        residual = self.residuals.get(index)
        target = grad.detach() if residual is None else grad.detach() + residual
        if not bool(torch.isfinite(target).all()):
            size = self.codec.payload_nbytes(target.shape, target.dtype)
            payload = torch.zeros(size + 1, dtype=torch.uint8, device=target.device)
            payload[-1] = 1
            return payload, torch.full_like(target, float("nan"))
        seed = _seed(step, index, self.stage)
        payload = self.codec.encode(target, seed=seed)
        decoded = self.codec.decode(payload, target.shape, target.dtype, seed=seed)
        self.residuals[index] = target - decoded
        return torch.cat([payload, payload.new_zeros(1)]), decoded

    def _decode(self, payload: Tensor, like: Tensor, step: int, index: int, stage: int) -> Tensor:
        if self.codec is None:
            return payload
        where, flag = f"tied tensor {self.groups[index].keys[0]!r} from stage {stage}", int(payload[-1])
        if flag not in (0, 1):
            raise WireError(f"{where}: the finite flag is {flag}, not 0 or 1")
        if flag:  # the member's gradient was not finite
            return torch.full_like(like, float("nan"))
        return decode_payload(self.codec, payload[:-1], like.shape, like.dtype, seed=_seed(step, index, stage),
                              where=where)

    def _exchange(self, ops: list[dist.P2POp]) -> None:
        queue = P2PQueue(ordered=True, timeout=self.timeout)
        queue.issue(ops)
        queue.flush()

    # ------------------------------------------------------------------ once, and for the norm
    def sync_copies(self, module: nn.Module) -> None:
        """Once, before the first step: every copy takes the first member's values (collective over the members).

        Copies of an eagerly built model are equal already; a model materialized per stage initialises each copy by
        its own module's rule, and the tie means the first one (as ``tie_weights`` gives the head the embedding)."""
        if self._synced:
            return
        self._synced = True
        ops, received = [], []
        for i, g in self.held():
            p = self._param(module, g)
            first = g.stages[0]
            if self.stage == first:
                value = p.detach().contiguous()
                for s in g.stages[1:]:
                    ops.append(dist.P2POp(dist.isend, value, self.rank_of_stage(s), self.group, TAG_BASE + i))
            else:
                buf = torch.empty_like(p.detach())
                ops.append(dist.P2POp(dist.irecv, buf, self.rank_of_stage(first), self.group, TAG_BASE + i))
                received.append((p, buf))
        self._exchange(ops)
        with torch.no_grad():
            for p, buf in received:
                p.copy_(buf)

    def uncounted(self, module: nn.Module) -> set[int]:
        """Ids of this stage's tied parameters whose norm another stage counts (the first member counts each group
        once in the whole model's gradient norm)."""
        return {id(self._param(module, g)) for _, g in self.held() if g.stages[0] != self.stage}

    # ------------------------------------------------------------------ bytes and state
    def step_bytes(self, module: nn.Module) -> tuple[int, int]:
        """(bytes sent, the same uncompressed in fp32) by the whole pipeline for one sum: the same on every stage."""
        sent = raw = 0
        params = dict(module.named_parameters(remove_duplicate=False))
        for g in self.groups:
            p = params[g.keys[0]]
            k = len(g.stages)
            payload = (p.numel() * p.element_size() if self.codec is None
                       else self.codec.payload_nbytes(p.shape, p.dtype) + 1)  # + the finite flag
            sent += k * (k - 1) * payload
            raw += k * (k - 1) * p.numel() * 4
        return sent, raw

    def state(self) -> dict[str, Tensor]:
        """The error-feedback residuals, by the first key of their group (for checkpoints)."""
        return {f"tied.{self.groups[i].keys[0]}": r.detach().clone() for i, r in self.residuals.items()}

    def load_state(self, state: dict[str, Tensor]) -> None:
        for i, g in self.held():
            value = state.get(f"tied.{g.keys[0]}")
            if value is not None:
                self.residuals[i] = value.to(self.device)


def _seed(step: int, index: int, stage: int) -> int:
    """A codec seed for one member's payload of one group at one step (the same on every member)."""
    h = 0x9E3779B97F4A7C15
    for v in (step, index, stage):
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFF


__all__ = ["TAG_BASE", "TiedGradients", "TiedGroup"]
