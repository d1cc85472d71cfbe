"""The codec contract (:class:`Codec`), the refusal of NaN and inf, and helpers the built-in codecs share.

A codec also checks what arrives for it (:meth:`Codec.check_received`): the wire
(:mod:`lightning_clapping.comm.wire`) sits below the codecs and knows the framing only, so it asks the codec whether
a payload is one the codec makes instead of knowing each codec's layout (top-k's indices are top-k's own check).
"""

from __future__ import annotations

import abc
import math
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["Codec", "NonFiniteError", "check_finite"]

#: what sizing or checking a payload from a peer may raise on nonsense (a shape whose size overflows, ...)
_CHECK_ERRORS = (RuntimeError, ValueError, IndexError, KeyError, TypeError, OverflowError, ZeroDivisionError)


class NonFiniteError(ValueError):
    """A lossy codec was asked to compress NaN or inf values."""


def check_finite(x: Tensor) -> None:
    """Raise :class:`NonFiniteError` if the floating tensor ``x`` holds a NaN or an infinite value.

    One pass over ``x`` (a fused min/max: both propagate NaN and reach inf); the counts in the message are computed
    only when it fails.
    """
    finite_peak(x)


def finite_peak(x: Tensor) -> float:
    """max |x| as a Python float (0 for an empty or non-floating tensor); raises NonFiniteError for NaN/inf."""
    if x.numel() == 0 or not x.is_floating_point():
        return 0.0
    lo, hi = torch.stack(torch.aminmax(x.detach().reshape(-1))).float().tolist()  # one device sync
    if math.isfinite(lo) and math.isfinite(hi):
        return max(hi, -lo)
    raise_non_finite(x)


def raise_non_finite(x: Tensor) -> None:
    """Raise :class:`NonFiniteError` describing the NaN and inf values of ``x`` (the caller found some)."""
    flat = x.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    if not bool(bad.any()):
        return
    nan = int(torch.isnan(flat).sum())
    pos = int((flat == math.inf).sum())
    neg = int((flat == -math.inf).sum())
    first = int(bad.nonzero()[0, 0])
    raise NonFiniteError(
        f"cannot compress a tensor with non-finite values: {nan} NaN, {pos} +inf, {neg} -inf among {flat.numel()} "
        f"values (shape {tuple(x.shape)}, {x.dtype}); the first is at flat index {first}"
    )


class Codec(abc.ABC):
    """Turns a tensor into a 1-D ``uint8`` payload and back.

    Contract, for every implementation:

    * ``encode(x, seed=s)`` returns a contiguous 1-D ``torch.uint8`` tensor on ``x``'s device that holds everything
      the receiver needs besides ``x.shape``, ``x.dtype`` and ``s``.
    * ``decode(payload, x.shape, x.dtype, seed=s)`` returns a tensor of that shape and dtype.
    * ``payload_nbytes(shape, dtype)`` is exactly ``encode(x).numel()`` for every ``x`` of that shape and dtype, so a
      receiver can post its receive before the message arrives.
    * Randomness comes only from ``seed`` (a ``torch.Generator`` seeded from it): the same call gives the same bytes.
    * ``check_received(payload, shape, dtype)`` raises ValueError, saying why, for a payload from a peer that this
      codec cannot have made; the default checks the dtype and the length, a codec whose decoder indexes with what
      it reads checks that too (see :meth:`check_received`).

    A user codec, registered in a few lines::

        class HalfCodec(Codec):
            name = "half"

            def encode(self, x, *, seed=0):
                return x.detach().to(torch.float16).reshape(-1).view(torch.uint8).clone()

            def decode(self, payload, shape, dtype, *, seed=0):
                return payload.view(torch.float16).to(dtype).reshape(shape)

            def payload_nbytes(self, shape, dtype):
                return 2 * math.prod(shape)

        register_codec("half", lambda options: HalfCodec())
        get_codec("half")
    """

    name: str = ""
    lossless: bool = False

    @abc.abstractmethod
    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        """Pack ``x`` into a 1-D contiguous ``torch.uint8`` tensor on ``x``'s device."""

    @abc.abstractmethod
    def decode(self, payload: Tensor, shape: torch.Size, dtype: torch.dtype, *, seed: int = 0) -> Tensor:
        """Rebuild a tensor of ``shape`` and ``dtype`` from ``payload`` (``seed`` as given to ``encode``)."""

    @abc.abstractmethod
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The exact length of ``encode(x)`` for any ``x`` of this shape and dtype."""

    def decode_into(self, payload: Tensor, out: Tensor, *, seed: int = 0) -> Tensor:
        """Decode into the preallocated tensor ``out`` (its shape and dtype are those sent) and return it.

        Saves the allocation of a fresh output, e.g. for a receive buffer reused every step. The built-in codecs
        write straight into a contiguous ``out``; this default decodes and copies.
        """
        return out.copy_(self.decode(payload, out.shape, out.dtype, seed=seed))

    def check_payload(self, payload: Tensor, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Raise ValueError unless ``payload`` is a 1-D uint8 tensor of the expected length; returns ``numel(shape)``."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"{self.name}: a payload is a 1-D torch.uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
        expected = self.payload_nbytes(shape, dtype)
        if payload.numel() != expected:
            raise ValueError(
                f"{self.name}: payload has {payload.numel()} bytes, expected {expected} for shape {tuple(shape)} {dtype}"
            )
        return math.prod(shape)

    def check_received(self, payload: Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                       indices: bool | None = None) -> None:
        """Raise ValueError, saying what is wrong, unless ``payload`` (from a peer) is what this codec makes of a
        tensor of ``shape`` and ``dtype``: a floating dtype, and exactly :meth:`payload_nbytes` bytes of 1-D uint8.

        ``indices``: also check the positions the decoder writes to, for a codec that reads them from the payload
        (None: where an index past the end would abort the process instead of raising, i.e. off the CPU). The wire
        calls this before it decodes (:func:`lightning_clapping.comm.wire.check_codec_payload`), and names the
        message in the error."""
        if not dtype.is_floating_point:
            raise ValueError("a codec payload stands for a floating tensor")
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"a payload is 1-D torch.uint8, got {payload.dtype} of shape {tuple(payload.shape)}")
        try:
            expected = self.payload_nbytes(shape, dtype)
        except _CHECK_ERRORS as err:
            raise ValueError(f"the codec cannot size it ({err})") from None
        if payload.numel() != expected:
            raise ValueError(f"{payload.numel()} bytes, the codec makes {expected}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class BuiltinCodec(Codec):
    """What the built-in codecs share: ``decode`` allocates the output and decodes into it, straight when it is
    contiguous (:meth:`_decode_contiguous`), else through :meth:`_decode_strided` (by default: decode, then copy)."""

    def decode(self, payload: Tensor, shape: torch.Size, dtype: torch.dtype, *, seed: int = 0) -> Tensor:
        return self.decode_into(payload, torch.empty(shape, dtype=dtype, device=payload.device), seed=seed)

    def decode_into(self, payload: Tensor, out: Tensor, *, seed: int = 0) -> Tensor:
        n = self.check_payload(payload, out.shape, out.dtype)
        if not out.is_contiguous():
            return self._decode_strided(payload, out, seed)
        return self._decode_contiguous(payload, out, n, seed)

    @abc.abstractmethod
    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        """Decode the checked ``payload`` into the contiguous ``out`` (``n`` values) and return ``out``."""

    def _decode_strided(self, payload: Tensor, out: Tensor, seed: int) -> Tensor:
        return super().decode_into(payload, out, seed=seed)

    def _empty_payload(self, x: Tensor) -> Tensor:
        return torch.empty(self.payload_nbytes(x.shape, x.dtype), dtype=torch.uint8, device=x.device)


def require_float(x: Tensor, codec: Codec) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{codec.name}: expects a floating tensor, got {x.dtype}")


def bytes_as(payload: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copying it first if its offset is not aligned for a view)."""
    try:
        return payload.view(dtype)
    except RuntimeError:
        return payload.clone().view(dtype)


def seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``seed`` (reduced to 64 bits)."""
    return torch.Generator(device=device).manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
