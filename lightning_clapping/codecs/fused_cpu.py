"""Fused CPU kernels for the per-channel quantizer (``q2``, ``q4``, ``q8``), compiled by numba when it is installed.

Eager torch runs a quantizer as several passes over the message: the absolute values, their maximum, the scaled and
rounded codes, the conversion to bytes, the packing, and on the way back unpacking, conversion and scaling. Each pass
reads or writes the whole message, so at 1 M values the round trip costs about five memory copies. These kernels do
the same arithmetic in three passes (maximum; codes packed straight into bytes; unpacked straight into floats).

They produce **the same bytes and the same decoded values** as the eager code, bit for bit: the code of ``x`` is
``trunc(x * inv + L + 1/2)`` and a decoded value ``(a * c) * s - s``, each a multiply-add rounded once, as torch's
CPU ``addcmul`` rounds it in the eager code when its kernels use fused multiply-adds (its AVX2 kernels do, on the
machines measured here). A torch whose kernels round twice (its plain kernels, e.g. under ``ATEN_CPU_CAPABILITY=default``) would disagree, so the
kernels are checked once per process against the eager code, on values at the midpoints between codes, before they
are used; where they disagree, or numba does not load, the quantizers stay eager and a warning says why. So stages
with and without numba compute the same bytes, and their error-feedback buffers stay identical.

They run only where they apply: a float32 CPU tensor of at least :data:`MIN_VALUES` values, per-channel scales,
round to nearest (for decoding, either rounding), 2, 4 or 8 bits, and a layout whose packing planes start on whole
rows (see :func:`applies`). Everything else, and every machine without numba, takes the eager path. Small messages
are faster fused too, but they cost about a millisecond or less either way; leaving them eager spares a process that
only sends small tensors the import of numba and the check at its first message (numba caches the compiled kernels
on disk, so compiling is paid once per machine). The kernels run on one thread.

This module imports nothing of the codecs: the quantizer uses the kernels, and the kernels are checked against the
quantizer's eager code, which :mod:`.quant` hands over when it is imported (:func:`use_reference`). So the
dependency runs one way, ``quant`` -> ``fused_cpu``; the check still runs on first use, with the real eager code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MIN_VALUES", "applies", "available", "column_absmax", "decode_planes", "eager", "encode_planes",
           "use_reference"]

MIN_VALUES = 1 << 16
_WIDTHS = (2, 4, 8)
_kernels = None
_suspended = 0
#: ``reference(bits)``: the eager per-channel quantizer the kernels must match (see :func:`use_reference`)
_reference: Callable[[int], Any] | None = None


def use_reference(reference: Callable[[int], Any]) -> None:
    """Check the kernels, at their first use, against ``reference(bits)``: the eager per-channel quantizer of
    ``bits`` bits (its ``levels``, ``top_code``, ``encode`` and ``decode``). :mod:`.quant` calls it with
    ``QuantCodec`` when it is imported; until then the kernels are not used."""
    global _reference
    _reference = reference


def available() -> bool:
    """Whether numba is installed (the kernels are compiled at their first use, not here)."""
    return importlib.util.find_spec("numba") is not None


@contextlib.contextmanager
def eager():
    """Inside this block the quantizers run their eager code (to compare the two paths; not thread-safe)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def applies(x: Tensor, bits: int) -> bool:
    """Whether the fused kernels handle ``x`` (the flattened message's tensor, or the decode target) at ``bits``."""
    if _suspended or bits not in _WIDTHS or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 2:
        return False
    if x.is_neg():  # a lazily negated view (e.g. the imaginary part of a conjugate): numpy() cannot read it
        return False
    n, cols, planes = x.numel(), x.shape[-1], 8 // bits
    # pack_bits packs the first 64*(n//64) codes in `planes` planes; each plane must cover whole rows
    return n >= MIN_VALUES and n % 64 == 0 and cols > 0 and (n // cols) % planes == 0 and _load() is not None


def _load():
    """The kernels, or None (numba absent, broken, or not matching this torch's rounding); decided once, after
    :func:`use_reference` gave the eager code to check them against."""
    global _kernels
    if _kernels is None:
        if _reference is None:  # nothing to check them against yet: stay eager, decide at a later call
            return None
        _kernels = _checked_kernels() or False
    return _kernels or None


def _checked_kernels():
    if not available():
        return None
    try:
        from lightning_clapping.codecs import _numba_kernels as kernels

        matches = _matches_eager(kernels)
    except Exception as error:  # a numba built for another NumPy, or one with no writable cache folder
        warnings.warn(f"numba is installed but its kernels do not load ({type(error).__name__}: {error}); the "
                      f"quantizers run without the fused CPU kernels (same results, slower). If it says it cannot "
                      f"cache, set NUMBA_CACHE_DIR to a writable folder; else install a numba that matches NumPy.")
        return None
    if not matches:
        warnings.warn("this torch's CPU kernels round the quantizer's multiply-adds otherwise than the fused kernels "
                      "do (e.g. under ATEN_CPU_CAPABILITY=default), so the quantizers run without them: every stage "
                      "then computes the same bytes, with numba or without.")
        return None
    return kernels


def _matches_eager(kernels) -> bool:
    """Whether the kernels write this torch's eager bytes and decoded values, checked on values at the midpoints
    between codes, where a multiply-add rounded once and one rounded twice give different codes (the eager code is
    :data:`_reference`'s)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 64, 256
    scale = torch.rand(cols, generator=g) * 100 + 1e-3
    for bits in _WIDTHS:
        codec = _reference(bits)
        steps = torch.randint(-codec.levels, codec.levels, (rows, cols), generator=g)
        x = (steps + 0.5) / codec.levels * scale
        x[0], x[1] = scale, -scale
        with eager():
            payload = codec.encode(x)
            decoded = codec.decode(payload, x.shape, x.dtype)
        scales, packed = payload[: 4 * cols].view(torch.float32), payload[4 * cols :]
        codes, values = torch.empty_like(packed), torch.empty_like(x)
        if not torch.equal(column_absmax(x, kernels), scales):
            return False
        if not encode_planes(x, scales, bits, codec.levels, codes, kernels) or not torch.equal(codes, packed):
            return False
        decode_planes(packed, scales, bits, codec.top_code, values, kernels)
        if not torch.equal(values, decoded):
            return False
    return True


def column_absmax(x2d: Tensor, kernels=None) -> Tensor:
    """The max of ``|x|`` per column of the contiguous float32 ``[rows, cols]`` tensor, as float32 (NaN above inf,
    as the eager code's integer maximum gives)."""
    out = torch.empty(x2d.shape[1], dtype=torch.int32)
    (kernels or _load()).column_absmax_bits(x2d.numpy().view("int32"), out.numpy())
    return out.view(torch.float32)


def encode_planes(x2d: Tensor, scales: Tensor, bits: int, levels: int, out: Tensor, kernels=None) -> bool:
    """Write the packed codes of ``[rows, cols]`` float32 ``x2d`` under the float32 per-column ``scales`` into the
    uint8 tensor ``out`` (``rows*cols*bits/8`` bytes), in ``pack_bits``' planar layout: code ``trunc(x * inv + L +
    1/2)`` with ``inv = L / s`` as the eager quantizer rounds it. Returns False, writing nothing, where a scale is so
    small that ``L / s`` overflows float32 (the eager quantizer then works in float64)."""
    planes = 8 // bits
    rows, cols = x2d.shape
    values = x2d.numpy().reshape(planes, rows // planes, cols)
    packed = out.numpy().reshape(rows // planes, cols)
    return bool((kernels or _load()).encode_planes(values, scales.numpy(), levels, bits, packed))


def decode_planes(packed: Tensor, scales: Tensor, bits: int, top_code: int, out2d: Tensor, kernels=None) -> None:
    """Decode the packed codes into the contiguous float32 ``[rows, cols]`` ``out2d``: ``-s + (c * a) * s`` with
    ``a = float32(2 / top_code)``, as the eager decoder computes it."""
    planes = 8 // bits
    rows, cols = out2d.shape
    a = float(torch.tensor(2.0 / top_code, dtype=torch.float32))
    (kernels or _load()).decode_planes(packed.numpy().reshape(rows // planes, cols), scales.numpy(), a, bits,
                                       out2d.numpy().reshape(planes, rows // planes, cols))

