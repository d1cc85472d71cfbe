"""Data parallel × pipeline: averaging a stage's gradients over its replicas (which rank runs which stage of which
replica is :mod:`lightning_clapping.comm.placement`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: gradients are all-reduced in buckets of about this many bytes (as DDP's default)
BUCKET_BYTES = 25 << 20


def ring_share(replicas: int) -> float:
    """What each rank sends in a ring all-reduce, per byte of the buffer: ``2 (R - 1) / R``."""
    return 2 * (replicas - 1) / replicas


def flat_of(tensors: list[Tensor]) -> Tensor:
    """The tensors' values, one after the other, in one 1-D tensor (a buffer for one collective)."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: Tensor, outs: list[Tensor]) -> None:
    """Copy ``flat``'s values back into ``outs`` in order (the inverse of :func:`flat_of`)."""
    offset = 0
    for t in outs:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class GradientAverager:
    """Average a stage's gradients over its replicas: bucketed, asynchronous all-reduces.

    :meth:`start` launches them (right after the stage's last backward of a step, so they overlap the rest of the
    pipeline's drain); :meth:`finish` waits and writes the averages back into ``.grad``.

    The replicas may differ in which parameters got a gradient (a branch that only some batches take, experts that
    only some tokens reach), as under DDP with ``find_unused_parameters=True``: :meth:`start` takes every trainable
    parameter of the stage, in the same order on every replica, and sends zeros for a missing gradient, with one
    presence flag per parameter (1 or 0, at the end of the last bucket: no collective of their own). After the
    reduce, a parameter that no replica had a gradient for keeps ``.grad = None``; every other one gets the sum over
    the replicas divided by their number (a missing gradient counts as zeros), on every replica alike. Only when
    this replica lacks a gradient does :meth:`finish` read the averaged flags on the host: a parameter counts as
    present where they are above half of ``1 / replicas``.

    ``comm_hook`` (``hook(state, bucket) -> Future``, the signature of PyTorch's DDP communication hooks, such as
    ``default_hooks.fp16_compress_hook`` or ``powerSGD_hook.powerSGD_hook``) replaces the plain all-reduce: it gets
    each bucket (``buffer()``, ``gradients()``, ``parameters()``, ``index()``, ``is_last()``) and returns a future
    of the averaged buffer. The last bucket's ``gradients()`` end with the presence flags, a 1-D tensor with no
    entry in ``parameters()``; the compressing hooks keep them apart from zero well enough (fp16 and bf16 casts,
    PowerSGD, which sends 1-D tensors uncompressed). Under gloo the buckets go through the hook one after the other.
    ``comm_state`` is the hook's state; ``None`` gives it ``group`` (what the fp16/bf16 hooks take), and a state
    whose ``process_group`` is ``None`` (PowerSGD's default) gets ``group`` there, so the hook reduces over this
    stage's replicas and not over every rank.

    **Bytes.** :attr:`sent_bytes` is what this rank sends in the last :meth:`start`'s average: a ring all-reduce (the
    algorithm gloo and NCCL use for buffers of this size) sends ``2 (R - 1) / R`` times a bucket's bytes from every
    rank of ``R`` replicas, flags included; :attr:`raw_bytes` the same in fp32. With a ``comm_hook`` both stay 0: the
    hook decides what it sends, which this class does not see (:attr:`counted` is then False).
    """

    def __init__(self, group: Any, replicas: int, bucket_bytes: int = BUCKET_BYTES, comm_hook: Any = None,
                 comm_state: Any = None) -> None:
        self.group = group
        self.replicas = replicas
        self.bucket_bytes = bucket_bytes
        self.comm_hook = comm_hook
        if comm_hook is not None and comm_state is None:
            comm_state = group
        elif comm_state is not None and getattr(comm_state, "process_group", False) is None:
            comm_state.process_group = group
        self.comm_state = comm_state
        self._pending: list[tuple[Any, Tensor, list[Tensor], _Bucket | None]] = []
        self._params: list[torch.nn.Parameter] = []
        self._complete = True  # whether this replica had every gradient (then every flag is set: nothing to read)
        self.sent_bytes = self.raw_bytes = 0.0
        self.counted = comm_hook is None

    def start(self, params: list[torch.nn.Parameter]) -> None:
        """``params``: every trainable parameter of the stage, in the same order on every replica (those without a
        gradient included)."""
        if self._pending:
            raise RuntimeError("GradientAverager.start() called twice without finish()")
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        present = [p.grad is not None for p in params]
        self._params, self._complete = list(params), all(present)
        buckets = _buckets(grads, self.bucket_bytes)
        flags = torch.tensor(present, dtype=grads[-1].dtype, device=grads[-1].device)  # the last bucket's dtype
        # under gloo a hook's buckets go one after the other: a hook that issues collectives from its futures'
        # callbacks (PowerSGD) would issue them in a different order on each replica (gloo completes futures on its
        # worker threads) and deadlock; the first overlaps the pipeline's drain, the others run in finish()
        serial = self.comm_hook is not None and dist.get_backend(self.group) == "gloo"
        first, self.sent_bytes, self.raw_bytes = 0, 0.0, 0.0
        for index, bucket_grads in enumerate(buckets):
            last = index == len(buckets) - 1
            flat = flat_of(bucket_grads + ([flags] if last else []))
            if self.counted:
                share = ring_share(self.replicas) * flat.numel()
                self.sent_bytes += share * flat.element_size()
                self.raw_bytes += share * (4 if flat.is_floating_point() else flat.element_size())  # fp32, as raw
            work, bucket = None, None
            if self.comm_hook is None:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            else:  # the flags are one more 1-D gradient of the last bucket, with no parameter of their own
                shapes = [g.shape for g in bucket_grads] + ([flags.shape] if last else [])
                bucket = _Bucket(index, flat, shapes, params[first:first + len(bucket_grads)], last)
                if index == 0 or not serial:
                    work = self.comm_hook(self.comm_state, bucket)
            first += len(bucket_grads)
            self._pending.append((work, flat, bucket_grads, bucket))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        for work, flat, grads, bucket in pending:
            if work is None:  # a hook's bucket under gloo, after the previous one finished
                work = self.comm_hook(self.comm_state, bucket)
            if self.comm_hook is None:
                work.wait()
                flat.div_(self.replicas)
            else:  # a hook's future holds the averaged buffer
                value = work.wait()
                flat = value[0] if isinstance(value, (list, tuple)) else value
            unflatten_into(flat, grads)  # the last bucket's flags stay at its end
        params, self._params = self._params, []
        if self._complete:
            return  # this replica's flags are all set, so every parameter keeps its (averaged) gradient
        seen = (flat[-len(params):].float() * self.replicas > 0.5).tolist()  # the last bucket's flags
        for p, g, any_replica in zip(params, (g for _, _, grads, _ in pending for g in grads), seen):
            if not any_replica:
                p.grad = None
            elif p.grad is None:
                p.grad = g  # the zeros sent for it, now holding the replicas' average

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)


class _Bucket:
    """What a DDP communication hook reads of a bucket (the methods of ``torch.distributed.GradBucket``)."""

    def __init__(self, index: int, flat: Tensor, shapes: list[torch.Size], params: list[Tensor], last: bool) -> None:
        self._index, self._flat, self._params, self._last = index, flat, params, last
        views, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            views.append(flat[offset:offset + n].view(shape))
            offset += n
        self._views = views

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._flat

    def gradients(self) -> list[Tensor]:
        return self._views

    def parameters(self) -> list[Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: Tensor) -> None:
        self._flat.copy_(buffer)


def _buckets(grads: list[Tensor], limit: int) -> list[list[Tensor]]:
    """Consecutive runs of gradients with the same dtype and device, each up to ``limit`` bytes (at least one)."""
    out: list[list[Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != g.dtype or last[0].device != g.device or size + nbytes > limit:
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out
