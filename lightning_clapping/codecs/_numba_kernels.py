"""The numba kernels behind :mod:`lightning_clapping.codecs.fused_cpu` (imported only when numba is installed).

Arrays come from ``Tensor.numpy()`` views, so the kernels read the message and write the payload in place. A code is
``trunc(x * inv + L + 1/2)`` and a decoded value ``(a * c) * s - s``, each a multiply feeding an add that the CPU
fuses into one operation with one rounding, as torch's ``addcmul`` kernels do in the eager quantizer; ``inv`` is
computed from the scales with the eager code's roundings (float32 division and product, emulated exactly in
float64). One kernel per width keeps the number of planes a constant, so the loops vectorize.
"""

from __future__ import annotations

import numba
import numpy as np

# "contract" lets LLVM fuse a multiply feeding an add into one multiply-add with one rounding, as the CPU kernels
# of torch that the eager quantizer runs do (addcmul); nothing is reordered.
_jit = numba.njit(cache=True, boundscheck=False, nogil=True, fastmath={"contract"})


@_jit
def column_absmax_bits(xi, out):
    """``out[j]`` = the largest ``xi[i, j] & 0x7FFFFFFF`` (float32 bits of ``|x|`` read as int32)."""
    rows, cols = xi.shape
    for j in range(cols):
        out[j] = 0
    for i in range(rows):
        for j in range(cols):
            out[j] = max(out[j], xi[i, j] & 0x7FFFFFFF)


@_jit
def _code(v, inv, rnd):
    return np.int32(v * inv + rnd)


@_jit
def _value(c, a, s):
    return (a * np.float32(c)) * s - s


@_jit
def _inverse(scales, reach, inv):
    """``inv[j]`` as the eager quantizer computes it (float32 ``reach / s``, one step up where ``s * inv`` falls
    short of ``reach``; 0 for a zero scale). False where one overflows float32 (the eager path works in float64)."""
    for j in range(scales.shape[0]):
        s = scales[j]
        if s == 0:
            inv[j] = 0
            continue
        # float64 division and product of float32 values, rounded once to float32, equal the float32 operations
        v = np.float32(np.float64(np.float32(np.float64(1.0) / np.float64(s))) * reach)
        if np.float64(s) * np.float64(v) < reach:
            v = np.nextafter(v, np.float32(np.inf))
        if np.isinf(v):
            return False
        inv[j] = v
    return True


@_jit
def _encode8(x, inv, rnd, out):
    for i in range(x.shape[1]):
        for j in range(x.shape[2]):
            out[i, j] = np.uint8(_code(x[0, i, j], inv[j], rnd))


@_jit
def _encode4(x, inv, rnd, out):
    for i in range(x.shape[1]):
        for j in range(x.shape[2]):
            out[i, j] = np.uint8(_code(x[0, i, j], inv[j], rnd) | (_code(x[1, i, j], inv[j], rnd) << 4))


@_jit
def _encode2(x, inv, rnd, out):
    for i in range(x.shape[1]):
        for j in range(x.shape[2]):
            w = inv[j]
            out[i, j] = np.uint8(_code(x[0, i, j], w, rnd) | (_code(x[1, i, j], w, rnd) << 2)
                                 | (_code(x[2, i, j], w, rnd) << 4) | (_code(x[3, i, j], w, rnd) << 6))


@_jit
def _decode8(p, s, a, out):
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            out[0, i, j] = _value(p[i, j], a, s[j])


@_jit
def _decode4(p, s, a, out):
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            b = p[i, j]
            out[0, i, j] = _value(b & 15, a, s[j])
            out[1, i, j] = _value(b >> 4, a, s[j])


@_jit
def _decode2(p, s, a, out):
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            b = p[i, j]
            out[0, i, j] = _value(b & 3, a, s[j])
            out[1, i, j] = _value((b >> 2) & 3, a, s[j])
            out[2, i, j] = _value((b >> 4) & 3, a, s[j])
            out[3, i, j] = _value(b >> 6, a, s[j])


_ENCODE = {2: _encode2, 4: _encode4, 8: _encode8}
_DECODE = {2: _decode2, 4: _decode4, 8: _decode8}


def encode_planes(x, scales, levels, bits, out):
    inv = np.empty(scales.shape[0], np.float32)
    if not _inverse(scales, np.float64(levels), inv):
        return False
    _ENCODE[bits](x, inv, np.float32(levels + 0.5), out)
    return True


def decode_planes(p, s, a, bits, out):
    _DECODE[bits](p, s, np.float32(a), out)
