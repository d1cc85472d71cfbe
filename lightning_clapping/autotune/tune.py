"""Autotune: measure each boundary's link once, then give every boundary the least lossy codecs its link can carry.

Two parts, used once after the first training step (every rank takes part; see :func:`agree` for the whole
sequence):

1. **Measuring** (:func:`probe_link`, :func:`probe_boundaries`). The two ranks of a boundary exchange timed probe
   messages: a few small ping-pongs give the round-trip time (median), then bulk messages the bandwidth of each
   direction. The initiator drives the probe with 64-byte control messages (what comes next, how many bytes); the
   peer follows them. gloo moves a message only once its receive is posted, so each side posts a receive *before*
   it sends the message that lets the other side send (gloo's "ready" notice then travels ahead of that message on
   the same connection), and every time is taken on the initiator, on one clock:

   =====================  ===========================================================================================
   round trip             initiator sends 64 bytes, the peer answers 64 bytes: ``RTT`` (median of ``pings``)
   forward bulk           (untimed: the initiator announces ``B`` bytes, the peer posts the receive and says ready)
                          initiator sends ``B`` bytes, the peer answers 64 bytes once all of them arrived:
                          ``T = RTT + B / bandwidth``
   backward bulk          initiator posts the receive and asks for ``B`` bytes, the peer sends them: the same formula
   =====================  ===========================================================================================

   so ``one_way_delay = RTT / 2`` and ``bandwidth = B / (T - RTT_min)``, where:

   * ``T`` is the fastest transfer of that direction. A link is never faster than its rate, and the first transfers
     over a wide-area link are slowed by TCP opening its congestion window (on the project's 25 Mbit/s, 25 ms delay
     link a first 256 KiB transfer took 246 ms, the next ones 138 ms), so transfers repeat until the newest is no
     longer :data:`STEADY` faster than the best before it.
   * ``RTT_min`` is the fastest ping: on a busy machine a ping now and then waits for a CPU, and subtracting the
     median would make a link look faster than it is.
   * ``B`` starts at the caller's size, best the boundary's real message: on that same link a 512 KiB message
     overflows the link's 100 ms queue once per transfer and TCP's retransmission makes it 20 Mbit/s instead of 24,
     which is then what such messages really get. A transfer that serialises in less than the fastest ping (or
     1 ms) cannot be timed against the round trip; the probe then grows ``B`` 4-fold, up to :data:`MAX_PROBE_BYTES`.

   The bandwidth counts message bytes, so TCP/IP headers and gloo's own work are inside it. The initiator sends its
   numbers to the peer as float64 at the end, so **both ends return the same measurement, bit for bit**, and only
   the initiator's settings count (the peer learns every size from the control messages, so the two ends cannot
   disagree about a receive's size).

   A rank belongs to two boundaries, so :func:`probe_boundaries` probes the even boundaries first, then the odd ones:
   within one phase every rank talks to at most one neighbour, and the links of different pairs are measured at the
   same time, as the pipeline uses them. Probes use tags from :data:`PROBE_TAG` up, far above the pipeline's
   ``purpose * 1_000_000 + slot * 2 + k``.

2. **Choosing** (:func:`choose`, a pure and deterministic function). For each boundary and direction, the message of
   one micro-batch is priced with every candidate setting: its exact size on the wire (the codec's
   ``payload_nbytes`` plus the message header, :func:`lightning_clapping.comm.channel.message_nbytes`), divided by the
   measured bandwidth of that direction. Two rules use these prices.

   **The step rule** (what the strategy uses): the timing model :func:`lightning_clapping.pipeline.schedule.step_time` plays
   one training step of the running schedule with every stage's measured compute (a third forward, two thirds
   backward), every boundary's delay, transfers that queue on their link, and the codec work timed on the real
   messages (:func:`codec_times`: the sender encodes and decodes, the receiver decodes). It finds the fastest
   settings, then moves towards less lossy ones, one rung at a time and the cheapest move first, while the predicted
   step stays within ``1 + tolerance`` (default :data:`DEFAULT_TOLERANCE` = 5 %) of the fastest. Delay matters here:
   under 1F1B with more micro-batches than stages, stage 0 waits for gradients to come back through the delayed
   links more than once per step, and each transfer lengthens every such wait; a message that "hides" behind compute
   in the steady state can still cost a tenth of the step (the per-message rule chose bf16 on 100 Mbit/s links with
   25 ms of delay, and that run was 12 % slower than q4/q8). With several schedules (:func:`choose_pipeline`,
   ``ClappingStrategy(schedule="auto")``), the first is kept unless another's predicted step is more than the
   tolerance shorter.

   **The per-message rule** (``schedule=None``): the least lossy setting whose transfer hides behind compute::

       transfer seconds per micro-batch  <=  headroom x compute seconds per micro-batch

   where the compute is the pipeline's cycle, the largest forward+backward time per micro-batch of any stage.
   ``headroom`` (default :data:`DEFAULT_HEADROOM` = 0.8) leaves 20 % for what the measurement misses. When no
   candidate hides, the one with the smallest transfer time is taken (on a tie, the less lossy one). It ignores
   delay and codec work; the ``hides`` flags of every Choice report this test.

   Both rules treat links as full duplex: forward and backward messages cross in opposite directions at the same
   time, each on its own queue.

Candidates are settings ordered from least to most lossy: ``"uncompressed"`` or a codec string of
:func:`lightning_clapping.codecs.get_codec`. The default ladders (:data:`DEFAULT_CANDIDATES`) are

====================  =========================================  ==================================================
direction             ladder                                      why
====================  =========================================  ==================================================
forward (activations) uncompressed, bf16, q8, q4                  AQ-SGD's runs sent 4-bit activations
backward (gradients)  uncompressed, bf16, q8                      gradients tolerate less (8-bit in the same runs)
====================  =========================================  ==================================================

and :func:`ladder` builds one whose last rung is the codec the user configured (``forward_codec=`` /
``backward_codec=``): autotune then never compresses more than the user asked for.

A :class:`Choice` says, per boundary, the variant (``"uncompressed"`` when both directions stay uncompressed, else
the compressed variant the user chose) and the setting of each direction, with the numbers that justified it;
:meth:`Choice.rule` gives the ``(variant, codec)`` pair to build each direction's
:class:`~lightning_clapping.codecs.feedback.MessageRule` with (a direction that stays uncompressed gets the ``"uncompressed"``
rule even when the other one is compressed). :func:`describe` makes the log table.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist

from lightning_clapping.comm.channel import message_nbytes
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import VARIANTS
from lightning_clapping.pipeline.schedule import Link, get_schedule, step_time

__all__ = [
    "DEFAULT_CANDIDATES", "DEFAULT_HEADROOM", "DEFAULT_TOLERANCE", "PROBE_TAG", "UNCOMPRESSED", "Choice",
    "LinkMeasure", "ProbeError", "agree", "choose", "choose_pipeline", "codec_times", "describe", "ladder",
    "log_values", "message_bytes", "probe_boundaries", "probe_link", "probe_plan", "tune_pipeline",
]

UNCOMPRESSED = "uncompressed"
DIRECTIONS = ("fwd", "bwd")
DEFAULT_CANDIDATES: dict[str, tuple[str, ...]] = {
    "fwd": (UNCOMPRESSED, "bf16", "q8", "q4"),
    "bwd": (UNCOMPRESSED, "bf16", "q8"),
}
DEFAULT_HEADROOM = 0.8
DEFAULT_TOLERANCE = 0.05

#: first tag of the probe messages; the pipeline's tags are ``purpose * 1_000_000 + slot * 2 + k`` with purposes 1-3
PROBE_TAG = 2_000_000_000
_CTRL, _REPLY, _BULK = range(3)  # tags: initiator's control messages, the peer's answers, bulk data (both ways)
_HELLO, _PING, _TO_PEER, _FROM_PEER, _DONE = range(1, 6)  # control commands
SMALL_BYTES = 64
#: the bulk size a probe uses is clamped to [MIN_PROBE_BYTES, MAX_PROBE_BYTES]
MIN_PROBE_BYTES = 256 << 10
MAX_PROBE_BYTES = 4 << 20
_MAGIC = 0x434C_4150_5052_4F42  # "CLAPPROB"
_VERSION = 1
_MAX_PINGS = 1000
#: a direction's bulk transfers are repeated until the newest is no more than this share faster than the best before
STEADY = 0.05
#: a bulk transfer shorter than the fastest ping (and than this) is too short to time against the round trip: the
#: probe then repeats it with 4 times the bytes, up to MAX_PROBE_BYTES
_MIN_SERIAL_S = 1e-3
#: the share of a bulk time T counted as transfer at least: when T less the fastest ping is shorter even at
#: MAX_PROBE_BYTES (a link far faster than any compute it must hide behind, e.g. loopback on a busy machine), the
#: bandwidth is reported as B / (this x T)
_MIN_SERIAL_SHARE = 0.25


class ProbeError(RuntimeError):
    """The two ends of a probe disagree about its protocol."""


# --------------------------------------------------------------------------------------------------------------------
# Measurements


@dataclass(frozen=True)
class LinkMeasure:
    """What :func:`probe_link` measured on one link (the same on both ends).

    ``bandwidth_bytes_per_s`` is the rate from the initiator to the peer: with :func:`probe_boundaries` the initiator
    is the lower stage, so it is the forward direction of the boundary. ``reverse_bandwidth_bytes_per_s`` is the
    other direction (None when only one direction was probed: then it is taken to be the same). Bandwidths count
    message bytes (what gloo is handed), so TCP/IP headers and gloo's own work are inside them.
    """

    one_way_delay_s: float
    bandwidth_bytes_per_s: float
    reverse_bandwidth_bytes_per_s: float | None = None
    rtt_s: float = math.nan  #: median round trip of the small messages (2 x one_way_delay_s)
    probe_bytes: int = 0  #: size of the bulk transfers the bandwidths come from (the larger of the two directions')
    probe_s: float = math.nan  #: wall-clock time the whole probe took

    def bandwidth(self, direction: str) -> float:
        """Bytes per second forward (``"fwd"``, initiator to peer) or backward (``"bwd"``)."""
        if direction == "fwd":
            return self.bandwidth_bytes_per_s
        if direction == "bwd":
            rev = self.reverse_bandwidth_bytes_per_s
            return self.bandwidth_bytes_per_s if rev is None else rev
        raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")

    def to_wire(self) -> list[float]:
        rev = self.reverse_bandwidth_bytes_per_s
        return [self.one_way_delay_s, self.bandwidth_bytes_per_s, math.nan if rev is None else rev, self.rtt_s,
                float(self.probe_bytes), self.probe_s]

    @classmethod
    def from_wire(cls, values: Sequence[float]) -> LinkMeasure:
        if len(values) != 6:
            raise ProbeError(f"a link measurement is 6 numbers, got {len(values)}")
        delay, bw, rev, rtt, nbytes, seconds = (float(v) for v in values)
        if not (math.isfinite(delay) and delay >= 0 and bw > 0 and (math.isnan(rev) or rev > 0)):
            raise ProbeError(f"not a link measurement: delay {delay}, bandwidths {bw}, {rev}")
        return cls(delay, bw, None if math.isnan(rev) else rev, rtt, int(nbytes), seconds)


Group = Any  # a torch.distributed ProcessGroup or None (the default group)


def probe_link(
    peer: int,
    initiator: bool,
    group: Group = None,
    *,
    nbytes: int = 1 << 20,
    pings: int = 5,
    min_repeats: int = 3,
    max_repeats: int = 8,
    max_seconds: float = 5.0,
    min_transfer_s: float = _MIN_SERIAL_S,
    both_directions: bool = True,
    timeout: timedelta | None = None,
) -> LinkMeasure:
    """Measure the link to the global rank ``peer``; call it on both ranks at the same time, one with
    ``initiator=True``. Returns the same :class:`LinkMeasure` on both ranks.

    The keyword arguments count on the initiator only (it drives the probe; the peer follows its messages):
    ``nbytes`` is the bulk size, clamped to [:data:`MIN_PROBE_BYTES`, :data:`MAX_PROBE_BYTES`] and grown 4-fold
    while a transfer serialises in less than the fastest ping or ``min_transfer_s`` (too short to time against the
    round trip); ``pings`` timed
    round trips; per direction at least ``min_repeats`` bulk transfers, then more until one is no longer
    :data:`STEADY` (5 %) faster than the best before it (TCP's window has opened), at most ``max_repeats`` and,
    beyond ``min_repeats``, not after ``max_seconds``. ``timeout`` bounds every single wait (default: the group's).
    """
    if initiator:
        nbytes = min(max(int(nbytes), MIN_PROBE_BYTES), MAX_PROBE_BYTES)
        if not 1 <= pings <= _MAX_PINGS or not 1 <= min_repeats <= max_repeats:
            raise ValueError(f"pings in 1..{_MAX_PINGS} and 1 <= min_repeats <= max_repeats, got {pings}, "
                             f"{min_repeats}, {max_repeats}")
        return _probe_initiator(peer, group, nbytes, pings, min_repeats, max_repeats, max_seconds, min_transfer_s,
                                both_directions, timeout)
    return _probe_peer(peer, group, timeout)


def _control(command: int, number: int = 0, values: Sequence[float] = ()) -> torch.Tensor:
    """A 64-byte control message: the command and a number as int64, then up to six float64 values."""
    msg = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
    msg.view(torch.int64)[:2] = torch.tensor([command, number], dtype=torch.int64)
    if values:
        msg.view(torch.float64)[2 : 2 + len(values)] = torch.tensor(list(values), dtype=torch.float64)
    return msg


class _Wire:
    """Point-to-point messages of one probe, under the probe's tags."""

    def __init__(self, peer: int, group: Group, timeout: timedelta | None) -> None:
        self.peer, self.group, self.timeout = peer, group, timeout

    def send(self, msg: torch.Tensor, kind: int) -> Any:
        return dist.isend(msg, dst=self.peer, group=self.group, tag=PROBE_TAG + kind)

    def recv(self, buf: torch.Tensor, kind: int) -> Any:
        return dist.irecv(buf, src=self.peer, group=self.group, tag=PROBE_TAG + kind)

    def wait(self, work: Any) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)


def _probe_initiator(peer: int, group: Group, nbytes: int, pings: int, min_repeats: int, max_repeats: int,
                     max_seconds: float, min_transfer_s: float, both: bool, timeout: timedelta | None) -> LinkMeasure:
    start = time.perf_counter()
    wire = _Wire(peer, group, timeout)
    reply = torch.empty(SMALL_BYTES, dtype=torch.uint8)
    bulk = torch.zeros(MAX_PROBE_BYTES, dtype=torch.uint8)

    def exchange(msg: torch.Tensor, kind: int, answer: torch.Tensor, answer_kind: int) -> float:
        """Send ``msg`` under ``kind`` and time until ``answer`` arrived (its receive is posted first)."""
        work = wire.recv(answer, answer_kind)
        t0 = time.perf_counter()
        sent = wire.send(msg, kind)
        wire.wait(work)
        seconds = time.perf_counter() - t0
        wire.wait(sent)
        return seconds

    exchange(_control(_HELLO, _MAGIC), _CTRL, reply, _REPLY)  # waits for the peer to arrive; warms the connection
    rtts = [exchange(_control(_PING), _CTRL, reply, _REPLY) for _ in range(pings)]
    rtt = statistics.median(rtts)
    floor = min(rtts)  # taken off the bulk times: never more than their round trip, even when pings were delayed

    def to_peer(size: int) -> float:
        ready = wire.recv(reply, _REPLY)
        wire.wait(wire.send(_control(_TO_PEER, size), _CTRL))
        wire.wait(ready)  # the peer has posted the bulk receive: the bulk message flows at once
        return exchange(bulk[:size], _BULK, reply, _REPLY)  # the peer answers once all of it has arrived

    def from_peer(size: int) -> float:
        return exchange(_control(_FROM_PEER, size), _CTRL, bulk[:size], _BULK)  # receive posted before the ask

    def best_time(transfer: Callable[[int], float]) -> tuple[float, int]:
        size, t0, times = nbytes, time.perf_counter(), []
        while True:
            times.append(transfer(size))
            if (times[-1] - floor < max(floor, min_transfer_s) and size < MAX_PROBE_BYTES
                    and time.perf_counter() - t0 <= max_seconds):
                size, times = min(4 * size, MAX_PROBE_BYTES), []  # too short to time against the round trip
                continue
            if len(times) >= max_repeats:
                break
            if len(times) >= min_repeats and (
                    times[-1] >= (1 - STEADY) * min(times[:-1]) or time.perf_counter() - t0 > max_seconds):
                break
        return min(times), size

    def rate(best: float, size: int) -> float:
        return size / max(best - floor, _MIN_SERIAL_SHARE * best)

    forward, forward_bytes = best_time(to_peer)
    backward, backward_bytes = best_time(from_peer) if both else (math.nan, 0)
    measure = LinkMeasure(one_way_delay_s=rtt / 2, bandwidth_bytes_per_s=rate(forward, forward_bytes),
                          reverse_bandwidth_bytes_per_s=rate(backward, backward_bytes) if both else None,
                          rtt_s=rtt, probe_bytes=max(forward_bytes, backward_bytes),
                          probe_s=time.perf_counter() - start)
    wire.wait(wire.send(_control(_DONE, _VERSION, measure.to_wire()), _CTRL))
    return measure


def _probe_peer(peer: int, group: Group, timeout: timedelta | None) -> LinkMeasure:
    """Follow the initiator's control messages; every receive is posted before the message that lets the
    initiator send what it receives."""
    wire = _Wire(peer, group, timeout)
    ctrl = torch.empty(SMALL_BYTES, dtype=torch.uint8)
    answer = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
    bulk = torch.empty(0, dtype=torch.uint8)
    work = wire.recv(ctrl, _CTRL)
    first = True
    while True:
        wire.wait(work)
        command, number = ctrl.view(torch.int64)[:2].tolist()
        values = ctrl.view(torch.float64)[2:].tolist()
        if first and (command, number) != (_HELLO, _MAGIC):
            raise ProbeError(f"rank {peer} did not start a link probe (got command {command}, {number:#x})")
        first = False
        if command in (_TO_PEER, _FROM_PEER) and not MIN_PROBE_BYTES <= number <= MAX_PROBE_BYTES:
            raise ProbeError(f"rank {peer} asked for a bulk transfer of {number} bytes, outside "
                             f"[{MIN_PROBE_BYTES}, {MAX_PROBE_BYTES}]")
        if command in (_TO_PEER, _FROM_PEER) and bulk.numel() != number:
            bulk = torch.zeros(number, dtype=torch.uint8)
        if command == _DONE:
            if number != _VERSION:
                raise ProbeError(f"rank {peer} runs link probe version {number}, this rank {_VERSION}")
            return LinkMeasure.from_wire(values)
        if command in (_HELLO, _PING):
            work = wire.recv(ctrl, _CTRL)
            wire.wait(wire.send(answer, _REPLY))
        elif command == _TO_PEER:
            arrived = wire.recv(bulk, _BULK)
            wire.wait(wire.send(answer, _REPLY))  # ready
            wire.wait(arrived)
            work = wire.recv(ctrl, _CTRL)
            wire.wait(wire.send(answer, _REPLY))  # all of it arrived
        elif command == _FROM_PEER:
            work = wire.recv(ctrl, _CTRL)
            wire.wait(wire.send(bulk, _BULK))
        else:
            raise ProbeError(f"rank {peer} sent an unknown probe command {command}")


def probe_plan(stage: int, num_stages: int) -> list[tuple[int, int, bool]]:
    """The probes ``stage`` takes part in, in order: ``(boundary, peer stage, initiator)``.

    Even boundaries first, then odd ones: in each phase a stage is in at most one probe (its two boundaries have
    different parities), so no stage waits for a neighbour that is busy with its other neighbour. The lower stage of
    a boundary initiates (its forward direction is then the initiator's).
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")
    plan = []
    for phase in (0, 1):
        for boundary in (stage - 1, stage):
            if 0 <= boundary < num_stages - 1 and boundary % 2 == phase:
                lower = boundary == stage  # this stage is the boundary's lower end: it initiates
                plan.append((boundary, boundary + 1 if lower else boundary, lower))
    return plan


def probe_boundaries(
    stage: int,
    num_stages: int,
    rank_of_stage: Callable[[int], int],
    message_bytes_per_boundary: int | Sequence[int] | Mapping[int, int],
    group: Group = None,
    **probe_kwargs: Any,
) -> dict[int, LinkMeasure]:
    """Probe this stage's boundaries (even ones first, see :func:`probe_plan`); every stage calls it at once.

    ``message_bytes_per_boundary`` is the bulk size per boundary (one int for all, or indexed by boundary): e.g. the
    boundary's uncompressed message of one micro-batch; only the lower stage's value is used, clamped to
    [:data:`MIN_PROBE_BYTES`, :data:`MAX_PROBE_BYTES`]. ``probe_kwargs`` go to :func:`probe_link`. Returns
    ``{boundary: LinkMeasure}`` for the (at most two) boundaries of this stage, the same on both ends of each.
    """
    out = {}
    for boundary, peer_stage, initiator in probe_plan(stage, num_stages):
        if isinstance(message_bytes_per_boundary, int):
            nbytes = message_bytes_per_boundary
        else:
            nbytes = message_bytes_per_boundary[boundary]
        out[boundary] = probe_link(rank_of_stage(peer_stage), initiator, group, nbytes=int(nbytes), **probe_kwargs)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Choosing

#: one tensor of a message: (shape, dtype) or (shape, dtype, compressible); non-floating tensors are never compressed
TensorSpec = Union[tuple[Sequence[int], torch.dtype], tuple[Sequence[int], torch.dtype, bool]]
MessageShapes = Mapping[int, Mapping[str, Sequence[TensorSpec]]]
#: ``{boundary: {direction: {setting: (sender seconds, receiver seconds)}}}``: codec work of one message
CodecTimes = Mapping[int, Mapping[str, Mapping[str, tuple[float, float]]]]


def _spec(spec: TensorSpec) -> tuple[tuple[int, ...], torch.dtype, bool]:
    if len(spec) == 2:
        shape, dtype = spec
        compressible = True
    else:
        shape, dtype, compressible = spec
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"a tensor spec is (shape, torch dtype[, compressible]), got {spec!r}")
    return tuple(int(d) for d in shape), dtype, bool(compressible) and dtype.is_floating_point


def message_bytes(specs: Sequence[TensorSpec], setting: str) -> int:
    """Bytes on the wire of one message holding tensors of ``specs`` under ``setting`` (``"uncompressed"`` or a
    codec string): the codec's payloads (the raw bytes of tensors it does not compress) plus the header."""
    codec = None if setting == UNCOMPRESSED else get_codec(setting)
    parts = []
    for spec in specs:
        shape, dtype, compressible = _spec(spec)
        if codec is None or not compressible:
            parts.append((shape, math.prod(shape) * dtype.itemsize))
        else:
            parts.append((shape, codec.payload_nbytes(shape, dtype)))
    return message_nbytes(parts)


def ladder(direction: str, user_codec: Any = None) -> tuple[str, ...]:
    """The candidate settings of one direction, least lossy first.

    Without ``user_codec``: :data:`DEFAULT_CANDIDATES`. With it (the codec the user configured for this direction,
    a string or a :class:`~lightning_clapping.codecs.Codec` with a registry ``name``): the default rungs that send
    more bytes per value than it, then the user's codec as the most lossy rung (bytes per value are compared on a
    64 x 1024 float32 tensor).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")
    default = DEFAULT_CANDIDATES[direction]
    if user_codec is None:
        return default
    codec = get_codec(user_codec)
    name = user_codec if isinstance(user_codec, str) else codec.name
    get_codec(name)  # the ladder holds strings: the codec must be reachable from its name
    ref = [((64, 1024), torch.float32)]
    limit = message_bytes(ref, name)
    if limit >= message_bytes(ref, UNCOMPRESSED):  # it saves nothing: stay uncompressed
        return (UNCOMPRESSED,)
    return tuple(s for s in default if message_bytes(ref, s) > limit) + (name,)


@dataclass(frozen=True)
class Choice:
    """What autotune chose for one boundary, and why (times and bytes per micro-batch message)."""

    boundary: int
    variant: str  #: "uncompressed" when both directions are, else the compressed variant the user chose
    forward: str  #: setting of the forward direction: "uncompressed" or a codec string
    backward: str
    forward_bytes: int
    backward_bytes: int
    forward_s: float  #: predicted transfer time of one forward message (uncompressed share included)
    backward_s: float
    compute_s: float  #: the compute per micro-batch the transfers must hide behind (the pipeline's cycle)
    budget_s: float  #: headroom x compute_s
    forward_hides: bool
    backward_hides: bool
    #: the step the timing model predicts with every boundary's choice (None: chosen by the per-message rule)
    step_s: float | None = None
    #: the schedule the step was predicted for ("" with the per-message rule)
    schedule: str = ""
    #: every candidate priced: (direction, setting, bytes, seconds)
    options: tuple[tuple[str, str, int, float], ...] = ()

    def setting(self, direction: str) -> str:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction is 'fwd' or 'bwd', got {direction!r}")
        return self.forward if direction == "fwd" else self.backward

    def rule(self, direction: str) -> tuple[str, str]:
        """``(variant, codec)`` for this direction's MessageRule: an uncompressed direction gets the
        ``"uncompressed"`` rule (its codec, ``"identity"``, is then not used)."""
        setting = self.setting(direction)
        return (UNCOMPRESSED, "identity") if setting == UNCOMPRESSED else (self.variant, setting)

    @property
    def compressed(self) -> bool:
        return self.variant != UNCOMPRESSED

    def to_wire(self) -> tuple:
        """Plain Python values (for a broadcast, a log, JSON); :meth:`from_wire` rebuilds the Choice."""
        return (self.boundary, self.variant, self.forward, self.backward, self.forward_bytes, self.backward_bytes,
                self.forward_s, self.backward_s, self.compute_s, self.budget_s, self.forward_hides,
                self.backward_hides, self.step_s, self.schedule, tuple(tuple(o) for o in self.options))

    @classmethod
    def from_wire(cls, values: Sequence[Any]) -> Choice:
        *head, options = values
        return cls(*head, options=tuple(tuple(o) for o in options))


def _stage_compute(compute: float | Sequence[float] | Mapping[int, float]) -> list[float]:
    values = [compute] if isinstance(compute, (int, float)) else list(
        compute.values() if isinstance(compute, Mapping) else compute)
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"compute seconds per micro-batch must be finite numbers >= 0, got {compute!r}")
    return [float(v) for v in values]


Priced = tuple[str, int, float]  # (setting, bytes of one message, mean transfer seconds of one message)


def _price(measures: Mapping[int, LinkMeasure], message_shapes: MessageShapes, ladders: Mapping[str, tuple[str, ...]],
           fractions: Mapping[str, float]) -> dict[tuple[int, str], list[Priced]]:
    """Every candidate of every boundary and direction, with its bytes and its transfer time on the measured link."""
    out = {}
    for boundary in sorted(message_shapes):
        if boundary not in measures:
            raise ValueError(f"boundary {boundary} has message shapes but no link measurement")
        for d in DIRECTIONS:
            specs = message_shapes[boundary].get(d, ())
            bandwidth = measures[boundary].bandwidth(d)
            full = message_bytes(specs, UNCOMPRESSED)
            f = float(fractions.get(d, 0.0))
            priced = []
            for setting in ladders[d]:
                nbytes = message_bytes(specs, setting)
                mean_bytes = nbytes if setting == UNCOMPRESSED else f * full + (1 - f) * nbytes
                priced.append((setting, nbytes, mean_bytes / bandwidth))
            out[(boundary, d)] = priced
    return out


def _per_message_rule(priced: Mapping[tuple[int, str], list[Priced]], budget: float) -> dict[tuple[int, str], int]:
    """Per boundary and direction, the least lossy candidate whose transfer fits the budget, else the fastest."""
    out = {}
    for key, options in priced.items():
        hiding = [i for i, p in enumerate(options) if p[2] <= budget]
        # min() keeps the first of equal times: the less lossy setting wins a tie
        out[key] = hiding[0] if hiding else min(range(len(options)), key=lambda i: options[i][2])
    return out


def _step_rule(priced: Mapping[tuple[int, str], list[Priced]], predict: Callable[[dict], float],
               tolerance: float) -> dict[tuple[int, str], int]:
    """The least lossy settings whose predicted step is at most ``1 + tolerance`` times the fastest one found.

    First the fastest: start from each direction's fastest transfer and, twice over every boundary and direction,
    take the candidate that makes the predicted step shortest (codec work can make a smaller message slower). Then
    move one rung towards less loss at a time, always the move that lengthens the predicted step the least (on a tie
    the lower boundary, forward first), while the step stays within the bound. The less lossy rungs of a ladder are
    assumed to send more bytes, as the default ladders do."""
    keys = list(priced)
    pick = {k: min(range(len(priced[k])), key=lambda i, k=k: priced[k][i][2]) for k in keys}
    for _ in range(2):
        for k in keys:
            times = [predict({**pick, k: i}) for i in range(len(priced[k]))]
            pick[k] = min(range(len(times)), key=times.__getitem__)
    bound = (1 + tolerance) * predict(pick)
    while True:  # one rung less lossy at a time, the move that costs the least step time first
        moves = [(predict({**pick, k: pick[k] - 1}), n, k) for n, k in enumerate(keys) if pick[k] > 0]
        allowed = [m for m in moves if m[0] <= bound]
        if not allowed:
            return pick
        _, _, k = min(allowed)
        pick[k] -= 1


def choose(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[str, Sequence[str]] | None = None,
    *,
    variant: str = "direct",
    headroom: float = DEFAULT_HEADROOM,
    full_fraction: float | Mapping[str, float] = 0.0,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    codec_s: CodecTimes | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[int, Choice]:
    """Pick each boundary's forward and backward setting (see the module docstring). Pure and deterministic.

    Args:
        measures: ``{boundary: LinkMeasure}``, forward = initiator to peer (as :func:`probe_boundaries` returns).
        compute_s_per_microbatch: forward+backward seconds per micro-batch, one number or one per stage (a
            sequence or ``{stage: seconds}``); the largest is the pipeline's cycle every boundary is held against.
        message_shapes: ``{boundary: {"fwd": specs, "bwd": specs}}``, the tensors of one micro-batch's message in
            each direction, a spec being ``(shape, dtype)`` or ``(shape, dtype, compressible)``.
        candidates: ``{"fwd": [...], "bwd": [...]}``, settings ordered from least to most lossy (default
            :data:`DEFAULT_CANDIDATES`; see :func:`ladder`).
        variant: the compressed variant to use where a boundary compresses (any of
            :data:`lightning_clapping.codecs.feedback.VARIANTS` but "uncompressed").
        headroom: with the per-message rule, a setting hides when its transfer takes at most ``headroom`` x the
            cycle (the ``hides`` flags report this test under both rules).
        full_fraction: share of the messages a compressed variant still sends in full precision (a number for both
            directions or ``{"fwd": x, "bwd": y}``): ``p`` for clapping-fu (its fresh steps), 0 for direct, ef21 and
            clapping-fc. A compressed setting is priced at ``f x uncompressed + (1 - f) x compressed``.
        schedule, num_microbatches: the step rule (see the module docstring): price whole steps of this schedule
            (a name of :data:`lightning_clapping.pipeline.schedule.SCHEDULES`) with the timing model, one stage per entry of
            ``compute_s_per_microbatch`` (a third of it forward, two thirds backward). None: the per-message rule.
        codec_s: ``{boundary: {direction: {setting: (sender_s, receiver_s)}}}``, the codec work of one message on
            each end (measured, see :func:`codec_times`); missing entries count as 0. Step rule only.
        tolerance: step rule: a less lossy setting is taken while the predicted step stays within ``1 + tolerance``
            times the fastest.

    Returns ``{boundary: Choice}`` for every boundary of ``message_shapes``.
    """
    if variant not in VARIANTS or variant == UNCOMPRESSED:
        raise ValueError(f"variant is the compressed variant to fall back on, one of "
                         f"{', '.join(v for v in VARIANTS if v != UNCOMPRESSED)}; got {variant!r}")
    if not (isinstance(headroom, (int, float)) and 0 < headroom < math.inf):
        raise ValueError(f"headroom must be a positive number, got {headroom!r}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    fractions = full_fraction if isinstance(full_fraction, Mapping) else dict.fromkeys(DIRECTIONS, full_fraction)
    for d in DIRECTIONS:
        if not 0 <= fractions.get(d, 0.0) <= 1:
            raise ValueError(f"full_fraction must lie in [0, 1], got {full_fraction!r}")
    ladders = {d: tuple((candidates or DEFAULT_CANDIDATES)[d]) for d in DIRECTIONS}
    for d, rungs in ladders.items():
        if not rungs:
            raise ValueError(f"no candidate settings for direction {d!r}")
        for setting in rungs:
            if setting != UNCOMPRESSED:
                get_codec(setting)  # raises for an unknown codec string
    stages = _stage_compute(compute_s_per_microbatch)
    compute = max(stages)
    budget = headroom * compute
    priced = _price(measures, message_shapes, ladders, fractions)

    step_s = None
    if schedule is None:
        pick = _per_message_rule(priced, budget)
    else:
        predict = _step_model(measures, stages, priced, schedule, num_microbatches, codec_s or {})
        pick = _step_rule(priced, predict, tolerance)
        step_s = predict(pick)

    out = {}
    for boundary in sorted(message_shapes):
        (fwd, fwd_bytes, fwd_s), (bwd, bwd_bytes, bwd_s) = (priced[(boundary, d)][pick[(boundary, d)]]
                                                            for d in DIRECTIONS)
        options = tuple((d, *p) for d in DIRECTIONS for p in priced[(boundary, d)])
        out[boundary] = Choice(
            boundary=boundary,
            variant=UNCOMPRESSED if fwd == bwd == UNCOMPRESSED else variant,
            forward=fwd, backward=bwd, forward_bytes=fwd_bytes, backward_bytes=bwd_bytes,
            forward_s=fwd_s, backward_s=bwd_s, compute_s=compute, budget_s=budget,
            forward_hides=fwd_s <= budget, backward_hides=bwd_s <= budget,
            step_s=step_s, schedule=schedule or "", options=options,
        )
    return out


def _step_model(measures: Mapping[int, LinkMeasure], stages: list[float],
                priced: Mapping[tuple[int, str], list[Priced]], schedule: str, num_microbatches: int | None,
                codec_s: CodecTimes) -> Callable[[dict], float]:
    """``predict(pick)``: the step time of ``schedule`` with the candidates ``pick`` ({(boundary, direction): index}),
    by :func:`lightning_clapping.pipeline.schedule.step_time`."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"the step rule needs num_microbatches >= 1, got {num_microbatches!r}")
    boundaries = sorted({b for b, _ in priced})
    if len(stages) == 1:
        stages = stages * (len(boundaries) + 1)
    if boundaries != list(range(len(stages) - 1)):
        raise ValueError(f"the step rule needs every boundary of {len(stages)} stages, got {boundaries}")
    actions = get_schedule(schedule)(len(stages), num_microbatches)
    forward = [c / 3 for c in stages]  # a backward takes about twice its forward
    backward = [2 * c / 3 for c in stages]

    def work(b: int, d: str, setting: str) -> tuple[float, float]:
        return tuple(codec_s.get(b, {}).get(d, {}).get(setting, (0.0, 0.0)))

    def predict(pick: Mapping[tuple[int, str], int]) -> float:
        links = []
        for b in boundaries:
            (fs, _, ft), (bs, _, bt) = priced[(b, "fwd")][pick[(b, "fwd")]], priced[(b, "bwd")][pick[(b, "bwd")]]
            links.append(Link(measures[b].one_way_delay_s, ft, bt, work(b, "fwd", fs), work(b, "bwd", bs)))
        return step_time(actions, forward, backward, links)

    return predict


def choose_pipeline(
    measures: Mapping[int, LinkMeasure],
    compute_s_per_microbatch: float | Sequence[float] | Mapping[int, float],
    message_shapes: MessageShapes,
    candidates: Mapping[str, Sequence[str]] | None = None,
    *,
    schedules: Sequence[str] = (),
    tolerance: float = DEFAULT_TOLERANCE,
    **choose_kwargs: Any,
) -> dict[int, Choice]:
    """:func:`choose` for each schedule of ``schedules`` (step rule); the first schedule's choice is kept unless
    another one's predicted step is more than ``tolerance`` shorter (then the shortest). Each Choice records its
    schedule. Without ``schedules``: :func:`choose` with ``choose_kwargs`` as given."""
    if not schedules:
        return choose(measures, compute_s_per_microbatch, message_shapes, candidates, tolerance=tolerance,
                      **choose_kwargs)
    best: dict[int, Choice] | None = None
    for name in schedules:
        choices = choose(measures, compute_s_per_microbatch, message_shapes, candidates, schedule=name,
                         tolerance=tolerance, **choose_kwargs)
        if best is None or _step_of(choices) * (1 + tolerance) < _step_of(best):  # type: ignore[operator]
            best = choices
    assert best is not None
    return best


def _step_of(choices: Mapping[int, Choice]) -> float | None:
    return next(iter(choices.values())).step_s if choices else None


def codec_times(specs: Sequence[TensorSpec], settings: Sequence[str],
                repeats: int = 3) -> dict[str, tuple[float, float]]:
    """``{setting: (sender seconds, receiver seconds)}`` of one message of ``specs`` under each codec setting,
    timed here on random values (the fastest of ``repeats``): the sender encodes and decodes (the error-feedback
    variants update their buffer with what the receiver will decode), the receiver decodes. "uncompressed" costs 0."""
    out: dict[str, tuple[float, float]] = {}
    tensors = []
    for spec in specs:
        shape, dtype, compressible = _spec(spec)
        if compressible:
            tensors.append(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    for setting in settings:
        if setting == UNCOMPRESSED or not tensors:
            out[setting] = (0.0, 0.0)
            continue
        codec = get_codec(setting)
        best_enc = best_dec = math.inf
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            payloads = [codec.encode(x) for x in tensors]
            t1 = time.perf_counter()
            for x, payload in zip(tensors, payloads):
                codec.decode(payload, x.shape, x.dtype)
            t2 = time.perf_counter()
            best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
        out[setting] = (best_enc + best_dec, best_dec)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Logging


def _uncompressed_s(choice: Choice, direction: str) -> float | None:
    for d, setting, _, seconds in choice.options:
        if d == direction and setting == UNCOMPRESSED:
            return seconds
    return None


def describe(choices: Mapping[int, Choice], measures: Mapping[int, LinkMeasure]) -> str:
    """A table for the log: per boundary the measured link, the compute it must hide behind, the choice and its
    predicted transfer time per micro-batch (and the uncompressed one, when it was a candidate)."""
    lines = ["autotune (per micro-batch; a setting hides when its transfer <= budget = headroom x compute):",
             f"{'boundary':>8}  {'delay ms':>8}  {'MB/s fwd':>9}  {'MB/s bwd':>9}  {'compute ms':>10}  "
             f"{'budget ms':>9}  {'forward':<26}  {'backward':<26}  variant"]
    for b in sorted(choices):
        c, m = choices[b], measures.get(b)

        def cell(direction: str) -> str:
            setting, seconds = c.setting(direction), c.forward_s if direction == "fwd" else c.backward_s
            hides = c.forward_hides if direction == "fwd" else c.backward_hides
            text = f"{setting} {seconds * 1e3:.2f} ms"
            full = _uncompressed_s(c, direction)
            if setting != UNCOMPRESSED and full is not None:
                text += f" (unc. {full * 1e3:.1f})"
            return text + ("" if hides else " !")

        delay = f"{m.one_way_delay_s * 1e3:8.2f}" if m else f"{'?':>8}"
        fwd_bw = f"{m.bandwidth('fwd') / 1e6:9.1f}" if m else f"{'?':>9}"
        bwd_bw = f"{m.bandwidth('bwd') / 1e6:9.1f}" if m else f"{'?':>9}"
        lines.append(f"{b:>8}  {delay}  {fwd_bw}  {bwd_bw}  {c.compute_s * 1e3:10.2f}  {c.budget_s * 1e3:9.2f}  "
                     f"{cell('fwd'):<26}  {cell('bwd'):<26}  {c.variant}")
    step = _step_of(choices)
    if step is None:
        if any(not (c.forward_hides and c.backward_hides) for c in choices.values()):
            lines.append("  ! no candidate hides behind compute in this direction: the fastest one was taken")
    else:
        lines.append(f"  predicted step with these settings under {next(iter(choices.values())).schedule}: "
                     f"{step * 1e3:.1f} ms (timing model; '!': the transfer alone exceeds the budget)")
    return "\n".join(lines)


def log_values(choices: Mapping[int, Choice], measures: Mapping[int, LinkMeasure]) -> dict[str, float]:
    """Flat numbers for a logger: ``autotune/b{m}_delay_ms``, ``_fwd_mb_s``, ``_bwd_mb_s``, ``_fwd_ms``,
    ``_bwd_ms`` (predicted transfer per micro-batch), ``_fwd_bytes``, ``_bwd_bytes`` and ``_compressed`` (0/1)."""
    out: dict[str, float] = {}
    for b, c in sorted(choices.items()):
        m = measures.get(b)
        if m is not None:
            out[f"autotune/b{b}_delay_ms"] = m.one_way_delay_s * 1e3
            out[f"autotune/b{b}_fwd_mb_s"] = m.bandwidth("fwd") / 1e6
            out[f"autotune/b{b}_bwd_mb_s"] = m.bandwidth("bwd") / 1e6
        out[f"autotune/b{b}_fwd_ms"] = c.forward_s * 1e3
        out[f"autotune/b{b}_bwd_ms"] = c.backward_s * 1e3
        out[f"autotune/b{b}_fwd_bytes"] = float(c.forward_bytes)
        out[f"autotune/b{b}_bwd_bytes"] = float(c.backward_bytes)
        out[f"autotune/b{b}_compressed"] = float(c.compressed)
    step = _step_of(choices)
    if step is not None:
        out["autotune/predicted_step_ms"] = step * 1e3
    return out


# --------------------------------------------------------------------------------------------------------------------
# Everything together, on every rank


def agree(
    stage: int,
    num_stages: int,
    measures: Mapping[int, LinkMeasure],
    compute_s: float,
    message_shapes: MessageShapes,
    *,
    group: Group = None,
    src: int = 0,
    codec_s: CodecTimes | None = None,
    **choose_kwargs: Any,
) -> tuple[dict[int, Choice], dict[int, LinkMeasure]]:
    """Decide on one rank and tell every rank: returns ``(choices, measures of every boundary)``, the same everywhere.

    Each rank passes what it knows: its stage, the measures :func:`probe_boundaries` returned, its own compute
    seconds per micro-batch and the message shapes it knows (e.g. ``{s: {"fwd": ...}, s - 1: {"bwd": ...}}`` for
    what it sends). Two collectives over ``group`` (all ranks must call): ``all_gather_object`` of these numbers,
    then ``broadcast_object_list`` of the choices that rank ``src`` computed with :func:`choose`
    (``choose_kwargs``: those of :func:`choose_pipeline`; ``codec_s``: the codec times this rank measured for the
    messages it sends, merged over the ranks and handed to the step rule). Raises :class:`ProbeError` on every rank when
    the two ends of a boundary report different measurements, and ValueError on every rank when ``choose`` refused
    its arguments on rank ``src``.
    """
    mine = {
        "stage": int(stage),
        "measures": {int(b): m.to_wire() for b, m in measures.items()},
        "compute_s": float(compute_s),
        "shapes": {int(b): {d: [_spec(s) for s in specs] for d, specs in dirs.items()}
                   for b, dirs in message_shapes.items()},
        "codec_s": {int(b): {d: dict(t) for d, t in dirs.items()} for b, dirs in (codec_s or {}).items()},
    }
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    wires: dict[int, list[float]] = {}
    compute: dict[int, float] = {}
    shapes: dict[int, dict[str, list]] = {}
    times: dict[int, dict[str, dict]] = {}
    for item in gathered:
        compute[item["stage"]] = item["compute_s"]
        for b, dirs in item["codec_s"].items():
            for d, t in dirs.items():
                times.setdefault(b, {})[d] = t
        for b, wire in item["measures"].items():
            if b in wires and not _same_wire(wires[b], wire):
                raise ProbeError(f"the two ends of boundary {b} measured different links: {wires[b]} and {wire}")
            wires[b] = wire
        for b, dirs in item["shapes"].items():
            for d, specs in dirs.items():
                shapes.setdefault(b, {})[d] = specs
    all_measures = {b: LinkMeasure.from_wire(w) for b, w in sorted(wires.items())}
    missing = [s for s in range(num_stages) if s not in compute]
    if missing:
        raise ValueError(f"stages {missing} did not report their compute time")
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            choices = choose_pipeline(all_measures, [compute[s] for s in range(num_stages)], shapes, codec_s=times,
                                      **choose_kwargs)
            payload = [("ok", [c.to_wire() for c in choices.values()])]
        except (ValueError, TypeError) as err:  # every rank raises it, instead of waiting for a broadcast
            payload = [("error", f"{type(err).__name__}: {err}")]
    dist.broadcast_object_list(payload, src=src, group=group)
    status, body = payload[0]
    if status != "ok":
        raise ValueError(f"autotune could not choose on rank {src}: {body}")
    return {w[0]: Choice.from_wire(w) for w in body}, all_measures


def _same_wire(a: list[float], b: list[float]) -> bool:
    """Equal measurement lists, NaN matching NaN (an unprobed reverse direction)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def tune_pipeline(
    stage: int,
    num_stages: int,
    rank_of_stage: Callable[[int], int],
    sent_specs: Mapping[str, Sequence[TensorSpec]],
    compute_s: float,
    variant: str,
    user_codecs: Mapping[str, Any],
    timeout: timedelta | None = None,
    group: Group = None,
    src: int = 0,
    schedules: Sequence[str] = (),
    num_microbatches: int | None = None,
) -> tuple[dict[int, Choice], dict[int, LinkMeasure]]:
    """What one pipeline rank does to autotune, between two steps (every rank at once): probe its boundaries with
    their real uncompressed message size, time the candidate codecs on the messages it sends, then :func:`agree`
    on the choices: by the step rule for ``schedules`` (the first is the one running; more: autotune may switch),
    with ``num_microbatches`` per step; without ``schedules``, by the per-message rule.

    ``sent_specs``: what this rank sent in the last step, by the executor's rule name (``"fwd_out"``: boundary
    ``stage``, ``"bwd_out"``: boundary ``stage - 1``); ``user_codecs``: the top of each direction's ladder
    (``{"fwd": "q4", "bwd": "q8"}``, None: the default ladder); ``group``: the ranks of this pipeline, and
    ``src`` the one (a global rank) that decides.
    """
    shapes: dict[int, dict[str, Sequence[TensorSpec]]] = {}
    if "fwd_out" in sent_specs:
        shapes[stage] = {"fwd": sent_specs["fwd_out"]}
    if "bwd_out" in sent_specs:
        shapes.setdefault(stage - 1, {})["bwd"] = sent_specs["bwd_out"]
    # the lower stage of a boundary sets its probe size: the boundary's uncompressed message of one micro-batch
    probe_bytes = {stage - 1: 0, stage: message_bytes(sent_specs["fwd_out"], UNCOMPRESSED)
                   if "fwd_out" in sent_specs else 0}
    measures = probe_boundaries(stage, num_stages, rank_of_stage, probe_bytes, timeout=timeout)
    candidates = {d: ladder(d, user_codecs.get(d)) for d in DIRECTIONS}
    timed = {b: {d: codec_times(specs, candidates[d]) for d, specs in dirs.items()} for b, dirs in shapes.items()}
    extra = {"schedules": tuple(schedules), "num_microbatches": num_microbatches} if schedules else {}
    return agree(stage, num_stages, measures, compute_s, shapes, variant=variant, candidates=candidates,
                 group=group, src=src, codec_s=timed, **extra)

