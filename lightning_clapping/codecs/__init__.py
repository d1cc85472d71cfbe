"""Codecs: how one tensor becomes the bytes that cross a pipeline boundary, and how it comes back.

A codec turns a floating tensor into a packed 1-D ``torch.uint8`` *payload* and decodes it on the receiving stage
from the payload, the shape, the dtype and the seed both sides share. The channel sends exactly these bytes, so a
4-bit quantizer really puts half a byte per value on the wire (plus its scales), never floats.

Built-in codecs, by the string :func:`get_codec` accepts (``codec.name`` gives the string back):

=========================  ===========================================================================================
``identity``               the tensor's own bytes; lossless, any dtype
``bf16``, ``fp16``         casts; ``fp8`` (float8_e4m3fn) and ``fp8_e5m2`` where torch has them. Casts **saturate**:
                           a value beyond the target's largest finite value is sent as that value, never as inf/NaN.
``q<b>``                   b-bit symmetric uniform quantizer, b in 1..8, one float32 scale per channel (the last
                           dimension; tensors with fewer than two dimensions get one scale)
``q<b>:tensor``            one scale for the whole tensor
``q<b>:group<G>``          one scale per G consecutive values in flattened order (the last group may be shorter)
``q<b>:...:fp16``          fp16 scales (2 bytes each, plus one 2-byte exponent per message) instead of float32,
                           e.g. ``q4:fp16``, ``q8:group64:fp16``; see :class:`QuantCodec` for their range
``q<b>:...:sr``            stochastic rounding (unbiased) instead of round-to-nearest, e.g. ``q2:group64:sr``
``topk:<r>``               the ceil(r*n) largest magnitudes: fp16 values + indices packed in ceil(log2 n) bits each
``randk:<r>``              ceil(r*n) positions drawn from the shared seed: fp16 values only, no indices, no rescaling
``topk:<r>+q<b>[:...]``    as ``topk:<r>`` / ``randk:<r>``, the kept values quantized instead of fp16, e.g.
``randk:<r>+q<b>[:...]``   ``topk:0.1+q8``, ``randk:0.25+q4:fp16`` (quantizer options as above; by default one
                           scale for all kept values, ``:group<G>`` one per G of them)
``lowrank:<R>[:it<k>]``    rank-R factors P (rows x R) and Q (channels x R) in fp16, P Q^T approximating the message
                           read as [rows, last dimension]; k power steps (default 1). Biased: meant for the
                           error-feedback variants (see :mod:`.lowrank`)
=========================  ===========================================================================================

Quantizer options come in any order, each at most once; ``codec.name`` writes them as
``q<b>[:tensor|:group<G>][:fp16][:sr]``. Payload sizes, for ``n`` values and ``S`` scales (:meth:`payload_nbytes`
gives them exactly): ``q<b>``: ``4S + ceil(n*b/8)``; ``q<b>:fp16``: ``2 + 2S + ceil(n*b/8)``; ``topk:<r>`` with
``k = ceil(r*n)``: ``2k + ceil(k*ceil(log2 n)/8)``, with ``+q<b>`` the ``2k`` becomes the quantizer's payload for
``k`` values (``4 + ceil(k*b/8)`` with one float32 scale); ``randk`` the same without the indices.

The quantizer (b >= 2) uses the levels ``k*s/L`` for integers ``k`` in ``[-L, L]``, ``L = 2**(b-1) - 1``, with ``s`` the
max-abs of the values sharing the scale: zero is a level, round-to-nearest errs by at most ``s/(2L)``, and a
constant tensor comes back exactly (with fp16 scales, ``s`` is the max-abs rounded up to fp16 precision: the bound
holds for that ``s``, and a constant comes back exactly when it has 11 significant bits or fewer). Codes are
offset to ``k + L`` (unsigned) and bit-packed densely: ``n`` values take ``ceil(n*b/8)`` bytes. With ``b == 1`` a
value is sent as its sign (zero counts as positive) times the scale; the scale is the mean of ``|x|`` (the L2-best
scale for a sign pattern), or the max-abs under ``:sr`` so that the stochastic sign stays unbiased.

Every lossy codec refuses NaN and inf with :class:`NonFiniteError` (see :func:`check_finite`), scanning its input
once; ``identity`` carries them bit-exactly. Payloads and decoded tensors never share memory with the caller's
tensors; ``decode_into`` writes into a buffer the caller reuses (no fresh allocation per message).

Everything runs in eager PyTorch, no compiler needed; ``benchmarks/codec_speed.py`` measures each codec against a
plain memory copy. A first ``torch.compile`` of the quantizer's steps (dynamic shapes) ran slower than this eager code
on the project's CPU, so there is no compiled path.

The families live in one module each: :mod:`.casts` (identity and casts), :mod:`.quant` (the quantizer, with its
optional numba kernels in :mod:`.fused_cpu`), :mod:`.sparse` (top-k, rand-k) and :mod:`.lowrank` (low-rank
factors); :mod:`.base` holds the :class:`Codec` contract and the NaN/inf check, and :mod:`.registry` the names.
Writing a codec takes a few lines: subclass :class:`Codec` and register a factory (see its docstring). The bit
packing lives in :mod:`lightning_clapping.bitpack`, below this package and the wire (``pack_bits``, ``unpack_bits``
and ``packed_nbytes`` are re-exported here). The error-feedback rules that use the codecs on a boundary are
:mod:`.feedback` (one class per variant, in :mod:`.rules`); they are not imported here, so a codec can be used
without them.
"""

from __future__ import annotations

import torch

from lightning_clapping.bitpack import pack_bits, packed_nbytes, unpack_bits
from lightning_clapping.codecs.base import Codec, NonFiniteError, check_finite
from lightning_clapping.codecs.casts import CAST_NAMES, CastCodec, IdentityCodec, cast_factory
from lightning_clapping.codecs.lowrank import LowRankCodec, lowrank_factory
from lightning_clapping.codecs.quant import QuantCodec, quant_factory
from lightning_clapping.codecs.registry import (
    available_codecs, compression_ratio, get_codec, no_options, register_codec,
)
from lightning_clapping.codecs.sparse import RandKCodec, TopKCodec, sparse_factory

__all__ = [
    "CastCodec", "Codec", "IdentityCodec", "LowRankCodec", "NonFiniteError", "QuantCodec", "RandKCodec",
    "TopKCodec",
    "available_codecs", "check_finite", "compression_ratio", "get_codec", "pack_bits", "packed_nbytes",
    "register_codec", "unpack_bits",
]

register_codec("identity", no_options("identity", IdentityCodec))
for _name, _dtype_name in CAST_NAMES.items():
    if hasattr(torch, _dtype_name):
        register_codec(_name, cast_factory(_name))
for _bits in range(1, 9):
    register_codec(f"q{_bits}", quant_factory(_bits))
register_codec("topk", sparse_factory(TopKCodec))
register_codec("randk", sparse_factory(RandKCodec))
register_codec("lowrank", lowrank_factory)
del _name, _dtype_name, _bits
