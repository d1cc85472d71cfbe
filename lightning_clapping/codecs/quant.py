"""The symmetric uniform quantizer ``q<b>``: b-bit codes, bit-packed, plus one scale per channel, group or tensor.

The eager code here is the reference: the fused CPU kernels (:mod:`.fused_cpu`) run only where they give its bytes
and values bit for bit, which they check against :class:`QuantCodec` at first use. This module hands the class over
(``fused_cpu.use_reference``) rather than ``fused_cpu`` importing it, so the two modules do not import each other.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from lightning_clapping.bitpack import pack_bits, packed_nbytes, unpack_bits
from lightning_clapping.codecs import fused_cpu
from lightning_clapping.codecs.base import BuiltinCodec, bytes_as, raise_non_finite, require_float, seeded

__all__ = ["QuantCodec", "quant_factory"]

# Values per step of the element-wise loops: the float32 temporaries (2 MB) stay in the CPU caches, and Python's
# per-operation overhead stays small next to the work. The payload layout does not depend on it.
_CHUNK = 1 << 19

_FLOAT32_MAX = torch.finfo(torch.float32).max
_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                   torch.bfloat16: torch.int16}
# fp16 scales are sent as m * 2**e: m an fp16 value, e one int16 per message chosen so that the largest scale lies
# in [2**14, 2**15) before it is rounded up to an fp16 value (which then stays <= 2**15 < 65504: never inf).
_FP16_TOP_EXPONENT = 15


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


def _powers_of_two(exponents: Tensor) -> Tensor:
    """``2.0 ** exponents`` as exact float64 values, built from the bits (integer exponents in -1022..1023)."""
    return ((exponents.to(torch.int64) + 1023) << 52).view(torch.float64)


def _fp16_scales(scales: Tensor, peak: float) -> tuple[int, Tensor, Tensor]:
    """(exponent, mantissas, sent scales) for the float32 ``scales`` whose largest value is ``peak``.

    Every sent scale ``mantissa * 2**exponent`` is the smallest such value not below its float32 scale (so the grid
    still covers every value), except where that would exceed float32's range (a scale within 2**-11 of its largest
    value), where it is the largest one below. The sent scales are float32 values: rounding a float32 value up onto
    the grid ``m * 2**e`` lands on a multiple of the coarser of the two grids' spacings there. The receiver rebuilds
    them in float64 and gets the same float32 values.
    """
    exponent = math.frexp(peak)[1] - _FP16_TOP_EXPONENT
    scaled = scales.double().mul_(2.0**-exponent)  # exact: a power of two, well inside float64's range
    mantissas = scaled.to(torch.float16)  # a neighbour of `scaled` on the fp16 grid; step up where it is below
    bits = mantissas.view(torch.int16)
    mantissas = torch.where(mantissas.double() < scaled, bits + 1, bits).view(torch.float16)
    sent = mantissas.double().mul_(2.0**exponent)
    if math.frexp(peak)[1] == 128:  # peak >= 2**127: rounding up may have left float32's range
        too_big = sent > _FLOAT32_MAX
        mantissas = torch.where(too_big, mantissas.view(torch.int16) - 1, mantissas.view(torch.int16))
        mantissas = mantissas.view(torch.float16)
        sent = mantissas.double().mul_(2.0**exponent)
    return exponent, mantissas, sent.float()


class QuantCodec(BuiltinCodec):
    """Symmetric uniform ``bits``-bit quantizer with float32 or fp16 scales (per channel, per tensor or per group).

    ``scale`` is ``"channel"`` (one scale per index of the last dimension, the max-abs over all other elements, as
    AQ-SGD scales each hidden channel; tensors with fewer than two dimensions get one scale), ``"tensor"`` or
    ``"group"`` (one scale per ``group_size`` consecutive values of the flattened tensor). ``stochastic`` rounds up
    with probability equal to the fractional position between the two nearest levels, so the decoded value is
    unbiased (up to float32 rounding of that position).

    ``scale_dtype`` is ``torch.float32`` (default) or ``torch.float16``. Payload: ``[float32 scales][codes]``, or
    with fp16 scales ``[int16 exponent e][fp16 mantissas m][codes]``, each scale being ``m * 2**e`` (one ``e`` per
    message, so scales of any float32 magnitude are sent without overflow to inf and without flushing a whole
    message of tiny scales to zero). A fp16 scale is the max-abs rounded *up* to 11 significant bits (the rounding
    up keeps every value on the grid: the error bound is half a step of the sent scale). Scales below ``2**-28``
    times the message's largest one have fewer significant bits (fp16 subnormals), and those below about ``2**-38``
    times it are sent as that smallest step (their values mostly decode to zero); a non-zero scale never becomes
    zero. With float32 scales nothing changes: ``q4`` means what it always meant.
    Codes are packed by :func:`~lightning_clapping.bitpack.pack_bits`; an empty tensor has an empty payload.
    Tiny and subnormal scales keep the full grid (codes are then computed in float64); decoded values round to
    float32's subnormal spacing, ``2**-149``.
    """

    def __init__(self, bits: int, scale: str = "channel", group_size: int | None = None, stochastic: bool = False,
                 scale_dtype: torch.dtype = torch.float32):
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"quantizer bits must be an integer in 1..8, got {bits!r}")
        if scale not in ("channel", "tensor", "group"):
            raise ValueError(f"quantizer scale must be 'channel', 'tensor' or 'group', got {scale!r}")
        if scale == "group" and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group scaling needs a positive integer group size, got {group_size!r}")
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"quantizer scales are sent as torch.float32 or torch.float16, got {scale_dtype}")
        self.bits, self.scale, self.stochastic, self.scale_dtype = bits, scale, stochastic, scale_dtype
        self.group_size = group_size if scale == "group" else None
        self.levels = 2 ** (bits - 1) - 1 if bits >= 2 else 1  # L: the grid is k*s/L for k in [-L, L]
        # Codes are unsigned: c = k + L in [0, 2L] for bits >= 2; c = (sign + 1)/2 in {0, 1} for one bit.
        self.top_code = 2 * self.levels if bits >= 2 else 1
        options = {"channel": "", "tensor": ":tensor", "group": f":group{group_size}"}[scale]
        fp16 = ":fp16" if scale_dtype == torch.float16 else ""
        self.name = f"q{bits}{options}{fp16}{':sr' if stochastic else ''}"

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

    def _scale_nbytes(self, n_scales: int) -> int:
        if self.scale_dtype == torch.float32:
            return 4 * n_scales
        return 2 + 2 * n_scales if n_scales else 0

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        n_scales, _ = self._layout(shape)
        return self._scale_nbytes(n_scales) + packed_nbytes(math.prod(shape), self.bits)

    # -- encode --------------------------------------------------------------------------------------------------
    # Element-wise work runs chunk by chunk (see _CHUNK) in float32 scratch that stays in cache. Per-row scales are
    # applied with at most one broadcast operand per operation: torch vectorizes only that case.

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        return self.encode_into(x, self._empty_payload(x), seed=seed)

    def encode_into(self, x: Tensor, payload: Tensor, *, seed: int = 0) -> Tensor:
        """Encode ``x`` into ``payload`` and return it: ``payload_nbytes`` bytes, e.g. a slice of a larger payload
        that starts at a multiple of 4 bytes (the scales are written through a float view)."""
        require_float(x, self)
        n_scales, blocks = self._layout(x.shape)
        head = self._scale_nbytes(n_scales)
        if payload.dtype != torch.uint8 or payload.numel() != head + packed_nbytes(x.numel(), self.bits):
            raise ValueError(f"{self.name}: encode_into needs {self.payload_nbytes(x.shape, x.dtype)} uint8 bytes for "
                             f"shape {tuple(x.shape)}, got {payload.dtype} {tuple(payload.shape)}")
        if not blocks:
            return payload
        flat = x.detach().reshape(-1)
        mean = self.bits == 1 and not self.stochastic
        fused = self.runs_fused(x)
        # The scales are the NaN/inf check: a max-abs (or a sum of |x|) is NaN or inf exactly when an input value
        # is, or, for a float32 sum, when it overflowed.
        if fused:
            x2d = flat.view(-1, x.shape[-1])
            scales = fused_cpu.column_absmax(x2d)
        else:
            scales = self._scales(flat, blocks, n_scales, mean)
        peak = float(scales.amax())
        if not math.isfinite(peak):  # scales are >= 0: their max is NaN or inf if any one is
            raise_non_finite(flat)
            scales = self._scales(flat.double(), blocks, n_scales, mean)  # a float32 sum of |x| overflowed
            peak = float(scales.amax())
            if not math.isfinite(peak):  # a float64 input beyond float32's range: no float32 scale holds it
                raise ValueError(
                    f"{self.name}: values of magnitude {float(flat.abs().max()):.3g} exceed what its float32 scales "
                    f"can hold ({_FLOAT32_MAX:.3g}); scale the tensor down before it crosses the cut, or send it "
                    f"uncompressed (codec 'identity')"
                )
        if self.scale_dtype == torch.float32:
            payload[:head].view(torch.float32).copy_(scales)
        else:
            exponent, mantissas, scales = _fp16_scales(scales, peak)
            payload[:2].view(torch.int16).fill_(exponent)
            payload[2:head].view(torch.float16).copy_(mantissas)
        if fused and fused_cpu.encode_planes(x2d, scales, self.bits, self.levels, payload[head:]):
            return payload
        pack_bits(self._codes(flat, blocks, scales, seed), self.bits, out=payload[head:])
        return payload

    def runs_fused(self, x: Tensor, decoding: bool = False) -> bool:
        """Whether the fused CPU kernels (:mod:`~lightning_clapping.codecs.fused_cpu`) encode ``x`` (or, with
        ``decoding``, decode into it): the same bytes and values as the eager code, in fewer passes. Stochastic
        rounding is encoded eagerly (its random draws are torch's); its codes decode like any others."""
        return self.scale == "channel" and (decoding or not self.stochastic) and fused_cpu.applies(x, self.bits)

    @staticmethod
    def _scales(flat: Tensor, blocks: list[_Block], n_scales: int, mean: bool) -> Tensor:
        """max |x| (or mean |x|) over the values sharing each scale, as float32."""
        scales = torch.empty(n_scales, dtype=torch.float32, device=flat.device)
        scratch = torch.empty(max(b.largest_chunk() for b in blocks), dtype=flat.dtype, device=flat.device)
        accumulate = torch.float64 if flat.dtype == torch.float64 else torch.float32
        # The max of |x| is taken on its bits read as signed integers of the same width: for floats without a sign
        # bit that order is the float order, with NaN above inf; an integer max skips the NaN check that torch's
        # float max makes at every element, and runs faster on the CPU.
        bits = _SAME_WIDTH_INT.get(flat.dtype, flat.dtype)
        for block in blocks:
            dim, partial = 0 if block.per_column else 1, []
            for start, rows, cols, _ in block.chunks():
                magnitude = scratch[: rows * cols].view(rows, cols)
                torch.abs(flat[start : start + rows * cols].view(rows, cols), out=magnitude)
                partial.append(magnitude.sum(dim, dtype=accumulate) if mean else magnitude.view(bits).amax(dim))
            if block.per_column:
                s = torch.stack(partial).sum(0) if mean else torch.stack(partial).amax(0)
            else:
                s = torch.cat(partial)
                if block.rows == 1:
                    s = s.sum().view(1) if mean else s.amax().view(1)
            if mean:
                s = s / (block.rows if block.per_column else block.cols)
            else:
                s = s.view(flat.dtype)  # the integer max read back as the float it is
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
        # A zero scale gets inv = 0 (its values are all zero).
        up, zero = torch.tensor(math.inf, device=flat.device), scales == 0
        inv = scales.reciprocal().mul_(reach)  # what `reach / scales` computes, without Python's __rdiv__ detour
        inv = torch.where(scales.double() * inv.double() < reach, torch.nextafter(inv, up), inv)  # 0 * inf: False
        work = torch.float32
        if float(inv.masked_fill_(zero, 0.0).amax()) == math.inf:  # a scale below ~1e-37: 1/s overflows float32
            work = torch.float64  # and inv is rounded up without the check: the codes are clamped
            inv = torch.nextafter(scales.double().reciprocal().mul_(reach), up.double()).masked_fill_(zero, 0.0)
        device = flat.device
        small = self.top_code < 127 and work == torch.float32
        codes = torch.empty(flat.numel(), dtype=torch.int8 if small else torch.int16, device=device)
        scratch = torch.empty(max(b.largest_chunk() for b in blocks), dtype=work, device=device)
        generator = seeded(seed, device) if self.stochastic else None
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
        if generator is not None or work == torch.float64:
            # floor(top + u) can reach top + 1 in float rounding, and float64 work can overshoot (above). Round to
            # nearest in float32 cannot: |x * inv| <= L (1 + 2**-10) even under a fp16 scale rounded down (less than
            # 2**-11 below the max-abs), so x * inv + L + 1/2 lies in (0, 2L + 1) and its floor in [0, 2L].
            codes.clamp_(0, self.top_code)
        return codes.view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.uint8)

    # -- decode --------------------------------------------------------------------------------------------------

    def _read_scales(self, payload: Tensor, n_scales: int) -> Tensor:
        if self.scale_dtype == torch.float32:
            return bytes_as(payload[: 4 * n_scales], torch.float32)
        exponent = bytes_as(payload[:2], torch.int16)
        mantissas = bytes_as(payload[2 : 2 + 2 * n_scales], torch.float16)
        return (mantissas.double() * _powers_of_two(exponent)).float()

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        shape, dtype, result, out = out.shape, out.dtype, out, out.view(-1)
        n_scales, blocks = self._layout(shape)
        device = payload.device
        if not blocks:
            return result
        scales = self._read_scales(payload, n_scales)
        if self.runs_fused(result, decoding=True):
            packed = payload[self._scale_nbytes(n_scales) :]
            fused_cpu.decode_planes(packed, scales, self.bits, self.top_code, out.view(-1, shape[-1]))
            return result
        neg_scales = scales.neg()
        codes = unpack_bits(payload[self._scale_nbytes(n_scales) :], n, self.bits)
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


def quant_factory(bits: int):
    """The registry factory of ``q<bits>``: options ``tensor`` or ``group<G>`` (at most one), ``fp16``, ``sr``."""

    def factory(options: str | None) -> QuantCodec:
        scale, group, stochastic, scale_dtype = "channel", None, False, torch.float32
        for option in [] if options is None else options.split(":"):
            match = re.fullmatch(r"group(\d+)", option)
            if option == "sr" and not stochastic:
                stochastic = True
            elif option == "fp16" and scale_dtype == torch.float32:
                scale_dtype = torch.float16
            elif option == "tensor" and scale == "channel":
                scale = "tensor"
            elif match and scale == "channel" and int(match.group(1)) > 0:
                scale, group = "group", int(match.group(1))
            else:
                raise ValueError(
                    f"bad quantizer option {option!r} in 'q{bits}:{options}'; allowed, each at most once and in any "
                    f"order: 'tensor' or 'group<G>' (G >= 1, not both), 'fp16' (fp16 scales), 'sr' (stochastic "
                    f"rounding), e.g. 'q{bits}:group128:fp16:sr'"
                )
        return QuantCodec(bits, scale, group, stochastic, scale_dtype)

    return factory


fused_cpu.use_reference(QuantCodec)  # the eager code the fused kernels are checked against
