"""The bytes of a state handed to a rejoining replica: a JSON outline and raw tensor bytes, never a pickle.

``encode(state)`` turns a nested state (dicts, lists, tuples, tensors, ``None``, booleans, numbers, strings; see
:mod:`lightning_clapping.comm.safe_objects`, which writes and reads the outline) into one byte string;
``decode(data)`` gives it back. The layout::

    b"CLFT1" | u64 little-endian outline length | JSON outline | the tensors' bytes, back to back

Tensors are copied to the CPU. ``decode`` checks every field and raises
:class:`~lightning_clapping.comm.wire.WireError` on any other layout; an object of another type raises
``TypeError`` in ``encode``, on the sending side.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from lightning_clapping.comm import safe_objects
from lightning_clapping.comm.wire import WireError

MAGIC = b"CLFT1"
_LENGTH = struct.Struct("<Q")


def encode(state: Any) -> bytes:
    """One byte string for ``state`` (see the module docstring)."""
    try:
        outline, tensors = safe_objects.encode(state)
    except TypeError as err:
        raise TypeError(f"{err}: it cannot be sent to a rejoining replica (states hold tensors, numbers, strings, "
                        "None and lists/tuples/dicts of them; a scheduler or callback keeping other objects in its "
                        "state_dict cannot be healed from a peer)") from None
    body = safe_objects.tensor_bytes(tensors, torch.device("cpu")).numpy().tobytes()
    return MAGIC + _LENGTH.pack(len(outline)) + outline + body


def decode(data: bytes) -> Any:
    """The state :func:`encode` wrote; :class:`WireError` on any other bytes."""
    where = "rejoin state"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{where}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        raise WireError(f"{where}: does not start with {MAGIC!r}")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > len(data) - start:
        raise WireError(f"{where}: outline of {length} bytes in a message of {len(data)}")
    try:
        return safe_objects.decode(data[start:start + length], data[start + length:])
    except WireError as err:
        raise WireError(f"{where}: {err}") from None
