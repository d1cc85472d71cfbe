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


def incoming(a: Action, s: int, n: int) -> Message | None:
    """The message action ``a`` of stage ``s`` (of ``n``) receives before it runs, if any."""
    if a.kind == "F" and s > 0:
        return Message("fwd", s - 1, s, a.microbatch)
    if a.kind == "B" and s < n - 1:
        return Message("bwd", s + 1, s, a.microbatch)
    return None


def outgoing(a: Action, s: int, n: int) -> Message | None:
    """The message action ``a`` of stage ``s`` (of ``n``) sends when it ends, if any."""
    if a.kind == "F" and s < n - 1:
        return Message("fwd", s, s + 1, a.microbatch)
    if a.kind == "B" and s > 0:
        return Message("bwd", s, s - 1, a.microbatch)
    return None


def messages(schedule: list[list[Action]]) -> tuple[list[list[Message]], list[list[Message]]]:
    """The sends and receives each stage performs, in order, for ``schedule``."""
    n = len(schedule)
    sends: list[list[Message]] = [[] for _ in range(n)]
    recvs: list[list[Message]] = [[] for _ in range(n)]
    for s, actions in enumerate(schedule):
        for a in actions:
            received, sent = incoming(a, s, n), outgoing(a, s, n)
            if received is not None:
                recvs[s].append(received)
            if sent is not None:
                sends[s].append(sent)
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
    delivered: set[Message] = set()
    done_fwd: list[set[int]] = [set() for _ in range(n)]
    rounds = 0
    while any(pc[s] < len(schedule[s]) for s in range(n)):
        rounds += 1
        progressed = False
        for s in range(n):
            if pc[s] >= len(schedule[s]):
                continue
            a = schedule[s][pc[s]]
            if a.kind == "B" and a.microbatch not in done_fwd[s]:
                raise RuntimeError(f"stage {s} runs B{a.microbatch} before F{a.microbatch}")
            need = incoming(a, s, n)
            if need is not None and need not in delivered:
                continue
            if a.kind == "F":
                done_fwd[s].add(a.microbatch)
            out = outgoing(a, s, n)
            if out is not None:
                delivered.add(out)
            pc[s] += 1
            progressed = True
        if not progressed:
            state = {s: schedule[s][pc[s]] for s in range(n) if pc[s] < len(schedule[s])}
            raise RuntimeError(f"deadlock: stages are blocked at {state}")
    return rounds


# ---------------------------------------------------------------------------------------------- grouped messages
@dataclass(frozen=True)
class Exchange:
    """Messages a stage issues together, as one ``torch.distributed.batch_isend_irecv``, between two actions."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


def with_exchanges(schedule: list[list[Action]]) -> list[list[Action | Exchange]]:
    """Each stage's actions with the groups of messages it issues between them.

    Before action ``i`` one exchange holds what action ``i - 1`` sends and what action ``i`` receives; after the last
    action one holds what it sends (empty exchanges are left out). So a send is issued with the stage's next receive,
    as ``torch.distributed.pipelining`` fuses them: in 1F1B's steady state a stage's forward output to the next stage
    travels with the gradient it expects back from it, and its input gradient to the previous stage with the next
    activation it expects from it, so two neighbours that both send before they receive have the operations the
    other waits for in one group. The one exception: when the peer can produce the expected message only after it
    has consumed the sent one (GPipe's last forward and first backward), the send goes first, in an exchange of its
    own, because a resize (see :func:`simulate_exchanges`) delays the message until its exchange has completed.
    :func:`simulate_exchanges` checks that none of this can deadlock under NCCL's semantics.
    """
    n = len(schedule)
    position = [{a: i for i, a in enumerate(actions)} for actions in schedule]

    def depends(received: Message, sent: Message) -> bool:
        """Whether ``received`` is produced by ``sent``'s receiver after it has consumed ``sent``."""
        if received.src != sent.dst:
            return False
        peer = position[sent.dst]
        produce = Action("F" if received.direction == "fwd" else "B", received.microbatch)
        consume = Action("F" if sent.direction == "fwd" else "B", sent.microbatch)
        return peer[produce] > peer[consume]

    out: list[list[Action | Exchange]] = []
    for s, actions in enumerate(schedule):
        steps: list[Action | Exchange] = []
        pending: tuple[Message, ...] = ()
        for a in actions:
            received = incoming(a, s, n)
            recvs = (received,) if received is not None else ()
            if recvs and any(depends(recvs[0], m) for m in pending):
                steps.append(Exchange(pending, ()))
                pending = ()
            if pending or recvs:
                steps.append(Exchange(pending, recvs))
            steps.append(a)
            sent = outgoing(a, s, n)
            pending = (sent,) if sent is not None else ()
        if pending:
            steps.append(Exchange(pending, ()))
        out.append(steps)
    return out


def simulate_exchanges(steps: list[list[Action | Exchange]], resized: frozenset[Message] = frozenset()) -> int:
    """Run each stage's exchanges under NCCL's semantics; return the number of rounds it took.

    The model: a stage issues a group of operations only once its previous group has completed; a group completes
    when each of its operations has met its peer's (a send waits for the receive, a receive for the send); the k-th
    message from one stage to another meets the k-th receive the other posts from it (tags are ignored).

    A message in ``resized`` changes size: its sender sends a resize message in the exchange and the message itself
    in a follow-up group issued right after the exchange completes; its receiver receives the resize in the
    exchange, and the message in its own follow-up group (it learns of the resize only when the exchange has
    completed). One follow-up group holds both the stage's delayed messages and its second receives: that is what
    keeps two neighbours that resize towards each other at once from both waiting on a lone send.

    Raises ``RuntimeError`` on a deadlock, or when the two ends' orders pair different messages.
    """
    Op = tuple[bool, tuple[int, int], tuple]  # noqa: N806  (is a send, (from, to), what it carries)
    groups: list[list[list[Op]]] = []
    for row in steps:
        mine: list[list[Op]] = []
        for step in row:
            if not isinstance(step, Exchange):
                continue
            ops: list[Op] = []
            follow: list[Op] = []
            for is_send, batch in ((True, step.sends), (False, step.recvs)):
                for m in batch:
                    link = (m.src, m.dst)
                    if m in resized:
                        ops.append((is_send, link, ("resize", m)))
                        follow.append((is_send, link, ("message", m)))
                    else:
                        ops.append((is_send, link, ("message", m)))
            mine.append(ops)
            if follow:
                mine.append(follow)
        groups.append(mine)
    # the k-th send from a to b meets the k-th receive at b from a
    place: dict[tuple[bool, tuple[int, int], int], tuple[int, int, tuple]] = {}
    seen: dict[tuple[bool, tuple[int, int]], int] = {}
    for s, mine in enumerate(groups):
        for g, ops in enumerate(mine):
            for is_send, link, label in ops:
                k = seen.get((is_send, link), 0)
                seen[(is_send, link)] = k + 1
                place[(is_send, link, k)] = (s, g, label)
    peers: list[list[list[tuple[int, int]]]] = [[[] for _ in mine] for mine in groups]
    for (is_send, link, k), (s, g, label) in place.items():
        other = place.get((not is_send, link, k))
        if other is None:
            raise RuntimeError(f"stage {s} {'sends' if is_send else 'receives'} {label} and nothing meets it")
        if other[2] != label:
            raise RuntimeError(f"by their order, {label} meets {other[2]} between stages {link[0]} and {link[1]}")
        peers[s][g].append(other[:2])
    active = [0] * len(groups)  # index of the group each stage has issued and waits for
    rounds = 0
    while any(active[s] < len(groups[s]) for s in range(len(groups))):
        rounds += 1
        progressed = False
        for s in range(len(groups)):
            g = active[s]
            if g < len(groups[s]) and all(active[ps] >= pg for ps, pg in peers[s][g]):  # every peer op is issued
                active[s] += 1
                progressed = True
        if not progressed:
            state = {s: groups[s][active[s]] for s in range(len(groups)) if active[s] < len(groups[s])}
            raise RuntimeError(f"deadlock: stages wait in the groups {state}")
    return rounds
