"""Measuring: timed probe messages give each boundary's delay and bandwidth, and the codecs are timed on its messages.

Links (:func:`probe_link`, :func:`probe_boundaries`). The two ranks of a boundary exchange timed probe messages: a
few small ping-pongs give the round-trip time (median), then bulk messages the bandwidth of each direction. The
initiator drives the probe with 64-byte control messages (what comes next, how many bytes); the peer follows them.
gloo moves a message only once its receive is posted, so each side posts a receive *before* it sends the message
that lets the other side send (gloo's "ready" notice then travels ahead of that message on the same connection), and
every time is taken on the initiator, on one clock:

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

Every operation of a probe is issued with ``batch_isend_irecv``, a receive together with the send that lets the other
side answer (the receive listed first, so gloo posts it first). Under NCCL this is what keeps a probe from
deadlocking: NCCL runs a communicator's operations one after another, so a lone receive issued before a lone send
would hold that send back until the peer answers a message it never got; a batch launches both at once. The
messages live on the probe's ``device``, by default the one the group's backend carries (the current CUDA device
under NCCL, else the CPU), and every wait on a CUDA device waits for the stream too, so that the clock stops when the
bytes have arrived, not when the operation was queued.

A rank belongs to two boundaries, so :func:`probe_boundaries` probes the even boundaries first, then the odd ones:
within one phase every rank talks to at most one neighbour, and the links of different pairs are measured at the
same time, as the pipeline uses them. Probes use tags from :data:`PROBE_TAG` up, far above the pipeline's
``purpose * 1_000_000 + slot * 2 + k``.

Codec work (:func:`codec_times`): each candidate codec encodes and decodes random tensors of the shapes of the
messages this rank sends, so that the timing model can add what the codecs cost to the step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping.autotune.messages import UNCOMPRESSED, TensorSpec, spec_of
from lightning_clapping.codecs import get_codec
from lightning_clapping.comm.safe_objects import group_device

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
    device: torch.device | str | None = None,
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
    ``device``: where the probe messages live (both ends pass the same kind; default: :func:`probe_device`).
    """
    link = _ProbeLink(peer, group, timeout, probe_device(group) if device is None else torch.device(device))
    if initiator:
        nbytes = min(max(int(nbytes), MIN_PROBE_BYTES), MAX_PROBE_BYTES)
        if not 1 <= pings <= _MAX_PINGS or not 1 <= min_repeats <= max_repeats:
            raise ValueError(f"pings in 1..{_MAX_PINGS} and 1 <= min_repeats <= max_repeats, got {pings}, "
                             f"{min_repeats}, {max_repeats}")
        return _probe_initiator(link, nbytes, pings, min_repeats, max_repeats, max_seconds, min_transfer_s,
                                both_directions)
    return _probe_peer(link)


def probe_device(group: Group = None) -> torch.device:
    """Where probe messages live by default: the current CUDA device when ``group``'s backend is NCCL (which carries
    CUDA tensors only), else the CPU (:func:`~lightning_clapping.comm.safe_objects.group_device`)."""
    return group_device(group)


def _control(command: int, device: torch.device, number: int = 0, values: Sequence[float] = ()) -> torch.Tensor:
    """A 64-byte control message: the command and a number as int64, then up to six float64 values."""
    words = torch.zeros(SMALL_BYTES // 8, dtype=torch.float64)
    words.view(torch.int64)[:2] = torch.tensor([command, number], dtype=torch.int64)
    if values:
        words[2 : 2 + len(values)] = torch.tensor(list(values), dtype=torch.float64)
    return words.view(torch.uint8).to(device)


class _ProbeLink:
    """Point-to-point messages of one probe, under the probe's tags, on its device."""

    def __init__(self, peer: int, group: Group, timeout: timedelta | None, device: torch.device) -> None:
        self.peer, self.group, self.timeout, self.device = peer, group, timeout, device

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def control(self, command: int, number: int = 0, values: Sequence[float] = ()) -> torch.Tensor:
        return _control(command, self.device, number, values)

    def post(self, recvs: Sequence[tuple[torch.Tensor, int]] = (),
             sends: Sequence[tuple[torch.Tensor, int]] = ()) -> list[Any]:
        """Issue ``recvs`` and ``sends`` (``(tensor, kind)``) as one batch, the receives first; returns its works."""
        ops = [dist.P2POp(dist.irecv, buf, self.peer, self.group, PROBE_TAG + kind) for buf, kind in recvs]
        ops += [dist.P2POp(dist.isend, msg, self.peer, self.group, PROBE_TAG + kind) for msg, kind in sends]
        return dist.batch_isend_irecv(ops)

    def wait(self, works: list[Any]) -> None:
        """Until every operation of a batch has completed (on a CUDA device: its bytes are there)."""
        for work in works:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def words(self, msg: torch.Tensor) -> tuple[int, int, list[float]]:
        """A control message's command, number and values."""
        host = msg.cpu()
        command, number = host.view(torch.int64)[:2].tolist()
        return command, number, host.view(torch.float64)[2:].tolist()


def _probe_initiator(link: _ProbeLink, nbytes: int, pings: int, min_repeats: int, max_repeats: int,
                     max_seconds: float, min_transfer_s: float, both: bool) -> LinkMeasure:
    start = time.perf_counter()
    reply = link.buffer(SMALL_BYTES)
    bulk = link.buffer(MAX_PROBE_BYTES)

    def exchange(msg: torch.Tensor, kind: int, answer: torch.Tensor, answer_kind: int) -> float:
        """Send ``msg`` under ``kind`` and time until ``answer`` arrived (its receive is posted first)."""
        t0 = time.perf_counter()
        link.wait(link.post([(answer, answer_kind)], [(msg, kind)]))
        return time.perf_counter() - t0

    # waits for the peer to arrive; warms the connection
    exchange(link.control(_HELLO, _MAGIC), _CTRL, reply, _REPLY)
    ping = link.control(_PING)
    rtts = [exchange(ping, _CTRL, reply, _REPLY) for _ in range(pings)]
    rtt = statistics.median(rtts)
    floor = min(rtts)  # taken off the bulk times: never more than their round trip, even when pings were delayed

    def to_peer(size: int) -> float:
        # the peer answers once it has posted the bulk receive: the bulk message then flows at once
        link.wait(link.post([(reply, _REPLY)], [(link.control(_TO_PEER, size), _CTRL)]))
        return exchange(bulk[:size], _BULK, reply, _REPLY)  # the peer answers once all of it has arrived

    def from_peer(size: int) -> float:
        ask = link.control(_FROM_PEER, size)
        return exchange(ask, _CTRL, bulk[:size], _BULK)  # receive posted before the ask

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
    link.wait(link.post(sends=[(link.control(_DONE, _VERSION, measure.to_wire()), _CTRL)]))
    return measure


def _probe_peer(link: _ProbeLink) -> LinkMeasure:
    """Follow the initiator's control messages; every receive is posted before (in the batch of) the message that
    lets the initiator send what it receives."""
    peer = link.peer
    ctrl = link.buffer(SMALL_BYTES)
    answer = link.buffer(SMALL_BYTES)
    bulk = link.buffer(0)
    works = link.post([(ctrl, _CTRL)])
    first = True
    while True:
        link.wait(works)
        command, number, values = link.words(ctrl)
        if first and (command, number) != (_HELLO, _MAGIC):
            raise ProbeError(f"rank {peer} did not start a link probe (got command {command}, {number:#x})")
        first = False
        if command in (_TO_PEER, _FROM_PEER) and not MIN_PROBE_BYTES <= number <= MAX_PROBE_BYTES:
            raise ProbeError(f"rank {peer} asked for a bulk transfer of {number} bytes, outside "
                             f"[{MIN_PROBE_BYTES}, {MAX_PROBE_BYTES}]")
        if command in (_TO_PEER, _FROM_PEER) and bulk.numel() != number:
            bulk = link.buffer(number)
        if command == _DONE:
            if number != _VERSION:
                raise ProbeError(f"rank {peer} runs link probe version {number}, this rank {_VERSION}")
            return LinkMeasure.from_wire(values)
        if command in (_HELLO, _PING):
            works = link.post([(ctrl, _CTRL)], [(answer, _REPLY)])
        elif command == _TO_PEER:
            link.wait(link.post([(bulk, _BULK)], [(answer, _REPLY)]))  # ready; then all of it has arrived
            works = link.post([(ctrl, _CTRL)], [(answer, _REPLY)])  # says so
        elif command == _FROM_PEER:
            works = link.post([(ctrl, _CTRL)], [(bulk, _BULK)])
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
    [:data:`MIN_PROBE_BYTES`, :data:`MAX_PROBE_BYTES`]. ``probe_kwargs`` go to :func:`probe_link` (``device=``: the
    stage's device, where the probe messages live). Returns
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


def codec_times(specs: Sequence[TensorSpec], settings: Sequence[str], repeats: int = 3,
                device: torch.device | str | None = None) -> dict[str, tuple[float, float]]:
    """``{setting: (sender seconds, receiver seconds)}`` of one message of ``specs`` under each codec setting,
    timed here on random values (the fastest of ``repeats``) on ``device`` (the stage's: a codec's cost on a GPU is
    not its cost on the CPU; default: the CPU): the sender encodes and decodes (the error-feedback variants update
    their buffer with what the receiver will decode), the receiver decodes. "uncompressed" costs 0. On a CUDA
    device every timing waits for the device to finish."""
    device = torch.device("cpu") if device is None else torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out: dict[str, tuple[float, float]] = {}
    tensors = []
    for spec in specs:
        shape, dtype, compressible = spec_of(spec)
        if compressible:
            values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            tensors.append(values.to(device=device, dtype=dtype))
    for setting in settings:
        if setting == UNCOMPRESSED or not tensors:
            out[setting] = (0.0, 0.0)
            continue
        codec = get_codec(setting)
        best_enc = best_dec = math.inf
        for _ in range(max(1, repeats)):
            sync()
            t0 = time.perf_counter()
            payloads = [codec.encode(x) for x in tensors]
            sync()
            t1 = time.perf_counter()
            for x, payload in zip(tensors, payloads):
                codec.decode(payload, x.shape, x.dtype)
            sync()
            t2 = time.perf_counter()
            best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
        out[setting] = (best_enc + best_dec, best_dec)
    return out
