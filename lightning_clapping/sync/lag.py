"""LAG (Lazily Aggregated Gradient) over a stage's replicas: a replica uploads a gradient only when it changed.

Each replica keeps, per parameter tensor ``p`` of its stage, the gradient it last sent (``g_last``); every replica
keeps the same stale average ``S`` of all replicas' last-sent gradients. At each optimizer step replica ``r`` fires
for ``p`` when (LAG-WK, the worker-side trigger)::

    ||g - g_last||^2  >  threshold / (D * lr^2) * sum_{d=1..D} ||p_(k+1-d) - p_(k-d)||^2

The paper writes it for a server that *sums* the workers' gradients and steps ``alpha`` on the sum, with
``1 / (alpha^2 M^2)`` in front; with the average (this module, as DDP) the step on the sum is ``lr / R`` and the
``R^2`` cancels. D = 10 and ``xi_d = 1 / D`` are the paper's experimental constants (``LAG(memory=10,
threshold=1)``). The parameter-change history is per tensor (each stage only sees its own parameters).

One step costs one all-reduce of a flag per tensor (``uint8``: how many replicas fired), then one all-reduce over
the tensors with at least one firing replica. Where every replica fired, each sends its whole gradient and ``S``
becomes their exact average; where only some did, each firing replica sends ``g - g_last`` and the others zeros, and
``S += sum / R``. The all-reduce's result is the same on every replica, so ``S`` is too. The optimizer then steps on
``S`` (a tensor no replica ever had a gradient for keeps ``.grad = None`` everywhere).

Where the trigger holds: it compares the gradient's change with ``||step||^2 / lr^2``, which under gradient descent
is ``||S||^2``-sized. Under Adam a step moves every coordinate by about ``lr`` whatever the gradient, so the right-hand
side is about the number of coordinates, far above a gradient's change: with the paper's constants the trigger
almost never fires and the optimizer steps on gradients many steps old (measured: 95-99 % of the uploads skipped and
training ruined on both quality tasks, BENCHMARKS "Data parallel over slow links"). A smaller ``threshold`` fires
more; with a threshold of 0 every changed gradient is sent. ``LAG(reference="average")`` measures the right-hand side
by the squared norms of the last D averaged gradients, which is what the steps measure under gradient descent; then
the sampling noise of stochastic gradients keeps the trigger firing (9 % and 49 % skipped on the two tasks).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping.comm.replicas import flat_of, ring_share, unflatten_into
from lightning_clapping.sync.base import ReplicaSync
from lightning_clapping.sync.config import LAG


class LazyAggregation(ReplicaSync):
    name = "lag"

    def __init__(self, mode: LAG, group: Any, replicas: int, device: torch.device) -> None:
        super().__init__()
        self.mode, self.group, self.replicas, self.device = mode, group, replicas, device
        self.last_sent: dict[int, Tensor] = {}  # this replica's last sent gradient, per tensor index
        self.stale: dict[int, Tensor] = {}  # the replicas' average of their last sent gradients (the same everywhere)
        self.moves: dict[int, deque[float]] = {}  # ||p_(k+1) - p_k||^2 of the last D steps, per tensor
        self.before: dict[int, Tensor] = {}  # the parameters before the step (for the next move)
        self._pending: tuple[Any, Tensor, list[Tensor], list[int], list[bool]] | None = None
        self._params: list[torch.nn.Parameter] = []

    def after_backward(self, params: list[torch.nn.Parameter], optimizers: list[Any]) -> None:
        alpha = self.mode.lr if self.mode.lr is not None else float(optimizers[0].param_groups[0]["lr"])
        self._params = list(params)
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float() for p in params]
        fire = [self._fires(i, g, alpha) for i, g in enumerate(grads)]
        device = self.device
        counts = torch.tensor(fire, dtype=torch.uint8, device=device)
        dist.all_reduce(counts, group=self.group)
        share = ring_share(self.replicas)
        self.count_every_step_equivalent(params, self.replicas)
        self.count(share * counts.numel())
        per_tensor = counts.tolist()
        sent_idx = [i for i, c in enumerate(per_tensor) if c > 0]
        whole = [per_tensor[i] == self.replicas or i not in self.stale for i in sent_idx]
        parts = []
        for i, all_fired in zip(sent_idx, whole):
            if all_fired:
                parts.append(grads[i])
            elif fire[i]:
                parts.append(grads[i] - self.last_sent[i])
            else:
                parts.append(torch.zeros_like(grads[i]))
            if fire[i] or all_fired:
                self.last_sent[i] = grads[i].clone()
        flat = flat_of(parts).to(device)
        work = dist.all_reduce(flat, group=self.group, async_op=True) if flat.numel() else None
        self.count(share * flat.numel() * 4)
        self._pending = (work, flat, parts, sent_idx, whole)
        if self.mode.reference == "steps":
            for i, p in enumerate(params):
                self.before[i] = p.detach().float().clone()

    def _fires(self, i: int, g: Tensor, alpha: float) -> bool:
        if i not in self.last_sent:
            return True
        change = float((g - self.last_sent[i]).pow(2).sum())
        moved = sum(self.moves.get(i, ()))  # squared steps (reference "steps") or squared averages ("average")
        scale = 1.0 if self.mode.reference == "average" else 1.0 / (alpha * alpha)
        return change > self.mode.threshold / self.mode.memory * scale * moved

    def before_step(self) -> None:
        if self._pending is None:
            return
        work, flat, parts, sent_idx, whole = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        sums = [torch.empty_like(p) for p in parts]
        unflatten_into(flat, sums)
        for i, total, all_fired in zip(sent_idx, sums, whole):
            if all_fired:
                self.stale[i] = total / self.replicas
            else:
                self.stale[i] += total / self.replicas
        for i, p in enumerate(self._params):
            p.grad = self.stale[i].to(p.dtype).clone() if i in self.stale else None

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        for i, p in enumerate(params):
            if self.mode.reference == "average":  # the averaged gradient this step used
                if i not in self.stale:
                    continue
                value = float(self.stale[i].pow(2).sum())
            elif i in self.before:  # the step itself
                value = float((p.detach().float() - self.before[i]).pow(2).sum())
            else:
                continue
            self.moves.setdefault(i, deque(maxlen=self.mode.memory)).append(value)
        self.before.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Flat, tensors only (a checkpoint's per-rank buffers): the last sent gradients, the stale average and the
        parameter-change history."""
        out = {f"last_sent.{i}": t.cpu() for i, t in self.last_sent.items()}
        out.update({f"stale.{i}": t.cpu() for i, t in self.stale.items()})
        out.update({f"moves.{i}": torch.tensor(list(m), dtype=torch.float64) for i, m in self.moves.items()})
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        def part(prefix: str) -> dict[int, Tensor]:
            return {int(k.split(".")[1]): v for k, v in state.items() if k.startswith(prefix + ".")}

        self.last_sent = {i: t.to(self.device) for i, t in part("last_sent").items()}
        self.stale = {i: t.to(self.device) for i, t in part("stale").items()}
        self.moves = {i: deque(m.tolist(), maxlen=self.mode.memory) for i, m in part("moves").items()}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.last_sent, self.stale, self.before)
                   for t in d.values())
