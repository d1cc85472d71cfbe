"""Codecs: how one tensor becomes the bytes that cross a pipeline boundary, and how it comes back.

A codec turns a floating tensor into a packed 1-D ``torch.uint8`` *payload* and decodes it on the receiving stage
from the payload, the shape, the dtype and the seed both sides share. The channel sends exactly these bytes, so a
4-bit quantizer really puts half a byte per value on the wire (plus its float32 scales), never floats.

Built-in codecs, by the string :func:`get_codec` accepts (``codec.name`` gives the string back):

=====================  ===============================================================================================
``identity``           the tensor's own bytes; lossless, any dtype
``bf16``, ``fp16``     casts; ``fp8`` (float8_e4m3fn) and ``fp8_e5m2`` where torch has them. Casts **saturate**:
                       a value beyond the target's largest finite value is sent as that value, never as inf/NaN.
``q<b>``               b-bit symmetric uniform quantizer, b in 1..8, one float32 scale per channel (the last
                       dimension; tensors with fewer than two dimensions get one scale)
``q<b>:tensor``        one scale for the whole tensor
``q<b>:group<G>``      one scale per G consecutive values in flattened order (the last group may be shorter)
``q<b>:...:sr``        stochastic rounding (unbiased) instead of round-to-nearest, e.g. ``q2:group64:sr``
``topk:<r>``           the ceil(r*n) largest magnitudes: fp16 values + indices packed in ceil(log2 n) bits each
``randk:<r>``          ceil(r*n) positions drawn from the shared seed: fp16 values only, no indices, no rescaling
=====================  ===============================================================================================

The quantizer (b >= 2) uses the levels ``k*s/L`` for integers ``k`` in ``[-L, L]``, ``L = 2**(b-1) - 1``, with ``s`` the
max-abs of the values sharing the scale: zero is a level, round-to-nearest errs by at most ``s/(2L)``, and a
constant tensor comes back exactly. Codes are offset to ``k + L`` (unsigned) and bit-packed densely: ``n`` values take
``ceil(n*b/8)`` bytes. With ``b == 1`` a value is sent as its sign (zero counts as positive) times the scale; the
scale is the mean of ``|x|`` (the L2-best scale for a sign pattern), or the max-abs under ``:sr`` so that the
stochastic sign stays unbiased.

Every lossy codec refuses NaN and inf with :class:`NonFiniteError` (see :func:`check_finite`); ``identity`` carries
them bit-exactly. Payloads and decoded tensors never share memory with the caller's tensors; ``decode_into`` writes
into a buffer the caller reuses (no fresh allocation per message).

Everything runs in eager PyTorch, no compiler needed; ``benchmarks/codec_speed.py`` measures each codec against a
plain memory copy. A first ``torch.compile`` of the quantizer's steps (dynamic shapes) ran slower than this eager code
on the project's CPU, so there is no compiled path.

Writing a codec takes a few lines: subclass :class:`Codec` and register a factory (see its docstring). The bit
packing the quantizer and top-k use lives in :mod:`lightning_clapping.bitpack` (``pack_bits``, ``unpack_bits`` and
``packed_nbytes`` are re-exported here).
"""

from __future__ import annotations

import abc
import math
import re
from fractions import Fraction
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from lightning_clapping.bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = [
    "CastCodec", "Codec", "IdentityCodec", "NonFiniteError", "QuantCodec", "RandKCodec", "TopKCodec",
    "available_codecs", "check_finite", "compression_ratio", "get_codec", "pack_bits", "packed_nbytes",
    "register_codec", "unpack_bits",
]

# Values per step of the quantizer's element-wise loops: the float32 temporaries (2 MB) stay in the CPU caches, and
# Python's per-operation overhead stays small next to the work. The payload layout does not depend on it.
_CHUNK = 1 << 19


# --------------------------------------------------------------------------------------------------------------------
# Non-finite input


class NonFiniteError(ValueError):
    """A lossy codec was asked to compress NaN or inf values."""


def check_finite(x: Tensor) -> None:
    """Raise :class:`NonFiniteError` if the floating tensor ``x`` holds a NaN or an infinite value.

    The check costs two reductions (max and min propagate NaN and reach inf), so it is cheap enough to run on every
    message; the counts in the message are computed only when it fails.
    """
    _finite_peak(x)


def _finite_peak(x: Tensor) -> float:
    """max |x| as a Python float (0 for an empty tensor); raises NonFiniteError for NaN/inf."""
    if x.numel() == 0 or not x.is_floating_point():
        return 0.0
    x = x.detach()
    lo, hi = torch.stack([x.amin(), x.amax()]).float().tolist()
    if math.isfinite(lo) and math.isfinite(hi):
        return max(hi, -lo)
    flat = x.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    nan = int(torch.isnan(flat).sum())
    pos = int((flat == math.inf).sum())
    neg = int((flat == -math.inf).sum())
    first = int(bad.nonzero()[0, 0])
    raise NonFiniteError(
        f"cannot compress a tensor with non-finite values: {nan} NaN, {pos} +inf, {neg} -inf among {flat.numel()} "
        f"values (shape {tuple(x.shape)}, {x.dtype}); the first is at flat index {first}"
    )


# --------------------------------------------------------------------------------------------------------------------
# The base class


class Codec(abc.ABC):
    """Turns a tensor into a 1-D ``uint8`` payload and back.

    Contract, for every implementation:

    * ``encode(x, seed=s)`` returns a contiguous 1-D ``torch.uint8`` tensor on ``x``'s device that holds everything
      the receiver needs besides ``x.shape``, ``x.dtype`` and ``s``.
    * ``decode(payload, x.shape, x.dtype, seed=s)`` returns a tensor of that shape and dtype.
    * ``payload_nbytes(shape, dtype)`` is exactly ``encode(x).numel()`` for every ``x`` of that shape and dtype, so a
      receiver can post its receive before the message arrives.
    * Randomness comes only from ``seed`` (a ``torch.Generator`` seeded from it): the same call gives the same bytes.

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _require_float(x: Tensor, codec: Codec) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{codec.name}: expects a floating tensor, got {x.dtype}")


def _bytes_as(payload: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copying it first if its offset is not aligned for a view)."""
    try:
        return payload.view(dtype)
    except RuntimeError:
        return payload.clone().view(dtype)


def _seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def _finite_flat(x: Tensor, codec: Codec) -> Tensor:
    """``x`` flattened (detached) after checking it is a floating tensor without NaN or inf."""
    _require_float(x, codec)
    check_finite(x)
    return x.detach().reshape(-1)


def _fp16_saturated(values: Tensor) -> Tensor:
    return values.clamp(-65504.0, 65504.0).to(torch.float16)


class _BuiltinCodec(Codec):
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


# --------------------------------------------------------------------------------------------------------------------
# Lossless and casts


class IdentityCodec(_BuiltinCodec):
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


class CastCodec(_BuiltinCodec):
    """Sends the values cast to a narrower float type, saturating at its largest finite value.

    Values below the target's smallest subnormal flush to zero, as in any cast. Payload: the cast values' bytes.
    """

    def __init__(self, target: torch.dtype, name: str):
        self.target = target
        self.name = name
        self._max = torch.finfo(target).max

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        _require_float(x, self)
        peak = _finite_peak(x)
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
        return out.copy_(_bytes_as(payload, self.target).view(out.shape))

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return math.prod(shape) * self.target.itemsize


# --------------------------------------------------------------------------------------------------------------------
# The quantizer


class _Block(NamedTuple):
    """``flat[start : start + rows*cols].view(rows, cols)``; its scales start at ``first_scale``, one per column
    (``per_column``) or one per row."""

    start: int
    rows: int
    cols: int
    first_scale: int
    per_column: bool

    def chunks(self):
        """(flat start, rows, cols, first row) pieces of about ``_CHUNK`` values, in flat order."""
        if self.rows == 1:
            for a in range(0, self.cols, _CHUNK):
                yield self.start + a, 1, min(_CHUNK, self.cols - a), 0
            return
        step = max(1, _CHUNK // self.cols)
        for r in range(0, self.rows, step):
            yield self.start + r * self.cols, min(step, self.rows - r), self.cols, r

    def largest_chunk(self) -> int:
        if self.rows == 1:
            return min(_CHUNK, self.cols)
        return min(self.rows, max(1, _CHUNK // self.cols)) * self.cols

    def scales_for(self, scales: Tensor, first_row: int, rows: int) -> Tensor:
        """The part of ``scales`` that broadcasts against rows ``[first_row, first_row + rows)`` of the block."""
        if self.per_column:
            return scales[self.first_scale : self.first_scale + self.cols]
        first = self.first_scale + first_row
        return scales[first : first + rows].view(rows, 1)


class QuantCodec(_BuiltinCodec):
    """Symmetric uniform ``bits``-bit quantizer with float32 scales (per channel, per tensor or per group).

    ``scale`` is ``"channel"`` (one scale per index of the last dimension, the max-abs over all other elements, as
    AQ-SGD scales each hidden channel; tensors with fewer than two dimensions get one scale), ``"tensor"`` or
    ``"group"`` (one scale per ``group_size`` consecutive values of the flattened tensor). ``stochastic`` rounds up
    with probability equal to the fractional position between the two nearest levels, so the decoded value is
    unbiased (up to float32 rounding of that position).

    Payload: ``[float32 scales][codes packed by pack_bits]``; an empty tensor has an empty payload. Tiny and
    subnormal scales keep the full grid (codes are then computed in float64); decoded values round to float32's
    subnormal spacing, ``2**-149``.
    """

    def __init__(self, bits: int, scale: str = "channel", group_size: int | None = None, stochastic: bool = False):
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"quantizer bits must be an integer in 1..8, got {bits!r}")
        if scale not in ("channel", "tensor", "group"):
            raise ValueError(f"quantizer scale must be 'channel', 'tensor' or 'group', got {scale!r}")
        if scale == "group" and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group scaling needs a positive integer group size, got {group_size!r}")
        self.bits, self.scale, self.stochastic = bits, scale, stochastic
        self.group_size = group_size if scale == "group" else None
        self.levels = 2 ** (bits - 1) - 1 if bits >= 2 else 1  # L: the grid is k*s/L for k in [-L, L]
        # Codes are unsigned: c = k + L in [0, 2L] for bits >= 2; c = (sign + 1)/2 in {0, 1} for one bit.
        self.top_code = 2 * self.levels if bits >= 2 else 1
        options = {"channel": "", "tensor": ":tensor", "group": f":group{group_size}"}[scale]
        self.name = f"q{bits}{options}{':sr' if stochastic else ''}"

    def _layout(self, shape: Sequence[int]) -> tuple[int, list[_Block]]:
        n = math.prod(shape)
        if n == 0:
            return 0, []
        if self.scale == "channel" and len(shape) >= 2:
            cols = shape[-1]
            return cols, [_Block(0, n // cols, cols, 0, True)]
        if self.scale == "group":
            size = self.group_size
            full, tail = divmod(n, size)
            blocks = [_Block(0, full, size, 0, False)] if full else []
            if tail:
                blocks.append(_Block(full * size, 1, tail, full, False))
            return full + (1 if tail else 0), blocks
        return 1, [_Block(0, 1, n, 0, False)]

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        n_scales, _ = self._layout(shape)
        return 4 * n_scales + packed_nbytes(math.prod(shape), self.bits)

    # -- encode --------------------------------------------------------------------------------------------------
    # Element-wise work runs chunk by chunk (see _CHUNK) in float32 scratch that stays in cache. Per-row scales are
    # applied with at most one broadcast operand per operation: torch vectorizes only that case.

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        _require_float(x, self)
        n_scales, blocks = self._layout(x.shape)
        payload = self._empty_payload(x)
        if not blocks:
            return payload
        flat = x.detach().reshape(-1)
        mean = self.bits == 1 and not self.stochastic
        if mean:
            check_finite(flat)  # a mean hides which value was bad: check the input itself
        scales = self._scales(flat, blocks, n_scales, mean)
        if not bool(torch.isfinite(scales).all()):  # max-abs is NaN or inf exactly when an input value is
            check_finite(flat)  # raises NonFiniteError with the details
            scales = self._scales(flat.double(), blocks, n_scales, mean)  # a float32 sum of |x| overflowed
        payload[: 4 * n_scales].view(torch.float32).copy_(scales)
        pack_bits(self._codes(flat, blocks, scales, seed), self.bits, out=payload[4 * n_scales :])
        return payload

    @staticmethod
    def _scales(flat: Tensor, blocks: list[_Block], n_scales: int, mean: bool) -> Tensor:
        """max |x| (or mean |x|) over the values sharing each scale, as float32."""
        scales = torch.empty(n_scales, dtype=torch.float32, device=flat.device)
        scratch = torch.empty(max(b.largest_chunk() for b in blocks), dtype=flat.dtype, device=flat.device)
        accumulate = torch.float64 if flat.dtype == torch.float64 else torch.float32
        for block in blocks:
            dim, partial = 0 if block.per_column else 1, []
            for start, rows, cols, _ in block.chunks():
                magnitude = scratch[: rows * cols].view(rows, cols)
                torch.abs(flat[start : start + rows * cols].view(rows, cols), out=magnitude)
                partial.append(magnitude.sum(dim, dtype=accumulate) if mean else magnitude.amax(dim))
            if block.per_column:
                s = torch.stack(partial).sum(0) if mean else torch.stack(partial).amax(0)
            else:
                s = torch.cat(partial)
                if block.rows == 1:
                    s = s.sum().view(1) if mean else s.amax().view(1)
            if mean:
                s = s / (block.rows if block.per_column else block.cols)
            scales[block.first_scale : block.first_scale + s.numel()] = s
        return scales

    def _codes(self, flat: Tensor, blocks: list[_Block], scales: Tensor, seed: int) -> Tensor:
        """One unsigned code per value, as uint8."""
        if self.bits == 1 and not self.stochastic:
            return torch.ge(flat, 0).view(torch.uint8)
        # A code is floor(x * inv + offset + u), u = 1/2 (round to nearest) or u ~ U[0, 1) (stochastic). The value
        # inside is never negative, so a truncating float->int conversion floors it. int8 converts fastest and holds
        # codes up to 127, i.e. every width but 8 bits (int16 there). Under a subnormal scale (float64 work below) a
        # float64 value may exceed its float32 scale by half (code < 2.5L + 1): int16 too, then the clamp.
        # Stochastic sign (one bit): P(+) = (x/s + 1)/2, i.e. inv = 1/(2s) and offset 1/2.
        reach, offset = (0.5, 0.5) if self.bits == 1 else (float(self.levels), float(self.levels))
        # inv = reach / s, rounded up where s * inv falls short of `reach` (checked exactly in float64): x = +-s then
        # lands on the end codes under any rounding, which keeps constant tensors exact under stochastic rounding too.
        positive, up = scales > 0, torch.tensor(math.inf, device=flat.device)
        inv = torch.where(positive, reach / scales, 0.0)
        inv = torch.where(positive & (scales.double() * inv.double() < reach), torch.nextafter(inv, up), inv)
        work = torch.float32
        if not bool(torch.isfinite(inv).all()):  # a scale below ~1e-37: its inverse overflows float32, not float64
            work, inv = torch.float64, torch.where(positive, reach / scales.double(), 0.0)
            inv = torch.where(positive, torch.nextafter(inv, up.double()), inv)  # up, not checked: codes are clamped
        device = flat.device
        small = self.top_code < 127 and work == torch.float32
        codes = torch.empty(flat.numel(), dtype=torch.int8 if small else torch.int16, device=device)
        scratch = torch.empty(max(b.largest_chunk() for b in blocks), dtype=work, device=device)
        generator = _seeded(seed, device) if self.stochastic else None
        rounding = torch.tensor(offset + 0.5, dtype=work, device=device)
        for block in blocks:
            for start, rows, cols, first_row in block.chunks():
                values = flat[start : start + rows * cols].view(rows, cols)
                inv_part = block.scales_for(inv, first_row, rows)
                shifted = scratch[: rows * cols].view(rows, cols)
                if generator is not None:
                    shifted.uniform_(offset, offset + 1.0, generator=generator)
                    shifted.addcmul_(values, inv_part)
                elif block.per_column:
                    torch.addcmul(rounding, values, inv_part, out=shifted)
                else:
                    torch.mul(values, inv_part, out=shifted).add_(offset + 0.5)
                codes[start : start + rows * cols].view(rows, cols).copy_(shifted)
        codes.clamp_(0, self.top_code)  # float rounding can push floor(top + u) to top + 1
        return codes.view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.uint8)

    # -- decode --------------------------------------------------------------------------------------------------

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        shape, dtype, result, out = out.shape, out.dtype, out, out.view(-1)
        n_scales, blocks = self._layout(shape)
        device = payload.device
        if not blocks:
            return result
        scales = _bytes_as(payload[: 4 * n_scales], torch.float32)
        neg_scales = scales.neg()
        codes = unpack_bits(payload[4 * n_scales :], n, self.bits)
        # value = (c * a - 1) * s with a = float32(2 / top). c * a is exactly 0, 1 and 2 at the codes 0, L and 2L
        # (true for every width here), so -s, zero and s come back exactly.
        a = 2.0 / self.top_code
        scratch = None
        if dtype != torch.float32:
            scratch = torch.empty(max(b.largest_chunk() for b in blocks), dtype=torch.float32, device=device)
        for block in blocks:
            for start, rows, cols, first_row in block.chunks():
                target = out[start : start + rows * cols].view(rows, cols)
                work = target if scratch is None else scratch[: rows * cols].view(rows, cols)
                work.copy_(codes[start : start + rows * cols].view(rows, cols))
                scale = block.scales_for(scales, first_row, rows)
                if block.per_column:  # -s + (c * a) * s
                    torch.addcmul(block.scales_for(neg_scales, first_row, rows), work, scale, value=a, out=work)
                else:
                    work.mul_(a).sub_(1.0).mul_(scale)
                if work is not target:
                    target.copy_(work)
        return result


# --------------------------------------------------------------------------------------------------------------------
# Sparsifiers


def _parse_ratio(text: str | float | Fraction, kind: str) -> Fraction:
    try:
        ratio = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{kind} needs a ratio in (0, 1] such as '{kind}:0.1', got {text!r}") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"{kind} needs a ratio in (0, 1] such as '{kind}:0.1', got {text!r}")
    return ratio


class _Sparsifier(_BuiltinCodec):
    """Sends ``k = ceil(ratio*n)`` values as fp16 (saturating) first in the payload; positions not sent decode to 0."""

    kind = ""

    def __init__(self, ratio: str | float | Fraction):
        self.ratio = _parse_ratio(ratio, self.kind)
        self.name = f"{self.kind}:{str(ratio).strip()}"

    def count(self, n: int) -> int:
        """Values kept out of ``n``: ``ceil(ratio * n)`` in exact arithmetic."""
        return math.ceil(self.ratio * n)

    @abc.abstractmethod
    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        """The flat positions of the ``k`` values in ``payload`` (on its device)."""

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        k = self.count(n)
        out.zero_()
        if k:
            index = self._sent_positions(payload, n, k, seed)
            out.view(-1)[index] = _bytes_as(payload[: 2 * k], torch.float16).to(out.dtype)
        return out


def _largest(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries (ties broken arbitrarily), like ``topk`` but faster for large inputs.

    A threshold read off a random sample with a safety margin of four standard deviations keeps a candidate set
    that almost surely holds the top k; when it does not (fewer than k candidates), plain topk runs instead.
    """
    n = magnitude.numel()
    if n >= 65536 and 4 * k <= n:
        samples, below = 16384, 1 - k / n
        rank = int(samples * below - 4 * math.sqrt(samples * below * (1 - below)))
        if rank >= 1:
            picks = torch.randint(n, (samples,), generator=_seeded(0, magnitude.device), device=magnitude.device)
            threshold = magnitude[picks].kthvalue(rank).values
            candidates = (magnitude >= threshold).nonzero().view(-1)
            if candidates.numel() >= k:  # then every top-k value is >= threshold, i.e. a candidate
                return candidates[magnitude[candidates].topk(k, sorted=False).indices]
    return magnitude.topk(k, sorted=False).indices


class TopKCodec(_Sparsifier):
    """Keeps the ``ceil(ratio*n)`` values of largest magnitude (fp16, saturating) and their flat indices.

    Payload: ``[k fp16 values][k indices, ceil(log2 n) bits each, packed by pack_bits]``, indices in increasing order.
    The positions not sent decode to zero.
    """

    kind = "topk"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        n = math.prod(shape)
        k = self.count(n)
        return 2 * k + packed_nbytes(k, max(n - 1, 0).bit_length())

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        flat = _finite_flat(x, self)
        n = flat.numel()
        k = self.count(n)
        payload = self._empty_payload(x)
        if k == 0:
            return payload
        index = _largest(flat.abs(), k).sort().values
        payload[: 2 * k].view(torch.float16).copy_(_fp16_saturated(flat[index]))
        pack_bits(index, (n - 1).bit_length(), out=payload[2 * k :])
        return payload

    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        return unpack_bits(payload[2 * k :], k, (n - 1).bit_length()).long()


def _random_subset(n: int, k: int, generator: torch.Generator) -> Tensor:
    """A uniformly random k-subset of ``range(n)``, sorted, without a full permutation of ``n`` for small ``k``.

    The distinct values among i.i.d. uniform draws form a uniform random subset of their size; drawing a few more
    than needed and dropping a uniform random subset of the surplus (recursively) leaves a uniform k-subset.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    if 2 * k > n:  # the complement is the smaller problem
        keep = torch.ones(n, dtype=torch.bool)
        keep[_random_subset(n, n - k, generator)] = False
        return keep.nonzero().view(-1)
    if n <= 65536 or 4 * k > n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    draws = math.ceil(-n * math.log1p(-k / n) * 1.02) + 16  # expected distinct count: a little over k
    pool = torch.randint(n, (draws,), generator=generator).unique()
    while pool.numel() < k:
        more = torch.randint(n, (2 * (k - pool.numel()) + 16,), generator=generator)
        pool = torch.cat([pool, more]).unique()
    if pool.numel() > k:
        keep = torch.ones(pool.numel(), dtype=torch.bool)
        keep[_random_subset(pool.numel(), pool.numel() - k, generator)] = False
        pool = pool[keep]
    return pool


class RandKCodec(_Sparsifier):
    """Sends the values at ``ceil(ratio*n)`` distinct positions drawn from the shared seed, as fp16 (saturating).

    Sender and receiver draw the same positions from ``seed`` (on the CPU, so devices do not matter), so no index
    is sent. The values are not rescaled by ``n/k``: the codec stays contractive, as error feedback expects.
    """

    kind = "randk"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return 2 * self.count(math.prod(shape))

    def positions(self, n: int, seed: int) -> Tensor:
        """The ``count(n)`` distinct flat positions for ``seed``, sorted, as a CPU int64 tensor."""
        return _random_subset(n, self.count(n), _seeded(seed))

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        flat = _finite_flat(x, self)
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        index = self.positions(n, seed).to(x.device)
        return _fp16_saturated(flat[index]).view(torch.uint8)

    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        return self.positions(n, seed).to(payload.device)


# --------------------------------------------------------------------------------------------------------------------
# Registry


_FACTORIES: dict[str, Callable[[str | None], Codec]] = {}


def register_codec(prefix: str, factory: Callable[[str | None], Codec], *, replace: bool = False) -> None:
    """Make ``get_codec("<prefix>")`` and ``get_codec("<prefix>:<options>")`` call ``factory(options or None)``."""
    if not isinstance(prefix, str) or not prefix or ":" in prefix or prefix != prefix.strip():
        raise ValueError(f"a codec prefix is a non-empty name without ':' or spaces, got {prefix!r}")
    if prefix in _FACTORIES and not replace:
        raise ValueError(f"codec {prefix!r} is already registered (pass replace=True to override it)")
    _FACTORIES[prefix] = factory


def available_codecs() -> list[str]:
    """Registered prefixes, in registration order."""
    return list(_FACTORIES)


def get_codec(spec: str | Codec) -> Codec:
    """A codec from its string (``"q4:group128:sr"``, ``"topk:0.1"``, ...); a :class:`Codec` passes through."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a codec is given by name or as a Codec instance, got {type(spec).__name__}")
    prefix, colon, options = spec.strip().partition(":")
    factory = _FACTORIES.get(prefix)
    if factory is None:
        if re.fullmatch(r"q\d+", prefix):
            raise ValueError(f"quantizer bits must be 1..8 (q1 ... q8), got {spec!r}")
        raise ValueError(f"unknown codec {spec!r}; known: {', '.join(available_codecs())}")
    return factory(options if colon else None)


def compression_ratio(codec: str | Codec, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> float:
    """float32 bytes of a tensor of ``shape`` divided by the codec's payload bytes for it (dtype as sent)."""
    codec = get_codec(codec)
    fp32_bytes = 4 * math.prod(shape)
    payload = codec.payload_nbytes(shape, dtype)
    if payload == 0:
        return 1.0 if fp32_bytes == 0 else math.inf
    return fp32_bytes / payload


def _no_options(name: str, make: Callable[[], Codec]) -> Callable[[str | None], Codec]:
    def factory(options: str | None) -> Codec:
        if options is not None:
            raise ValueError(f"codec {name!r} takes no options, got {name}:{options}")
        return make()

    return factory


def _quant_factory(bits: int) -> Callable[[str | None], Codec]:
    def factory(options: str | None) -> Codec:
        scale, group, stochastic = "channel", None, False
        for option in [] if options is None else options.split(":"):
            match = re.fullmatch(r"group(\d+)", option)
            if option == "sr" and not stochastic:
                stochastic = True
            elif option == "tensor" and scale == "channel":
                scale = "tensor"
            elif match and scale == "channel" and int(match.group(1)) > 0:
                scale, group = "group", int(match.group(1))
            else:
                raise ValueError(
                    f"bad quantizer option {option!r} in 'q{bits}:{options}'; allowed: at most one of 'tensor' or "
                    f"'group<G>' (G >= 1), and 'sr', e.g. 'q{bits}:group128:sr'"
                )
        return QuantCodec(bits, scale, group, stochastic)

    return factory


def _ratio_factory(cls: type[_Sparsifier]) -> Callable[[str | None], Codec]:
    def factory(options: str | None) -> Codec:
        if options is None:
            raise ValueError(f"{cls.kind} needs a ratio in (0, 1], e.g. '{cls.kind}:0.1'")
        return cls(options)

    return factory


register_codec("identity", _no_options("identity", IdentityCodec))
for _name, _dtype_name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp8", "float8_e4m3fn"),
                           ("fp8_e5m2", "float8_e5m2")):
    if hasattr(torch, _dtype_name):
        register_codec(_name, _no_options(_name, lambda d=getattr(torch, _dtype_name), n=_name: CastCodec(d, n)))
for _bits in range(1, 9):
    register_codec(f"q{_bits}", _quant_factory(_bits))
register_codec("topk", _ratio_factory(TopKCodec))
register_codec("randk", _ratio_factory(RandKCodec))
