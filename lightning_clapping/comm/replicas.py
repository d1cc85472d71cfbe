"""Data parallel × pipeline: averaging a stage's gradients over its replicas (which rank runs which stage of which
replica is :mod:`lightning_clapping.comm.placement`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: gradients are all-reduced in buckets of about this many bytes (as DDP's default)
BUCKET_BYTES = 25 << 20


class GradientAverager:
    """Average a stage's gradients over its replicas: bucketed, asynchronous all-reduces.

    :meth:`start` launches them (right after the stage's last backward of a step, so they overlap the rest of the
    pipeline's drain); :meth:`finish` waits and writes the averages back into ``.grad``. Every replica must have
    gradients for the same parameters, as under DDP without ``find_unused_parameters``.

    ``comm_hook`` (``hook(state, bucket) -> Future``, the signature of PyTorch's DDP communication hooks, such as
    ``default_hooks.fp16_compress_hook`` or ``powerSGD_hook.powerSGD_hook``) replaces the plain all-reduce: it gets
    each bucket (``buffer()``, ``gradients()``, ``parameters()``, ``index()``, ``is_last()``) and returns a future
    of the averaged buffer. ``comm_state`` is the hook's state; ``None`` gives it ``group`` (what the fp16/bf16
    hooks take), and a state whose ``process_group`` is ``None`` (PowerSGD's default) gets ``group`` there, so the
    hook reduces over this stage's replicas and not over every rank.
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
        self._pending: list[tuple[Any, Tensor, list[Tensor]]] = []

    def start(self, params: list[torch.nn.Parameter]) -> None:
        if self._pending:
            raise RuntimeError("GradientAverager.start() called twice without finish()")
        params = [p for p in params if p.grad is not None]
        buckets = _buckets([p.grad for p in params], self.bucket_bytes)
        first = 0
        for index, grads in enumerate(buckets):
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.comm_hook is None:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            else:
                bucket = _Bucket(index, flat, grads, params[first:first + len(grads)], index == len(buckets) - 1)
                work = self.comm_hook(self.comm_state, bucket)
            first += len(grads)
            self._pending.append((work, flat, grads))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, flat, grads in pending:
            if self.comm_hook is None:
                work.wait()
                flat.div_(self.replicas)
            else:  # a hook's future holds the averaged buffer
                value = work.wait()
                flat = value[0] if isinstance(value, (list, tuple)) else value
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)


class _Bucket:
    """What a DDP communication hook reads of a bucket (the methods of ``torch.distributed.GradBucket``)."""

    def __init__(self, index: int, flat: Tensor, grads: list[Tensor], params: list[Tensor], last: bool) -> None:
        self._index, self._flat, self._params, self._last = index, flat, params, last
        views, offset = [], 0
        for g in grads:
            views.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
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
