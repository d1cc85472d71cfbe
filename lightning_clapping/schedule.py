"""Pipeline schedules as plain data.

A schedule is, for each stage, the ordered list of actions that stage performs in one training step. It knows
nothing about processes, tensors or compression, so it can be checked exhaustively in unit tests (see
:func:`simulate`). The executor maps each action to one method.

``F`` runs the forward of one micro-batch (receiving the boundary input first on every stage but the first and
sending the output on every stage but the last); ``B`` runs its backward (receiving the gradient on every stage but
the last and sending the input gradient on every stage but the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Fill-drain: every stage runs all forwards, then all backwards in the same micro-batch order."""
    _check(num_stages, num_microbatches)
    steps = [Action("F", i) for i in range(num_microbatches)] + [Action("B", i) for i in range(num_microbatches)]
    return [list(steps) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B: a warm-up of forwards, then alternate one forward and one backward, then drain the backwards.

    Stage ``s`` keeps at most ``num_stages - s`` micro-batches in flight, which bounds activation memory by the
    pipeline depth instead of the number of micro-batches.
    """
    _check(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        fwd, bwd = warmup, 0
        while fwd < num_microbatches:
            actions.append(Action("F", fwd))
            fwd += 1
            actions.append(Action("B", bwd))
            bwd += 1
        actions.extend(Action("B", i) for i in range(bwd, num_microbatches))
        out.append(actions)
    return out


def forward_only(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Evaluation: forwards only, in micro-batch order, on every stage."""
    _check(num_stages, num_microbatches)
    return [[Action("F", i) for i in range(num_microbatches)] for _ in range(num_stages)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str):
    try:
        return SCHEDULES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {num_microbatches}")


@dataclass(frozen=True)
class Message:
    """One point-to-point message implied by a schedule."""

    direction: Literal["fwd", "bwd"]
    src: int
    dst: int
    microbatch: int


def messages(schedule: list[list[Action]]) -> tuple[list[list[Message]], list[list[Message]]]:
    """The sends and receives each stage performs, in order, for ``schedule``."""
    n = len(schedule)
    sends: list[list[Message]] = [[] for _ in range(n)]
    recvs: list[list[Message]] = [[] for _ in range(n)]
    for s, actions in enumerate(schedule):
        for a in actions:
            if a.kind == "F":
                if s > 0:
                    recvs[s].append(Message("fwd", s - 1, s, a.microbatch))
                if s < n - 1:
                    sends[s].append(Message("fwd", s, s + 1, a.microbatch))
            else:
                if s < n - 1:
                    recvs[s].append(Message("bwd", s + 1, s, a.microbatch))
                if s > 0:
                    sends[s].append(Message("bwd", s, s - 1, a.microbatch))
    return sends, recvs


def simulate(schedule: list[list[Action]]) -> int:
    """Run ``schedule`` with blocking receives and asynchronous sends; return the number of rounds it took.

    That is the executor's model: a send is posted and waited for only at the end of the step. Raises
    ``RuntimeError`` on a deadlock (no stage can make progress), when a send has no matching receive, or when a
    backward runs before its forward.
    """
    n = len(schedule)
    sends, recvs = messages(schedule)
    if sorted((m.direction, m.src, m.dst, m.microbatch) for row in sends for m in row) != sorted(
        (m.direction, m.src, m.dst, m.microbatch) for row in recvs for m in row
    ):
        raise RuntimeError("the schedule's sends and receives do not match one to one")
    pc = [0] * n
    delivered: set[tuple] = set()
    done_fwd: list[set[int]] = [set() for _ in range(n)]
    rounds = 0
    while any(pc[s] < len(schedule[s]) for s in range(n)):
        rounds += 1
        progressed = False
        for s in range(n):
            if pc[s] >= len(schedule[s]):
                continue
            a = schedule[s][pc[s]]
            if a.kind == "F":
                need = ("fwd", s - 1, s, a.microbatch) if s > 0 else None
            else:
                if a.microbatch not in done_fwd[s]:
                    raise RuntimeError(f"stage {s} runs B{a.microbatch} before F{a.microbatch}")
                need = ("bwd", s + 1, s, a.microbatch) if s < n - 1 else None
            if need is not None and need not in delivered:
                continue
            if a.kind == "F":
                done_fwd[s].add(a.microbatch)
            out = _outgoing(a, s, n)
            if out is not None:
                delivered.add(out)
            pc[s] += 1
            progressed = True
        if not progressed:
            state = {s: schedule[s][pc[s]] for s in range(n) if pc[s] < len(schedule[s])}
            raise RuntimeError(f"deadlock: stages are blocked at {state}")
    return rounds


def _outgoing(a: Action, s: int, n: int) -> tuple | None:
    if a.kind == "F" and s < n - 1:
        return ("fwd", s, s + 1, a.microbatch)
    if a.kind == "B" and s > 0:
        return ("bwd", s, s - 1, a.microbatch)
    return None

