"""DiLoCo over a stage's replicas: local inner steps, then an outer step on the averaged change.

Each replica steps the user's optimizer on its own gradients (no per-step averaging). Every ``inner_steps``
optimizer steps, the stage's replicas average their pseudo-gradient ``anchor - params`` (``anchor``: the
parameters at the last sync, fp32, the same on every replica), an outer optimizer (SGD with Nesterov momentum, as in
the DiLoCo paper) steps the anchor with it, and every replica copies the anchor into its parameters. The anchor, the
outer momentum and the average are computed from the same bits on every replica, so after each outer step the
replicas hold identical parameters. A tensor tied across stages is synced on each of its stages from identical
copies, so the copies stay identical too.

``fragments`` > 1 (streaming DiLoCo's staggered fragments): the stage's tensors are dealt round-robin into that many
fragments, and fragment ``f`` is synced at the steps ``k`` with ``k % inner_steps == (f + 1) * inner_steps //
fragments % inner_steps``: each tensor is still synced once per ``inner_steps``, but the bytes are spread over the
interval instead of arriving at once.

``overlap`` = tau > 0 (streaming DiLoCo's overlap): a sync's collective starts after its step and runs while the
replica takes ``tau`` more inner steps; its outer step lands then, and each replica's parameters become the new anchor
plus the inner steps it took meanwhile (``params - params at the start``). The anchor stays identical on every
replica; the parameters agree again at the end of a fit (its last outer step waits for the collectives in flight).
A checkpoint waits for the syncs in flight and keeps their averages, so a resumed run lands them as this one would.

``codec``: each replica compresses ``delta + e`` (its pseudo-gradient plus its error-feedback residual ``e``) and
keeps ``e = delta + e - decode(payload)``; the payloads (one fixed size per tensor shape) are all-gathered and every
replica decodes all of them and averages in replica order. A ring all-gather sends ``(R - 1)`` payloads per rank;
an uncompressed sync is one all-reduce, ``2 (R - 1) / R`` of the fp32 bytes.

torchft ships a DiLoCo of its own; it runs only under its ``Manager`` (a quorum per sync, torchft's process groups),
which a run without fault tolerance does not have, so this module is written on ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping.codecs import get_codec
from lightning_clapping.comm.replicas import ring_share
from lightning_clapping.sync.base import ReplicaSync
from lightning_clapping.sync.config import DiLoCo


class LocalUpdates(ReplicaSync):
    name = "diloco"
    #: whether the outer step due after an optimizer step waits for its owner to call :meth:`sync` on
    #: :meth:`pending` (fault tolerance runs it at the next batch's quorum) instead of running in :meth:`after_step`
    deferred = False

    def __init__(self, mode: DiLoCo, group: Any, replicas: int, replica: int, device: torch.device) -> None:
        super().__init__()
        self.mode, self.group, self.replicas, self.replica, self.device = mode, group, replicas, replica, device
        self.codec = get_codec(mode.codec) if mode.codec is not None else None
        self.anchor: list[Tensor] = []
        self.outer: torch.optim.SGD | None = None
        self.residual: dict[int, Tensor] = {}
        self.steps = 0  # optimizer steps taken since the run began
        self.outer_steps = 0
        self.synced_at: dict[int, int] = {}  # the optimizer step each tensor was last synced after
        self._params: list[torch.nn.Parameter] = []
        self._optimizers: list[Any] = []
        self._resumed: dict[str, Tensor] = {}  # this replica's own tensors from a checkpoint (on_train_start)
        self._flights: list[_Flight] = []  # with overlap: the syncs started and not landed yet, oldest first

    def after_backward(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        self.count_every_step_equivalent(params, self.replicas)
        self._params, self._optimizers = list(params), list(optimizers)
        if not self.anchor:  # the parameters every replica starts from
            self.anchor = [p.detach().float().clone() for p in params]
            self.outer = self._outer_optimizer()

    def _outer_optimizer(self) -> torch.optim.SGD:
        return torch.optim.SGD(self.anchor, lr=self.mode.outer_lr, momentum=self.mode.momentum,
                               nesterov=self.mode.nesterov and self.mode.momentum > 0)

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        if not self.anchor:
            return
        self.steps += 1
        while self._flights and self._flights[0].step + self.mode.overlap <= self.steps:
            self._land(params, self._flights.pop(0))
        due = [] if self.deferred else self.due(self.steps)
        if due:
            self.sync(params, due, overlap=self.mode.overlap > 0)

    def pending(self) -> list[int]:
        """The tensors whose outer step is due after the last optimizer step and has not run yet (with
        :attr:`deferred`, until the owner calls :meth:`sync` on them)."""
        if not self.steps:
            return []
        return [i for i in self.due(self.steps) if self.synced_at.get(i, 0) != self.steps]

    def due(self, step: int) -> list[int]:
        """The tensor indices synced after optimizer step ``step`` (counted from 1)."""
        h, f = self.mode.inner_steps, self.mode.fragments
        phase = step % h
        return [i for i in range(len(self.anchor))
                if (i % f + 1) * h // f % h == phase]

    def sync(self, params: list[torch.nn.Parameter], indices: list[int], overlap: bool = False) -> None:
        """Collective over the stage's replicas: the outer step on the tensors ``indices``, now, or with ``overlap``
        started now and taken ``mode.overlap`` optimizer steps later (:meth:`after_step`)."""
        start = [params[i].detach().float().clone() for i in indices] if overlap else None
        flight = _Flight(self.steps, indices, start, self._average(indices, params))
        self.synced_at.update((i, self.steps) for i in indices)
        if overlap:
            self._flights.append(flight)
        else:
            self._land(params, flight)

    def _land(self, params: list[torch.nn.Parameter], flight: _Flight) -> None:
        """The outer step of a sync whose average is (or is about to be) in: the anchor steps, and the parameters
        take it, plus the inner steps this replica took since the sync started (none without overlap)."""
        average = flight.average()
        indices = flight.indices
        if not self.agree():  # the replicas did not all get through: the inner steps since the anchor are dropped
            with torch.no_grad():
                for i in indices:
                    params[i].copy_(self.anchor[i])
            return
        assert self.outer is not None  # the anchor's .grad is None outside a landing: only these tensors step
        for i, avg in zip(indices, average):
            self.anchor[i].grad = avg
        self.outer.step()
        with torch.no_grad():
            for k, i in enumerate(indices):
                if flight.start is None or flight.step == self.steps:
                    params[i].copy_(self.anchor[i])
                else:
                    params[i].copy_(self.anchor[i] + (params[i].detach().float() - flight.start[k]))
                self.anchor[i].grad = None
        self.outer_steps += 1

    def agree(self) -> bool:
        """Between the average and the outer step: whether every replica got through the sync (always, without
        fault tolerance; :class:`lightning_clapping.fault_tolerance.TorchftLocalUpdates` asks the quorum)."""
        return True

    def finish(self, params: list[torch.nn.Parameter]) -> None:
        """A fit that ends between syncs (or with syncs in flight) ends with them landed and one more outer step on
        the tensors not synced since their last inner step, so every replica holds the same model (the one
        checkpoints and rank 0's module keep)."""
        while self._flights:
            self._land(params, self._flights.pop(0))
        late = [i for i in range(len(self.anchor)) if self.synced_at.get(i, 0) != self.steps]
        if late and self.steps:
            self.sync(params, late)

    def _average(self, indices: list[int], params: list[torch.nn.Parameter]) -> Callable[[], list[Tensor]]:
        """Starts the collective on the changes ``anchor - params`` of the tensors ``indices``; the returned function
        waits for it and gives the replicas' average change."""
        if self.codec is None:  # the changes written straight into the all-reduce's buffer, the average its views
            sizes = [self.anchor[i].numel() for i in indices]
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            for i, part in zip(indices, flat.split(sizes)):
                torch.sub(self.anchor[i].view(-1), params[i].detach().reshape(-1).float(), out=part)
            wait = self._start_mean(flat)

            def average() -> list[Tensor]:
                mean = wait()
                return [part.view_as(self.anchor[i]) for i, part in zip(indices, mean.split(sizes))]

            return _once(average)
        deltas = [self.anchor[i] - params[i].detach().float() for i in indices]
        seed = self._seed
        payloads, own = [], []  # own: this replica's payloads decoded (for its residual, and its term of the sum)
        for i, d in zip(indices, deltas):
            x = d + self.residual[i] if i in self.residual else d
            payload = self.codec.encode(x, seed=seed(self.replica))
            own.append(self.codec.decode(payload, x.shape, x.dtype, seed=seed(self.replica)))
            self.residual[i] = x - own[-1]
            payloads.append(payload)
        mine = torch.cat(payloads)
        gathered = [torch.empty_like(mine) for _ in range(self.replicas)]
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        self.count((self.replicas - 1) * mine.numel())
        seeds = [seed(r) for r in range(self.replicas)]  # as at the start, whatever lands meanwhile

        def average() -> list[Tensor]:
            work.wait()
            sums = [torch.zeros_like(d) for d in deltas]
            for r, blob in enumerate(gathered):  # in replica order: the same sum on every replica
                offset = 0
                for k, (s, p) in enumerate(zip(sums, payloads)):
                    s += own[k] if r == self.replica else self.codec.decode(blob[offset:offset + p.numel()],
                                                                            s.shape, s.dtype, seed=seeds[r])
                    offset += p.numel()
            return [s / self.replicas for s in sums]

        return _once(average)

    def _start_mean(self, flat: Tensor) -> Callable[[], Tensor]:
        """Starts one fp32 all-reduce of ``flat`` over the stage's replicas (counted); the returned function waits
        for it and gives the average."""
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.count(ring_share(self.replicas) * flat.numel() * 4)

        def average() -> Tensor:
            work.wait()
            return flat.div_(self.replicas)

        return _once(average)

    def _seed(self, replica: int) -> int:
        return (self.outer_steps + 1) * 1_000_003 + replica

    def state_dict(self) -> dict[str, Tensor]:
        """Flat, tensors only (a checkpoint's per-rank buffers): the anchor, the outer momentum, the error-feedback
        residuals and the counters. A replica other than 0 also saves its own parameters and inner optimizer state,
        which differ from replica 0's (the checkpoint's model and optimizer) between syncs."""
        out = {f"anchor.{i}": a.cpu() for i, a in enumerate(self.anchor)}
        if self.outer is not None:
            for i, a in enumerate(self.anchor):
                buf = self.outer.state.get(a, {}).get("momentum_buffer")
                if buf is not None:
                    out[f"momentum.{i}"] = buf.cpu()
        out.update({f"residual.{i}": t.cpu() for i, t in self.residual.items()})
        out["counters"] = torch.tensor([self.steps, self.outer_steps])
        out["synced_at"] = torch.tensor([self.synced_at.get(i, 0) for i in range(len(self.anchor))])
        for k, flight in enumerate(self._flights):  # started, not landed: their averages are waited for here
            out[f"flight.{k}.at"] = torch.tensor([flight.step] + flight.indices)
            for j, (avg, start) in enumerate(zip(flight.average(), flight.start or [])):
                out[f"flight.{k}.average.{j}"], out[f"flight.{k}.start.{j}"] = avg.cpu(), start.cpu()
        if self.replica != 0 and self._params:
            for i, p in enumerate(self._params):
                out[f"local.{i}"] = p.detach().cpu()
                for opt in self._optimizers:
                    for key, value in opt.state.get(p, {}).items():
                        if isinstance(value, Tensor):
                            out[f"inner.{i}.{key}"] = value.detach().cpu()
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        def part(prefix: str) -> dict[int, Tensor]:
            return {int(k.split(".")[1]): v for k, v in state.items() if k.startswith(prefix + ".")}

        anchors = part("anchor")
        self.anchor = [anchors[i].to(self.device) for i in range(len(anchors))]
        self.outer = self._outer_optimizer() if self.anchor else None  # none yet: saved before the first step
        for i, buf in part("momentum").items():
            self.outer.state[self.anchor[i]]["momentum_buffer"] = buf.to(self.device)
        self.residual = {i: t.to(self.device) for i, t in part("residual").items()}
        self.steps, self.outer_steps = (int(v) for v in state["counters"].tolist())
        self.synced_at = {i: int(k) for i, k in enumerate(state["synced_at"].tolist())}
        self._resumed = {k: v for k, v in state.items() if k.startswith(("local.", "inner."))}
        self._flights = []
        for k in range(sum(1 for key in state if key.startswith("flight.") and key.endswith(".at"))):
            step, *indices = (int(v) for v in state[f"flight.{k}.at"].tolist())
            average = [state[f"flight.{k}.average.{j}"].to(self.device) for j in range(len(indices))]
            start = [state[f"flight.{k}.start.{j}"].to(self.device) for j in range(len(indices))]
            self._flights.append(_Flight(step, indices, start, lambda average=average: average))

    def on_train_start(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        """A resumed replica other than 0 takes back its own parameters and inner optimizer state."""
        resumed, self._resumed = self._resumed, {}
        with torch.no_grad():
            for key, value in resumed.items():
                parts = key.split(".", 2)
                p = params[int(parts[1])]
                if parts[0] == "local":
                    p.copy_(value)
                    continue
                for opt in optimizers:
                    if any(p is q for g in opt.param_groups for q in g["params"]):
                        opt.state[p][parts[2]] = value.to(p.device) if value.dim() else value

    def state_bytes(self) -> int:
        momentum = sum(t.numel() * 4 for t in self.anchor) if self.mode.momentum > 0 else 0
        flights = sum(2 * t.numel() * 4 for f in self._flights for t in f.start or [])
        return (sum(t.numel() * 4 for t in self.anchor) + momentum + sum(t.numel() * 4 for t in self.residual.values())
                + flights)


@dataclass
class _Flight:
    """A sync between its start and its outer step: the optimizer step it started after, its tensors, the parameters
    then (with overlap), and the function that waits for the average."""

    step: int
    indices: list[int]
    start: list[Tensor] | None
    average: Callable[[], list[Tensor]]


def _once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, run at the first call only (a checkpoint may wait for a sync before its outer step does)."""
    done: list[Any] = []

    def call() -> Any:
        if not done:
            done.append(fn())
        return done[0]

    return call
