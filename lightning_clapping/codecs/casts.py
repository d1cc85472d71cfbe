"""Lossless bytes (``identity``) and casts to narrower float types (``bf16``, ``fp16``, ``fp8``, ``fp8_e5m2``)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from lightning_clapping.codecs.base import BuiltinCodec, bytes_as, finite_peak, require_float
from lightning_clapping.codecs.registry import no_options

__all__ = ["CAST_NAMES", "CastCodec", "IdentityCodec"]

#: registry name -> torch dtype name; the fp8 types only where this torch has them
CAST_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


class IdentityCodec(BuiltinCodec):
    """The tensor's own bytes, any dtype (lossless; NaN and inf travel unchanged)."""

    name = "identity"
    lossless = True

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        out = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8, device=x.device)
        out.view(x.dtype).view(x.shape).copy_(x.detach())
        return out

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        out.view(-1).view(torch.uint8).copy_(payload)
        return out

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return math.prod(shape) * dtype.itemsize


class CastCodec(BuiltinCodec):
    """Sends the values cast to a narrower float type, saturating at its largest finite value.

    Values below the target's smallest subnormal flush to zero, as in any cast. Payload: the cast values' bytes.
    """

    def __init__(self, target: torch.dtype, name: str):
        self.target = target
        self.name = name
        self._max = torch.finfo(target).max

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        require_float(x, self)
        peak = finite_peak(x)
        flat = x.detach().reshape(-1)
        if peak > self._max:
            flat = flat.clamp(-self._max, self._max)
        cast = flat.to(self.target)
        if cast.data_ptr() == x.data_ptr():  # already of the target type: do not alias the caller's memory
            cast = cast.clone()
        return cast.view(torch.uint8)

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        if self.target == getattr(torch, "float8_e4m3fn", None):
            # torch converts this type one value at a time on the CPU; a 256-entry table lookup is ~4x faster
            table = torch.arange(256, dtype=torch.uint8, device=payload.device).view(self.target).to(out.dtype)
            torch.index_select(table, 0, payload.to(torch.int32), out=out.view(-1))
            return out
        return self._decode_strided(payload, out, seed)

    def _decode_strided(self, payload: Tensor, out: Tensor, seed: int) -> Tensor:
        return out.copy_(bytes_as(payload, self.target).view(out.shape))

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return math.prod(shape) * self.target.itemsize


def cast_factory(name: str):
    """The registry factory of the cast ``name`` (a key of :data:`CAST_NAMES`)."""
    target = getattr(torch, CAST_NAMES[name])
    return no_options(name, lambda: CastCodec(target, name))
