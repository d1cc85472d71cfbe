"""The timing model: how long one training step of a schedule takes, given each stage's compute and each link.

:func:`step_time` plays a schedule (:mod:`lightning_clapping.pipeline.schedule`) as the executor runs it: each stage
runs its actions in order, a message leaves when the action that sends it ends, queues on its link (one per boundary
and direction), and arrives one delay later. Autotune (:mod:`lightning_clapping.autotune.choose`) prices codecs and
schedules with it; it knows nothing about processes or tensors, so it is checked in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_clapping.pipeline.schedule import Action, Message, incoming, outgoing


@dataclass(frozen=True)
class Link:
    """One boundary as the timing model sees it: the one-way delay and, per direction, the seconds a message holds
    the link (its bytes over the bandwidth) and the codec work it adds on each end."""

    delay_s: float = 0.0
    fwd_s: float = 0.0  #: transfer of one forward message (activations), stage b to b + 1
    bwd_s: float = 0.0  #: transfer of one backward message (gradients), stage b + 1 to b
    fwd_codec_s: tuple[float, float] = (0.0, 0.0)  #: (sender, receiver) codec seconds of one forward message
    bwd_codec_s: tuple[float, float] = (0.0, 0.0)


def step_time(schedule: list[list[Action]], forward_s: list[float], backward_s: list[float],
              links: list[Link]) -> float:
    """Seconds one training step takes under ``schedule``, by the executor's model: a stage runs its actions in order,
    each waiting for the message it receives; a send leaves when its action ends, waits while its link (one per
    boundary and direction, first come first served) is busy with earlier messages, holds it for the transfer, and
    arrives one delay later. ``forward_s[s]`` / ``backward_s[s]``: compute per micro-batch of stage ``s``;
    ``links[b]``: boundary ``b`` (between stages ``b`` and ``b + 1``). The codec work of a message is added to the
    action that sends it and to the one that receives it.

    What it leaves out: the per-message work of gloo and TCP (beyond the bandwidth the probe measured, which
    includes it), contention between ranks for the CPU, and TCP's congestion window. It is meant to rank settings
    and schedules against each other, not to predict a step to the millisecond.
    """
    n = len(schedule)
    if not (len(forward_s) == len(backward_s) == n and len(links) == n - 1):
        raise ValueError(f"{n} stages need {n} forward and backward times and {n - 1} links, got "
                         f"{len(forward_s)}, {len(backward_s)} and {len(links)}")
    clock = [0.0] * n
    link_free: dict[tuple[str, int], float] = {}  # (direction, boundary) -> when its link is free again
    arrived: dict[Message, float] = {}
    pc = [0] * n
    while any(pc[s] < len(schedule[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while pc[s] < len(schedule[s]):
                a = schedule[s][pc[s]]
                received, sent = incoming(a, s, n), outgoing(a, s, n)
                if received is not None and received not in arrived:
                    break
                work = forward_s[s] if a.kind == "F" else backward_s[s]
                ready = 0.0
                if received is not None:
                    ready = arrived[received]
                    work += _codec_s(links, received)[1]
                if sent is not None:
                    work += _codec_s(links, sent)[0]
                clock[s] = max(clock[s], ready) + work
                if sent is not None:
                    link, lane = links[min(sent.src, sent.dst)], (sent.direction, min(sent.src, sent.dst))
                    leave = max(clock[s], link_free.get(lane, 0.0)) + (link.fwd_s if sent.direction == "fwd" else
                                                                       link.bwd_s)
                    link_free[lane] = leave
                    arrived[sent] = leave + link.delay_s
                pc[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("deadlock: the schedule cannot be timed")
    return max(clock)


def _codec_s(links: list[Link], m: Message) -> tuple[float, float]:
    """(sender, receiver) codec seconds of message ``m`` on its boundary's link."""
    link = links[min(m.src, m.dst)]
    return link.fwd_codec_s if m.direction == "fwd" else link.bwd_codec_s
