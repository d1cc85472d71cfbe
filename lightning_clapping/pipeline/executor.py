"""Runs one stage's share of a schedule: forwards, backwards, and the messages between them."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping.codecs.feedback import MessageRule, StepContext
from lightning_clapping.comm import wire
from lightning_clapping.comm.channel import PeerChannel, exchange
from lightning_clapping.comm.p2p import P2PQueue
from lightning_clapping.comm.placement import Placement
from lightning_clapping.comm.step_stats import StepStats
from lightning_clapping.pipeline import agreement, schedule as schedules
from lightning_clapping.pipeline.crossing_plan import Plan, gather_needs
from lightning_clapping.pipeline.stage import SplitError, StageExit, StageRunner, check_finite
from lightning_clapping.pipeline.streams import Handoff, frozen_rng

PURPOSE_TRAIN_FWD = 1
PURPOSE_TRAIN_BWD = 2
PURPOSE_EVAL_FWD = 3

#: ``make_rule(boundary, direction, training) -> MessageRule``; direction is "fwd" or "bwd"
RuleFactory = Callable[[int, str, bool], MessageRule]


@dataclass
class _TrainStep:
    """One training step's inputs (see :meth:`PipelineExecutor.train_step`) and what its actions leave for later ones."""

    microbatches: list[Any]
    step_fn: Callable[[Any, int], Any]
    loss_weights: list[float]
    ctx: StepContext
    rng_seed: Callable[[int], int] | None
    results: Callable[[list[Any]], bytes] | None
    check: int | None
    carry: bool  # the step's results ride on the last gradient message (step_results, several stages)
    final: int  # the micro-batch whose backward is the chain's last link
    stats: StepStats = field(default_factory=StepStats)
    saved: dict[int, tuple[list[Tensor], list[Tensor]]] = field(default_factory=dict)  # backward roots, received
    outputs: dict[int, Any] = field(default_factory=dict)  # the last stage's step outputs


class PipelineExecutor:
    """One stage's executor, on the rank, device and pipeline group of ``placement`` (its stage is the runner's).

    With ``step_results=True`` the last stage appends the step's results (bytes from the ``results`` callback of
    :meth:`train_step`) to its last gradient message of the step; every other stage forwards them with its own last
    gradient message and finds them in :attr:`results` after the step. Every stage thus learns the loss and the
    logged values without a collective: they ride on messages the pipeline sends anyway.

    With ``rng_handoff=True`` (``freeze_rng=False``) each forward message carries the sending stage's random
    generator state at its exit, which the next stage takes at its entry, and the last stage's state after the step
    rides with the results (:class:`~lightning_clapping.pipeline.streams.Handoff`).
    """

    def __init__(
        self,
        runner: StageRunner,
        placement: Placement,
        make_rule: RuleFactory,
        schedule: str = "1f1b",
        prepost: bool = True,
        timeout: timedelta | None = None,
        step_results: bool = False,
        rng_handoff: bool = False,
        recheck_every: int | None = None,
    ) -> None:
        if (runner.stage, runner.num_stages) != (placement.stage, placement.num_stages):
            raise ValueError(f"the runner holds stage {runner.stage} of {runner.num_stages}, but the placement puts "
                             f"rank {placement.global_rank} on stage {placement.stage} of {placement.num_stages}")
        self.runner = runner
        self.placement = placement
        self.make_rule = make_rule
        self.step_results = step_results
        #: (shape, dtype, compressible) of each tensor of the last message sent, by rule name ("fwd_out", "bwd_out")
        self.sent_specs: dict[str, list[tuple]] = {}
        self.results: bytes | None = None
        self._compute_s = 0.0
        self.stage = placement.stage
        self.num_stages = placement.num_stages
        self.schedule_fn = schedules.get_schedule(schedule)
        self.device = device = placement.device
        group = placement.pp_group
        self.first_step = True
        self.prepost = prepost
        self.handoff = Handoff(device, placement.stage, rng_handoff and placement.num_stages > 1)
        #: the guard's checks after the first step (pipeline/agreement): every ``recheck_every`` training steps
        self.recheck = agreement.Recheck(placement.stage, recheck_every)
        if prepost and not _matches_by_tag(group, device):
            raise ValueError(
                "prepost_receives=True posts a step's receives ahead and needs a backend that matches messages by "
                "tag (gloo); NCCL matches point-to-point messages by their order only. Leave prepost_receives unset "
                "(or False) under NCCL."
            )
        if self.num_stages > 2 and dist.is_initialized():
            _open_group(group, device)
        #: every point-to-point operation of this rank, issued in groups (see :func:`schedule.with_exchanges`)
        self.queue = P2PQueue(ordered=not prepost, timeout=timeout)
        #: messages produced by the last action, (first, after) operations each, sent in the next exchange
        self._outbox: dict[schedules.Message, tuple[list[dist.P2POp], list[dist.P2POp]]] = {}
        #: per micro-batch, the received crossing values whose gradients this stage sends back
        self._crossing_bwd: dict[int, list[Tensor]] = {}
        s, n = self.stage, self.num_stages

        def chan(peer_stage: int, purpose: int) -> PeerChannel | None:
            if not 0 <= peer_stage < n:
                return None
            return PeerChannel(placement.rank_of_stage(peer_stage), purpose, device, group, prepost, timeout,
                               queue=self.queue)

        self.fwd_out, self.fwd_in = chan(s + 1, PURPOSE_TRAIN_FWD), chan(s - 1, PURPOSE_TRAIN_FWD)
        self.bwd_out, self.bwd_in = chan(s - 1, PURPOSE_TRAIN_BWD), chan(s + 1, PURPOSE_TRAIN_BWD)
        self.eval_out, self.eval_in = chan(s + 1, PURPOSE_EVAL_FWD), chan(s - 1, PURPOSE_EVAL_FWD)
        self.rules: dict[str, MessageRule | None] = {}
        self.rebuild_rules()

    #: rules on this rank: the sending end of boundary s (fwd) and s-1 (bwd), the receiving end of the others
    _RULES = {"fwd_out": (0, "fwd", True), "fwd_in": (-1, "fwd", True), "bwd_out": (-1, "bwd", True),
              "bwd_in": (0, "bwd", True), "eval_out": (0, "fwd", False), "eval_in": (-1, "fwd", False)}

    def rebuild_rules(self, training_only: bool = False) -> None:
        """(Re)build this rank's message rules with ``make_rule``; new rules start with empty feedback buffers, so
        both ends of a boundary must rebuild at the same point between steps."""
        for name, (offset, direction, training) in self._RULES.items():
            if training or not training_only:
                boundary = self.stage + offset
                self.rules[name] = (self.make_rule(boundary, direction, training)
                                    if 0 <= boundary < self.num_stages - 1 else None)

    @property
    def is_first(self) -> bool:
        return self.placement.is_first

    @property
    def is_last(self) -> bool:
        return self.placement.is_last

    # ------------------------------------------------------------------ values crossing cuts
    def needs_plan(self, kind: str) -> bool:
        """Whether steps of ``kind`` ("train", or the evaluation hook's name) still need their plan of the values
        that cross cuts besides the cut modules' inputs (see :mod:`lightning_clapping.pipeline.crossings`)."""
        return self.runner.needs_plan(kind)

    def plan_crossings(self, kind: str, microbatch: Any, step_fn: Callable[[Any, int], Any]) -> Plan:
        """Collective over the pipeline, once per kind before its first step: every stage runs ``microbatch``
        without sending (``step_fn(microbatch, 0)``), then the stages exchange what they need as integer tensors,
        and check that the values they recompute agree (:mod:`~lightning_clapping.pipeline.agreement`)."""
        needs = self.runner.discover(kind, lambda: step_fn(microbatch, 0))
        plan = Plan(gather_needs(needs, self._all_gather_rows), self.num_stages)
        crossings = self.runner.crossings
        assert crossings is not None
        keys = agreement.check(crossings.recomputed, crossings.own, crossings.names, self.stage,
                               self._all_gather_rows)
        if kind == "train":
            self.recheck.keys = keys
        crossings.recomputed, crossings.own = {}, {}
        crossings.plans[kind] = plan
        return plan

    def _block_of_stage(self, stage: int) -> int:
        """The index of ``stage``'s block in an all-gather over the pipeline group (its rank in the group)."""
        group = self.placement.pp_group
        return dist.get_group_rank(group or dist.group.WORLD, self.placement.rank_of_stage(stage))

    def _all_gather_rows(self, rows: Tensor) -> list[Tensor]:
        """All-gather an int64 (n, k) tensor over the pipeline, ``n`` differing between stages."""
        group, device = self.placement.pp_group, self.device
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
        counts = [torch.zeros_like(count) for _ in range(self.num_stages)]
        dist.all_gather(counts, count, group=group)
        sizes = [int(c) for c in counts]
        padded = torch.zeros((max(sizes), rows.shape[1]), dtype=torch.int64, device=device)
        padded[:rows.shape[0]] = rows.to(device)
        blocks = [torch.zeros_like(padded) for _ in range(self.num_stages)]
        dist.all_gather(blocks, padded, group=group)
        return [b[:n].cpu() for b, n in zip(blocks, sizes)]

    # ------------------------------------------------------------------ training
    def train_step(
        self,
        microbatches: list[Any],
        step_fn: Callable[[Any, int], Any],
        loss_weights: list[float],
        ctx: StepContext | None = None,
        rng_seed: Callable[[int], int] | None = None,
        results: Callable[[list[Any]], bytes] | None = None,
        check: int | None = None,
    ) -> tuple[list[Any], StepStats]:
        """Forward and backward every micro-batch. Returns the last stage's step outputs (else []) and the stats.

        ``step_fn(microbatch, index)`` is the user's step; on the last stage it must return the loss (a scalar
        tensor or a dict with ``"loss"``), which is multiplied by ``loss_weights[index]`` before its backward.
        ``rng_seed(index)``, when given, seeds torch's RNG for that micro-batch's forward (frozen dropout masks).
        ``results(outputs)``: on the last stage with ``step_results``, called once every micro-batch's step has run,
        with their outputs in order; it returns the bytes every stage finds in :attr:`results` afterwards.
        ``check``: the training step's number when the guard compares the stages' recomputed values of micro-batch 0
        again (:attr:`recheck`), else None.
        """
        ctx = ctx or StepContext()
        self.recheck.finish(self._block_of_stage)  # the last check's verdict (its gather ran during that step)
        schedule = self.schedule_fn(self.num_stages, len(microbatches))
        carry = self.step_results and self.num_stages > 1
        if carry and self.is_last and results is None:
            raise ValueError("step_results=True: the last stage's train_step needs the results callback")
        final = [a.microbatch for a in schedule[self.stage] if a.kind == "B"][-1]  # the same on every stage
        step = _TrainStep(microbatches, step_fn, loss_weights, ctx, rng_seed, results, check, carry, final)
        self.results = None
        self._compute_s = 0.0
        if self.prepost:
            self._prepost([(self.fwd_in, "fwd_in"), (self.bwd_in, "bwd_in")], len(microbatches), ctx)
        actions = {"F": self._train_forward, "B": self._train_backward}
        for action in schedules.with_exchanges(schedule)[self.stage]:
            if isinstance(action, schedules.Exchange):
                self._exchange(action, ctx, training=True)
            else:
                actions[action.kind](step, action.microbatch)
        self._finish()
        self.first_step = False
        if not self.is_last:
            self.results = self.handoff.take_last_stage(self.results)
        if check is not None and self.runner.crossings is not None:
            self.recheck.start(self.placement.pp_group, self.num_stages, self.device, self.runner.crossings.names,
                               check)
        step.stats.compute_s = self._compute_s
        self._collect(step.stats)
        return [step.outputs[j] for j in sorted(step.outputs)], step.stats

    def _train_forward(self, step: _TrainStep, j: int) -> None:
        """Action F: micro-batch ``j``'s forward; its output goes to the next stage (the last stage keeps the loss)."""
        received: list[Tensor] = []
        seed = step.rng_seed(j) if step.rng_seed is not None else None
        checking = step.check is not None and j == 0
        out = self._forward(step.microbatches[j], j, step.step_fn, self.fwd_in, "fwd_in", step.ctx, received, seed,
                            "train", checking)
        if checking and self.runner.crossings is not None:
            self.recheck.summarise(self.runner.crossings.recomputed, self.runner.crossings.own)
        if self.is_last:
            loss = _loss_of(out)
            if self.first_step:
                check_finite([loss.detach()], f"loss of micro-batch {j} on the last stage", True)
            step.outputs[j] = out
            step.saved[j] = ([loss * step.loss_weights[j]], received)
        else:
            self._check_output(out, "fwd_out", j)
            self._send(self.fwd_out, "fwd_out", j, out, step.ctx, step.stats, self.handoff.outgoing(j))
            step.saved[j] = ([t for t in out if t.requires_grad], received)

    def _train_backward(self, step: _TrainStep, j: int) -> None:
        """Action B: micro-batch ``j``'s backward from the gradients the next stage sent (from its loss, on the last
        stage); the gradients of what it received go back. The step's last link carries the step's results."""
        roots, received = step.saved.pop(j)
        last_link = step.carry and j == step.final
        grads = None
        if not self.is_last:
            message, blob = self._recv(self.bwd_in, "bwd_in", j, step.ctx, last_link)
            grads = [t for t, _ in message]
            if blob is not None:
                self.results = blob
            if len(grads) != len(roots):
                raise SplitError(f"stage {self.stage} got {len(grads)} gradients for micro-batch {j} but sent "
                                 f"{len(roots)} tensors that require grad")
        if roots:
            start = time.perf_counter()
            torch.autograd.backward(roots, grads)
            self._compute_s += time.perf_counter() - start
        if not self.is_first:
            leaves = [t for t in received if t.requires_grad]
            gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
            attached = None
            if last_link:
                if self.is_last:
                    assert step.results is not None
                    self.results = step.results([step.outputs[i] for i in sorted(step.outputs)])
                attached = self.handoff.with_state(self.results) if self.is_last else self.results
            self._send(self.bwd_out, "bwd_out", j, gin, step.ctx, step.stats, attached)

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, microbatches: list[Any], step_fn: Callable[[Any, int], Any],
                  ctx: StepContext | None = None, kind: str = "eval") -> list[Any]:
        """Forward only (validation, test, predict: ``kind``). Returns the last stage's step outputs (else [])."""
        ctx = ctx or StepContext()
        n = len(microbatches)
        if self.prepost:
            self._prepost([(self.eval_in, "eval_in")], n, ctx)
        outputs = []
        stats = StepStats()
        for action in schedules.with_exchanges(schedules.forward_only(self.num_stages, n))[self.stage]:
            if isinstance(action, schedules.Exchange):
                self._exchange(action, ctx, training=False)
                continue
            j = action.microbatch
            out = self._forward(microbatches[j], j, step_fn, self.eval_in, "eval_in", ctx, None, None, kind)
            if self.is_last:
                outputs.append(out)
            else:
                self._check_output(out, "eval_out", j)
                self._send(self.eval_out, "eval_out", j, out, ctx, stats, self.handoff.outgoing(j))
        self._finish()
        self.handoff.share_last_stage(self.placement.last_rank, self.placement.pp_group, self.is_last)
        return outputs

    # ------------------------------------------------------------------ pieces
    def _forward(self, mb: Any, j: int, step_fn, chan: PeerChannel | None, rule_name: str, ctx: StepContext,
                 received: list[Tensor] | None, seed: int | None, kind: str, checking: bool = False):
        def provide() -> list[Tensor]:
            assert chan is not None
            t0 = time.perf_counter()
            tensors, state = self._recv(chan, rule_name, j, ctx, attached=self.handoff.enabled)
            waited[0] += time.perf_counter() - t0
            if state is not None:  # from here on this stage draws what one process draws here
                self.handoff.enter(state, j)
            if received is None:
                return [t for t, _ in tensors]
            out = []
            first_extra = len(tensors) - (self.runner.crossings.received_count() if self.runner.crossings else 0)
            for i, (t, flags) in enumerate(tensors):
                if flags & wire.FLAG_REQUIRES_GRAD and t.dtype.is_floating_point:
                    leaf = t.detach().requires_grad_(True)
                    received.append(leaf)
                    if i >= first_extra:  # its gradient goes back as a crossing value's
                        self._crossing_bwd.setdefault(j, []).append(leaf)
                    t = leaf.clone()  # a non-leaf view, so the user's code may modify it in place
                out.append(t)
            return out

        waited = [0.0]
        rng = frozen_rng(seed, self.device) if seed is not None else nullcontext()
        start = time.perf_counter()
        try:
            with rng, self.runner.microbatch(provide if chan is not None else None, kind, checking=checking):
                try:
                    out = step_fn(mb, j)
                except StageExit:
                    self.handoff.leave(j)
                    return self.runner.captured_tensors()
            if not self.is_last:
                self.runner.captured_tensors()  # raises: the exit module was never called
            return out
        finally:
            self._compute_s += time.perf_counter() - start - waited[0]

    def _crossing_fwd(self) -> int:
        """How many of the tensors this stage sends forward are values crossing the cut besides the next stage's
        entry inputs (the last ones of the message)."""
        plan = self.runner.crossings.plan if self.runner.crossings is not None else None
        return len(plan.crossing(self.stage)) if plan is not None else 0

    def _check_output(self, out: list[Tensor], rule_name: str, j: int) -> None:
        """Refuse NaN in what this stage sends. After the first step only for uncompressed messages: a lossy codec
        scans its input itself (and refuses NaN with the boundary's name), so its messages are scanned once."""
        if self.first_step or self.rules[rule_name].kind == "raw":
            check_finite([t.detach() for t in out], f"stage {self.stage} output for micro-batch {j}", self.first_step)

    def _mode(self, rule_name: str, j: int, ctx: StepContext) -> tuple:
        """The key under which both ends predict a message's size: the rule's wire form and the slot's size."""
        return (self.rules[rule_name].mode(j, ctx), ctx.sizes[j] if ctx.sizes is not None else None)

    def _prepost(self, receivers: list[tuple[PeerChannel | None, str]], n: int, ctx: StepContext) -> None:
        """Post every receive of the step at once, in one group (matched by tag: gloo)."""
        ops = [chan.recv_op(j, self._mode(rule_name, j, ctx))
               for chan, rule_name in receivers if chan is not None for j in range(n)]
        self.queue.issue([op for op in ops if op is not None])

    def _exchange(self, step: schedules.Exchange, ctx: StepContext, training: bool) -> None:
        """Issue the messages the previous action produced with the receive the next action needs (see
        :func:`lightning_clapping.comm.channel.exchange`)."""
        sends = []
        for m in step.sends:
            try:
                sends.append(self._outbox.pop(m))
            except KeyError:
                raise RuntimeError(f"stage {self.stage}: the schedule sends {m}, which was never produced") from None
        receives = []
        for m in step.recvs:
            rule_name = ("fwd_in" if m.direction == "fwd" else "bwd_in") if training else "eval_in"
            chan, j = getattr(self, rule_name), m.microbatch
            receives.append((chan, j, self._mode(rule_name, j, ctx),
                             _name_message(self.rules[rule_name], rule_name, j, chan.peer)))
        exchange(self.queue, sends, receives)

    def _send(self, chan: PeerChannel, rule_name: str, j: int, tensors: list[Tensor], ctx: StepContext,
              stats: StepStats, attached: bytes | None = None) -> None:
        rule = self.rules[rule_name]
        mode = self._mode(rule_name, j, ctx)
        parts = rule.encode(j, tensors, ctx)
        self.sent_specs[rule_name] = [(tuple(t.shape), t.dtype, rule.compressible(t.detach(), p.flags))
                                      for t, p in zip(tensors, parts)]
        attachment = wire.results_part(attached) if attached is not None else None
        if attachment is not None:
            parts.append(attachment)
            stats.control_bytes += attachment.payload.numel()
        before = chan.bytes_sent
        # sent in the next exchange, with the receive the next action needs (see schedule.with_exchanges)
        back = rule_name == "bwd_out"
        message = schedules.Message("bwd" if back else "fwd", self.stage, self.stage + (-1 if back else 1), j)
        self._outbox[message] = chan.send_ops(j, wire.pack(parts, self.device), mode)
        raw = wire.uncompressed_nbytes(tensors, attachment)
        direction = "bwd" if rule_name == "bwd_out" else "fwd"
        crossing = self._crossing_fwd() if direction == "fwd" else self._crossing_bwd.pop(j, [])
        if crossing:
            extra = tensors[-crossing:] if direction == "fwd" else crossing
            stats.crossing_raw_bytes += sum(wire.raw_nbytes(t) for t in extra)
        stats.count_sent(direction, chan.bytes_sent - before, raw)

    def _recv(self, chan: PeerChannel, rule_name: str, j: int, ctx: StepContext,
              attached: bool = False) -> tuple[list[tuple[Tensor, int]], bytes | None]:
        """The decoded tensors of a message with their flags, and (``attached``) the bytes attached to it."""
        rule = self.rules[rule_name]
        where = _name_message(rule, rule_name, j, chan.peer)
        msg = chan.recv(j, self._mode(rule_name, j, ctx), where)
        known = (*wire.RULE_FORMS, wire.ATTACHMENT) if attached else wire.RULE_FORMS
        parts = wire.unpack(msg, known_codecs=known, where=where)
        blob = wire.results_of(parts, where) if attached else None
        return list(zip(wire.decode_message(rule, j, parts, ctx, where), [p.flags for p in parts])), blob

    def _finish(self) -> None:
        """Wait for every operation of the step; refuse a message that was produced but never sent."""
        self.queue.flush()
        if self._outbox:
            left = sorted(map(repr, self._outbox))
            self._outbox.clear()
            raise RuntimeError(f"stage {self.stage}: messages {left} were produced but the schedule never sent them")

    def _collect(self, stats: StepStats) -> None:
        for name in ("fwd_out", "bwd_out"):
            rule = self.rules[name]
            if rule is None:
                continue
            rs = rule.take_stats()
            stats.count_difference("fwd" if name == "fwd_out" else "bwd", rs.diff_sq, rs.value_sq, rs.skipped)
        stats.feedback_bytes = sum(r.state_bytes() for r in self.rules.values() if r is not None)

    def feedback_state(self) -> dict[str, dict[str, Tensor]]:
        """The error-feedback buffers on this rank, by rule (for checkpoints and consistency checks)."""
        return {name: r.state() for name, r in self.rules.items() if r is not None}


def _name_message(rule: MessageRule, rule_name: str, j: int, peer: int) -> str:
    """How errors name a received message, e.g. "boundary 1, backward, micro-batch 3, from rank 2"."""
    return (f"boundary {rule.boundary}, {'backward' if rule.direction == 'bwd' else 'forward'}"
            f"{' (evaluation)' if rule_name == 'eval_in' else ''}, micro-batch {j}, from rank {peer}")


def _open_group(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Collective over the pipeline, once per executor: a first operation in which every stage takes part.

    NCCL builds a group's communicator in the group's first operation, with every rank of the group; a first
    ``batch_isend_irecv`` between two of its stages (stage 0 and 1, while stage 2 waits) is one that not every rank
    joins, which torch leaves undefined. Beyond two stages the pipeline's first messages are such batches, so
    every stage first takes part in this one-element all-reduce on its device."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def _matches_by_tag(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether point-to-point messages on ``device`` are matched by tag: not under NCCL, which matches by order."""
    if device.type != "cuda" or not dist.is_initialized():
        return True
    return "nccl" not in str(dist.get_backend(group)).lower()


def _loss_of(out: Any) -> Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise SplitError(
            "with a pipeline strategy, training_step must return the loss (a scalar tensor, or a dict with 'loss') "
            f"for every micro-batch; got {type(out).__name__}. Skipping a batch by returning None is not supported."
        )
    return loss.reshape(())
