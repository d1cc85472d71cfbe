"""Fused CPU kernels for the per-channel quantizer (``q2``, ``q4``, ``q8``), compiled by numba when it is installed.

Eager torch runs a quantizer as several passes over the message: the absolute values, their maximum, the scaled and
rounded codes, the conversion to bytes, the packing, and on the way back unpacking, conversion and scaling. Each pass
reads or writes the whole message, so at 1 M values the round trip costs about five memory copies. These kernels do
the same arithmetic in three passes (maximum; codes packed straight into bytes; unpacked straight into floats).

They produce **the same bytes and the same decoded values** as the eager code, bit for bit, on the CPUs measured here:
the code of ``x`` is ``trunc(x * inv + L + 1/2)`` and a decoded value ``(a * c) * s - s``, each a multiply-add that
is fused into one rounding where the CPU has the instruction, as torch's ``addcmul`` is in the eager code (the tests
compare the two paths byte for byte). A peer without numba reads the payload unchanged.

They run only where they apply: a float32 CPU tensor of at least :data:`MIN_VALUES` values, per-channel
scales, round to nearest (decoding: either rounding), 2, 4 or 8 bits, and a layout whose packing planes start on whole rows (see
:func:`applies`). Everything else, and every machine without numba, takes the eager path. Small
messages are faster fused too, but they cost about a millisecond or less either way; leaving them eager spares a process
that only sends small tensors the import of numba and the loading of the kernels at its first message (numba caches
the compiled kernels on disk, so compiling is paid once per machine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings

import torch
from torch import Tensor

__all__ = ["MIN_VALUES", "applies", "available", "column_absmax", "decode_planes", "eager", "encode_planes"]

MIN_VALUES = 1 << 16
_WIDTHS = (2, 4, 8)
_kernels = None
_suspended = 0


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
    n, cols, planes = x.numel(), x.shape[-1], 8 // bits
    # pack_bits packs the first 64*(n//64) codes in `planes` planes; each plane must cover whole rows
    return n >= MIN_VALUES and n % 64 == 0 and cols > 0 and (n // cols) % planes == 0 and _load() is not None


def _load():
    global _kernels
    if _kernels is None and available():
        try:
            from lightning_clapping.codecs import _numba_kernels
        except ImportError as error:  # e.g. a numba built for another NumPy: stay eager, and say so once
            warnings.warn(f"numba is installed but does not import ({error}); the quantizers run without the fused "
                          f"CPU kernels (same results, slower). Install a numba that matches NumPy to use them.")
            _kernels = False
        else:
            _kernels = _numba_kernels
    return _kernels or None


def column_absmax(x2d: Tensor) -> Tensor:
    """The max of ``|x|`` per column of the contiguous float32 ``[rows, cols]`` tensor, as float32 (NaN above inf,
    as the eager code's integer maximum gives)."""
    out = torch.empty(x2d.shape[1], dtype=torch.int32)
    _load().column_absmax_bits(x2d.numpy().view("int32"), out.numpy())
    return out.view(torch.float32)


def encode_planes(x2d: Tensor, scales: Tensor, bits: int, levels: int, out: Tensor) -> bool:
    """Write the packed codes of ``[rows, cols]`` float32 ``x2d`` under the float32 per-column ``scales`` into the
    uint8 tensor ``out`` (``rows*cols*bits/8`` bytes), in ``pack_bits``' planar layout: code ``trunc(x * inv + L +
    1/2)`` with ``inv = L / s`` as the eager quantizer rounds it. Returns False, writing nothing, where a scale is so
    small that ``L / s`` overflows float32 (the eager quantizer then works in float64)."""
    planes = 8 // bits
    rows, cols = x2d.shape
    values = x2d.numpy().reshape(planes, rows // planes, cols)
    return bool(_load().encode_planes(values, scales.numpy(), levels, bits, out.numpy().reshape(rows // planes, cols)))


def decode_planes(packed: Tensor, scales: Tensor, bits: int, top_code: int, out2d: Tensor) -> None:
    """Decode the packed codes into the contiguous float32 ``[rows, cols]`` ``out2d``: ``-s + (c * a) * s`` with
    ``a = float32(2 / top_code)``, as the eager decoder computes it."""
    planes = 8 // bits
    rows, cols = out2d.shape
    a = float(torch.tensor(2.0 / top_code, dtype=torch.float32))
    _load().decode_planes(packed.numpy().reshape(rows // planes, cols), scales.numpy(), a, bits,
                          out2d.numpy().reshape(planes, rows // planes, cols))

