"""The low-rank codec ``lowrank:<R>``: a message as two thin factors whose product approximates it.

A message of shape ``[..., C]`` is read as a matrix ``M`` of ``N = numel / C`` rows and ``C`` columns (one row per
token or sample, one column per channel). The sender finds an orthonormal basis ``P`` (``N x r``) of ``M``'s
dominant column space with a seeded randomized range finder (``M @ Omega``, ``Omega`` Gaussian from the message's
seed, then ``iterations`` power steps, each orthonormalized by a QR factorization) and sends ``P`` and
``Q = M^T P`` (``C x r``); the receiver rebuilds ``P Q^T``, the projection of ``M`` onto that basis. ``r`` is
``min(R, N, C)``.

Biased, as any truncation is: on its own it loses what lies outside the basis. Under error feedback
(``ef21``, ``clapping-fc``, ``clapping-fu``) the part not sent stays in the difference and is sent in later steps,
which suits lazy sampling: while a batch is reused the difference changes little from one step to the next, so
the next step's basis finds what the last one left out. This is PowerSGD's idea applied to the messages between
stages rather than to gradients between replicas.

Payload: ``r`` float32 scales (one per column of ``Q``, its max-abs), then ``P`` as fp16 (orthonormal columns: every
value in ``[-1, 1]``), then ``Q`` divided by its scales as fp16. ``2 r (N + C) + 4 r`` bytes, against ``4 N C`` for
float32: ``lowrank:8`` on a ``[512, 128]`` message is 25.5x smaller.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch
from torch import Tensor

from lightning_clapping.codecs.base import BuiltinCodec, bytes_as, finite_peak, require_float, seeded

__all__ = ["LowRankCodec", "lowrank_factory"]


def _matrix(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of the matrix a message of ``shape`` is read as."""
    n = math.prod(shape)
    cols = int(shape[-1]) if len(shape) >= 1 and shape[-1] > 0 else 1
    return (n // cols if cols else 0), cols


class LowRankCodec(BuiltinCodec):
    """``lowrank:<R>[:it<k>]``: rank-``R`` factors of the message (see the module docstring); ``k`` power steps
    (default 1)."""

    def __init__(self, rank: int, iterations: int = 1):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lowrank needs a positive integer rank, got {rank!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or not 0 <= iterations <= 8:
            raise ValueError(f"lowrank power steps must be an integer in 0..8, got {iterations!r}")
        self.rank, self.iterations = rank, iterations
        self.name = f"lowrank:{rank}" + (f":it{iterations}" if iterations != 1 else "")

    def _rank(self, shape: Sequence[int]) -> int:
        rows, cols = _matrix(shape)
        return min(self.rank, rows, cols)

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows, cols = _matrix(shape)
        r = self._rank(shape)
        return 4 * r + 2 * r * (rows + cols)

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        require_float(x, self)
        finite_peak(x)  # refuses NaN and inf
        out = self._empty_payload(x)
        rows, cols = _matrix(x.shape)
        r = self._rank(x.shape)
        if r == 0:
            return out
        m = x.detach().reshape(rows, cols).float()
        omega = torch.randn(cols, r, generator=seeded(seed), dtype=torch.float32).to(m.device)
        p = torch.linalg.qr(m @ omega).Q
        for _ in range(self.iterations):
            p = torch.linalg.qr(m @ (m.T @ p)).Q
        q = m.T @ p
        scales = q.abs().amax(dim=0)
        q = q / torch.where(scales > 0, scales, torch.ones_like(scales))
        out[: 4 * r].view(torch.float32).copy_(scales)
        out[4 * r : 4 * r + 2 * r * rows].view(torch.float16).copy_(p.reshape(-1))
        out[4 * r + 2 * r * rows :].view(torch.float16).copy_(q.reshape(-1))
        return out

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        rows, cols = _matrix(out.shape)
        r = self._rank(out.shape)
        if r == 0:
            return out.zero_()
        scales = bytes_as(payload[: 4 * r], torch.float32)
        p = bytes_as(payload[4 * r : 4 * r + 2 * r * rows], torch.float16).float().view(rows, r)
        q = bytes_as(payload[4 * r + 2 * r * rows :], torch.float16).float().view(cols, r) * scales
        out.view(rows, cols).copy_(p @ q.T)
        return out


_OPTIONS = re.compile(r"^(\d+)(?::it(\d+))?$")


def lowrank_factory(options: str | None) -> LowRankCodec:
    """``lowrank:<R>[:it<k>]``."""
    match = _OPTIONS.match(options or "")
    if not match:
        raise ValueError(f"lowrank codec spells lowrank:<rank>[:it<power steps>], e.g. lowrank:8, got "
                         f"'lowrank:{options or ''}'")
    return LowRankCodec(int(match.group(1)), 1 if match.group(2) is None else int(match.group(2)))
