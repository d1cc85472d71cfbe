"""Bit packing: ``n`` unsigned codes of ``b`` bits in ``ceil(n*b/8)`` bytes, and back.

The quantizer packs its codes and top-k packs its indices with these. The layout is *planar*: a few whole-array
operations (shifts, masks and additions on uint8 or int32 views) instead of a per-value loop, so packing runs at
memory speed in eager PyTorch. See :func:`pack_bits` for the exact layout; :func:`unpack_bits` inverts it.

Why it sits at the top of the package, below ``codecs/`` and ``comm/``: both pack bits (the codecs their codes and
indices, :mod:`lightning_clapping.comm.wire` a ``torch.bool`` tensor's RAW payload) and the wire must not import the
codecs. It depends on torch alone; :mod:`lightning_clapping.codecs` re-exports its three functions.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = ["pack_bits", "packed_nbytes", "unpack_bits"]

_LITTLE = sys.byteorder == "little"


def _check_bits(caller: str, bits: int) -> None:
    if not 0 <= bits <= 63:
        raise ValueError(f"{caller}: bits must be in 0..63, got {bits}")


def _low_bytes(columns: Tensor, count: int) -> Tensor:
    """A view of the ``count`` least significant byte columns of int64 values viewed as ``(n, 8)`` bytes, in memory
    order (a slice: no index tensor is built on the host and copied to the values' device)."""
    return columns[:, :count] if _LITTLE else columns[:, 8 - count :]


def _by_significance(block: Tensor) -> Tensor:
    """Byte columns from :func:`_low_bytes` reordered lowest first, or back (the order is its own inverse)."""
    return block if _LITTLE else block.flip(1)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` uses for ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def _fields(bits: int) -> list[tuple[int, int]]:
    """Split a ``bits``-wide code into (shift, width) fields of 8, 4, 2 or 1 bits, lowest bits first.

    Widths follow the binary digits of ``bits % 8`` after the whole bytes, so no field straddles a byte.
    """
    fields, shift = [], 0
    while bits - shift >= 8:
        fields.append((shift, 8))
        shift += 8
    for width in (4, 2, 1):
        if (bits - shift) & width:
            fields.append((shift, width))
            shift += width
    return fields


def pack_bits(codes: Tensor, bits: int, *, out: Tensor | None = None) -> Tensor:
    """Pack ``n`` non-negative integer codes below ``2**bits`` (0 <= bits <= 63) into ``ceil(n*bits/8)`` bytes.

    Layout: the first ``m = 64*(n//64)`` codes are packed field by field (see :func:`_fields`). For a field of ``w``
    bits the ``m`` field values are cut into ``8//w`` equal planes, and byte ``i`` of the field's block holds value
    ``i`` of plane ``j`` in bits ``[j*w, (j+1)*w)``. The last ``n - m`` (< 64) codes follow as a little-endian bit
    stream. Codes up to 8 bits wide are taken as uint8 (int8 is reinterpreted), wider ones as int64.
    """
    _check_bits("pack_bits", bits)
    codes = codes.reshape(-1)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    elif out.dtype != torch.uint8 or out.numel() != nbytes:
        raise ValueError(f"pack_bits: out must be uint8 with {nbytes} elements, got {out.dtype} {tuple(out.shape)}")
    if n == 0 or bits == 0:
        return out
    if bits <= 8:
        if codes.dtype == torch.int8:
            codes = codes.contiguous().view(torch.uint8)
        else:
            codes = codes.to(torch.uint8).contiguous()
        byte_rows = [codes]
    else:
        codes = codes.to(torch.int64)
        byte_rows = list(_byte_rows(codes, (bits + 7) // 8))
    m = n - n % 64
    pos = 0
    for shift, width in _fields(bits):
        byte, offset = divmod(shift, 8)
        field = byte_rows[byte][:m]
        if offset or (offset + width < 8 and shift + width < bits):  # isolate the field's bits in each byte
            (word,), rep = _as_words(field)
            field = ((word >> offset) & (((1 << width) - 1) * rep)).view(torch.uint8)
        size = m * width // 8
        _pack_planes(field, 8 // width, width, out[pos : pos + size])
        pos += size
    if m < n:
        out[pos:] = _pack_tail(codes[m:], bits)
    return out


def _byte_rows(codes: Tensor, count: int) -> Tensor:
    """The low ``count`` bytes of each int64 code as ``count`` contiguous rows, padded to a multiple of 64 values."""
    n = codes.numel()
    columns = codes.contiguous().view(torch.uint8).view(n, 8)
    rows = torch.zeros(count, -(-n // 64) * 64, dtype=torch.uint8, device=codes.device)
    rows[:, :n] = _by_significance(_low_bytes(columns, count)).t()
    return rows


def _as_words(*parts: Tensor) -> tuple[list[Tensor], int]:
    """View byte runs as int32 words when all of them allow it (torch's byte shifts are not vectorized).

    Returns the views and the factor that repeats a one-byte mask over a word (0x01010101, or 1 for plain bytes).
    Only right shifts followed by a byte mask are applied to words, so no bit leaks into another byte's result.
    """
    if all(p.is_contiguous() and p.numel() % 4 == 0 and p.storage_offset() % 4 == 0 for p in parts):
        return [p.view(torch.int32) for p in parts], 0x01010101
    return list(parts), 1


def _pack_planes(field: Tensor, planes: int, width: int, dst: Tensor) -> None:
    # The planes hold disjoint bits, so adding them shifted is OR-ing them; uint8 addition is vectorized, and it
    # wraps instead of overflowing.
    size = dst.numel()
    if size == 0:
        return
    parts = [field[j * size : (j + 1) * size] for j in range(planes)]
    if planes == 1:
        dst.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], alpha=1 << width, out=dst)
    for j in range(2, planes):
        dst.add_(parts[j], alpha=1 << (j * width))


def _unpack_planes(src: Tensor, planes: int, width: int, dst: Tensor) -> None:
    size = src.numel()
    if size == 0:
        return
    (src, *parts), rep = _as_words(src, *(dst[j * size : (j + 1) * size] for j in range(planes)))
    if planes == 1:
        parts[0].copy_(src)
        return
    mask = ((1 << width) - 1) * rep
    for j, part in enumerate(parts):
        if j == 0:
            torch.bitwise_and(src, mask, out=part)
        else:
            torch.bitwise_right_shift(src, j * width, out=part)
            part.bitwise_and_(mask)


def _pack_tail(codes: Tensor, bits: int) -> Tensor:
    device = codes.device
    stream = ((codes.to(torch.int64).unsqueeze(1) >> torch.arange(bits, device=device)) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    return (stream.view(-1, 8) << torch.arange(8, device=device)).sum(1).to(torch.uint8)


def _unpack_tail(src: Tensor, count: int, bits: int) -> Tensor:
    device = src.device
    stream = ((src.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=device)) & 1).reshape(-1)
    stream = stream[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, device=device)).sum(1)


def unpack_bits(packed: Tensor, n: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes as a new uint8 tensor (``bits <= 8``) or int64 tensor (wider)."""
    _check_bits("unpack_bits", bits)
    nbytes = packed_nbytes(n, bits)
    if packed.numel() != nbytes:
        raise ValueError(f"unpack_bits: {n} codes of {bits} bits take {nbytes} bytes, got {packed.numel()}")
    device = packed.device
    wide = bits > 8
    if n == 0 or bits == 0:
        return torch.zeros(n, dtype=torch.int64 if wide else torch.uint8, device=device)
    m = n - n % 64
    if wide:
        rows = torch.empty((bits + 7) // 8, m, dtype=torch.uint8, device=device)
    else:
        out = torch.empty(n, dtype=torch.uint8, device=device)
        rows = out[:m].view(1, m)
    pos = 0
    for shift, width in _fields(bits):
        byte, offset = divmod(shift, 8)
        size = m * width // 8
        src = packed[pos : pos + size]
        pos += size
        if offset == 0:  # the first field of a byte sets it
            _unpack_planes(src, 8 // width, width, rows[byte])
        else:
            values = torch.empty(m, dtype=torch.uint8, device=device)
            _unpack_planes(src, 8 // width, width, values)
            rows[byte].add_(values, alpha=1 << offset)  # disjoint bits: adding is OR-ing
    tail = _unpack_tail(packed[pos:], n - m, bits) if m < n else None
    if not wide:
        if tail is not None:
            out[m:] = tail.to(torch.uint8)
        return out
    out = torch.zeros(n, dtype=torch.int64, device=device)
    _low_bytes(out.view(torch.uint8).view(n, 8)[:m], rows.shape[0]).copy_(_by_significance(rows.t()))
    if tail is not None:
        out[m:] = tail
    return out
