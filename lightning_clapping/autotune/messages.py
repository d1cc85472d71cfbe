"""What one message of a boundary costs on the wire under a setting: the tensors it holds and its exact bytes.

A message is described by its tensors' specs, ``(shape, dtype)`` or ``(shape, dtype, compressible)``; a setting is
:data:`UNCOMPRESSED` or a codec string of :func:`lightning_clapping.codecs.get_codec`. :func:`message_bytes` gives
the size of that message on the wire (the codec's ``payload_nbytes``, the raw bytes of what it does not compress,
and the layout of :mod:`lightning_clapping.comm.wire`). The probe and the choice both count with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import torch

from lightning_clapping.codecs import get_codec
from lightning_clapping.comm.wire import message_nbytes, raw_payload_nbytes

UNCOMPRESSED = "uncompressed"
DIRECTIONS = ("fwd", "bwd")

#: one tensor of a message: (shape, dtype) or (shape, dtype, compressible); non-floating tensors are never compressed
TensorSpec = Union[tuple[Sequence[int], torch.dtype], tuple[Sequence[int], torch.dtype, bool]]
MessageShapes = Mapping[int, Mapping[str, Sequence[TensorSpec]]]
#: ``{boundary: {direction: {setting: (sender seconds, receiver seconds)}}}``: codec work of one message
CodecTimes = Mapping[int, Mapping[str, Mapping[str, tuple[float, float]]]]


def spec_of(spec: TensorSpec) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """``(shape, dtype, compressible)`` of a spec; a tensor that is not floating is never compressible."""
    if len(spec) == 2:
        shape, dtype = spec
        compressible = True
    else:
        shape, dtype, compressible = spec
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"a tensor spec is (shape, torch dtype[, compressible]), got {spec!r}")
    return tuple(int(d) for d in shape), dtype, bool(compressible) and dtype.is_floating_point


def message_bytes(specs: Sequence[TensorSpec], setting: str) -> int:
    """Bytes on the wire of one message holding tensors of ``specs`` under ``setting`` (``"uncompressed"`` or a
    codec string): the codec's payloads (the raw bytes of tensors it does not compress) plus the header."""
    codec = None if setting == UNCOMPRESSED else get_codec(setting)
    parts = []
    for spec in specs:
        shape, dtype, compressible = spec_of(spec)
        if codec is None or not compressible:
            parts.append((shape, raw_payload_nbytes(shape, dtype)))
        else:
            parts.append((shape, codec.payload_nbytes(shape, dtype)))
    return message_nbytes(parts)
