"""What every stage learns about a training step, without waiting on a collective for it.

* **Results.** Only the last stage computes the loss and the values the user logs. It packs them (with its batch
  fingerprint) into a few hundred bytes that travel back with the step's last gradient message, stage to stage
  (``PipelineExecutor(step_results=True)``): the pipeline sends those messages anyway, so the loss, ``self.log`` and
  the batch check reach every stage at the end of the same step with no round trip of their own.
* **Byte statistics.** Each stage knows only what it sent. The numbers are gathered with an asynchronous
  ``all_gather`` started at the end of a step and read at the end of the next one, so nothing waits for it: the
  ``clapping/...`` values logged at step ``t`` describe step ``t - 1`` (the first step logs none), all of them, so
  a logged row describes one step. :meth:`ByteStats.finish` completes the gather in flight (it only waits: every
  rank started it), after which :attr:`ByteStats.totals` holds the exact sums over every step so far. The sum of
  tied gradients (:mod:`lightning_clapping.comm.ties`) crosses the pipeline too: its bytes, which every stage can
  work out, are passed in as ``tied`` and added to ``bytes`` (and ``raw_bytes``), and shown as ``tied_bytes``.
  What each rank sends in its replicas' gradient average (:class:`~lightning_clapping.comm.replicas.
  GradientAverager`) is added to ``bytes`` and ``raw_bytes`` too, and shown as ``replica_bytes``: ``bytes`` is
  everything the replica's ranks send for a step. The numbers travel as a float64 tensor on the stage's device (``placement.device``): NCCL carries CUDA tensors
  only, so a CPU tensor here would fail the first step of a GPU run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping.comm import results_layout
from lightning_clapping.comm.placement import Placement
from lightning_clapping.comm.step_stats import StepStats


def pack_results(loss: float | None, logs: Any, fingerprint: tuple[int, ...] | None) -> bytes:
    """The step's results in the fixed layout of :mod:`~lightning_clapping.comm.results_layout` (no pickle); a
    logged value that the layout cannot carry is refused with its log key."""
    return results_layout.pack(loss, logs, fingerprint)


def unpack_results(blob: bytes) -> tuple[float | None, Any, tuple[int, ...] | None]:
    """(loss, log records, fingerprint) from :func:`pack_results`' bytes; anything malformed raises
    :class:`~lightning_clapping.comm.wire.WireError`."""
    return results_layout.unpack(blob)


def broadcast_results(blob: bytes | None, placement: Placement) -> bytes:
    """``blob`` (:func:`pack_results`' bytes, on the replica's last stage; None elsewhere) on every stage of the
    replica: its length, then its bytes, as tensors on the stage's device over ``pp_group`` (no pickle, legal
    under NCCL). Every stage of the pipeline must call it."""
    src, group, device = placement.last_rank, placement.pp_group, placement.device
    size = torch.tensor([0 if blob is None else len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if blob is not None
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(data, src=src, group=group)
    return blob if blob is not None else data.cpu().numpy().tobytes()


class ByteStats:
    """Per-step byte numbers of every stage of this rank's pipeline replica, gathered off the critical path (see the
    module docstring) over the placement's ``pp_group``."""

    def __init__(self, placement: Placement, lazy_messages: bool) -> None:
        self.placement = placement
        self.num_stages = placement.num_stages
        self.lazy_messages = lazy_messages
        self._pending: tuple[Any, list[torch.Tensor], dict[str, float], tuple[float, float] | None] | None = None
        self._ready: dict[str, float] = {}  # values of the last finished gather, not logged yet
        self.totals = {"bytes": 0.0, "raw_bytes": 0.0, "control_bytes": 0.0, "tied_bytes": 0.0, "replica_bytes": 0.0,
                       "crossing_raw_bytes": 0.0,
                       "skipped_messages": 0.0, "fresh_steps": 0.0, "steps": 0}

    def step(self, stats: StepStats, extra: dict[str, float],
             tied: tuple[float, float] | None = None) -> dict[str, float]:
        """Start gathering this step's numbers; return the previous step's values to log ({} at the first step).

        ``extra`` (numbers every rank knows, such as the lazy sampler's) is returned with its step's numbers, so a
        logged row always describes one step. ``tied``: (bytes sent, fp32 bytes) of this step's sum of tied
        gradients over the whole pipeline (``None``: the model has no tied tensors across stages)."""
        self.finish()
        previous, self._ready = self._ready, {}
        mine = torch.tensor(stats.as_list(), dtype=torch.float64, device=self.placement.device)
        if self.num_stages > 1:
            gathered = [torch.zeros_like(mine) for _ in range(self.num_stages)]
            work = dist.all_gather(gathered, mine, group=self.placement.pp_group, async_op=True)
            self._pending = (work, gathered, dict(extra), tied)
        else:
            self._pending = (None, [mine], dict(extra), tied)
        return previous

    def finish(self) -> None:
        """Wait for the gather in flight (if any; every rank has started it, so this only waits) and add it to
        :attr:`totals`; its values are logged at the next step."""
        if self._pending is None:
            return
        work, gathered, extra, tied = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        p = self.placement
        index = (lambda s: 0) if self.num_stages == 1 else \
            (lambda s: dist.get_group_rank(p.pp_group or dist.group.WORLD, p.rank_of_stage(s)))
        rows = torch.stack(gathered).tolist()  # one copy to the host, whatever the device
        per_stage = [StepStats.from_list(rows[index(s)]) for s in range(self.num_stages)]
        values = self._values(per_stage, tied)
        self.totals["bytes"] += values["clapping/bytes"]
        replica = sum(st.replica_bytes for st in per_stage)
        self.totals["raw_bytes"] += (sum(st.fwd_raw_bytes + st.bwd_raw_bytes for st in per_stage)
                                     + (tied or (0, 0))[1] + sum(st.replica_raw_bytes for st in per_stage))
        self.totals["tied_bytes"] += (tied or (0, 0))[0]
        self.totals["replica_bytes"] += replica
        self.totals["control_bytes"] += sum(st.control_bytes for st in per_stage)
        self.totals["crossing_raw_bytes"] += sum(st.crossing_raw_bytes for st in per_stage)
        self.totals["skipped_messages"] += sum(st.skipped for st in per_stage)
        self.totals["fresh_steps"] += extra.get("clapping/fresh", 1.0)
        self.totals["steps"] += 1
        self._ready = {**values, **extra}

    def add_replica_bytes(self, sent: float, raw: float) -> None:
        """Collective over the pipeline: replica-sync bytes sent after the last step (a local-update mode's last
        sync), summed over the stages into the totals."""
        self.finish()
        both = torch.tensor([sent, raw], dtype=torch.float64, device=self.placement.device)
        if self.num_stages > 1:
            dist.all_reduce(both, group=self.placement.pp_group)
        sent, raw = both.tolist()
        self.totals["bytes"] += sent
        self.totals["raw_bytes"] += raw
        self.totals["replica_bytes"] += sent

    def _values(self, per_stage: list[StepStats], tied: tuple[float, float] | None) -> dict[str, float]:
        values: dict[str, float] = {}
        for m in range(self.num_stages - 1):
            values[f"clapping/b{m}_fwd_bytes"] = per_stage[m].fwd_bytes  # stage m sends forward over boundary m
            values[f"clapping/b{m}_bwd_bytes"] = per_stage[m + 1].bwd_bytes  # stage m+1 sends backward over it
        sent = sum(st.fwd_bytes + st.bwd_bytes for st in per_stage)
        raw = sum(st.fwd_raw_bytes + st.bwd_raw_bytes for st in per_stage)
        if tied is not None:
            values["clapping/tied_bytes"] = tied[0]
            sent, raw = sent + tied[0], raw + tied[1]
        replica = sum(st.replica_bytes for st in per_stage)
        if replica:
            values["clapping/replica_bytes"] = replica
            sent, raw = sent + replica, raw + sum(st.replica_raw_bytes for st in per_stage)
        values["clapping/bytes"] = sent
        values["clapping/ratio"] = raw / sent if sent else 1.0
        for d in ("fwd", "bwd"):
            diff = sum(getattr(st, f"{d}_diff_sq") for st in per_stage)
            ref = sum(getattr(st, f"{d}_value_sq") for st in per_stage)
            if ref > 0:
                values[f"clapping/{d}_rel_diff"] = math.sqrt(diff / ref)
        values["clapping/feedback_bytes"] = sum(st.feedback_bytes for st in per_stage)
        crossing = sum(st.crossing_raw_bytes for st in per_stage)
        if crossing:
            values["clapping/crossing_raw_bytes"] = crossing
        if self.lazy_messages:
            values["clapping/skipped_messages"] = sum(st.skipped for st in per_stage)
        return values
