"""The bytes of a state handed to a rejoining replica: a JSON tree and raw tensor bytes, never a pickle.

``encode(state)`` turns a nested state (dicts with ``str``/``int`` keys, lists, tuples, tensors, ``None``, booleans,
numbers, strings) into one byte string; ``decode(data)`` gives it back. The layout::

    b"CLFT1" | u64 little-endian header length | JSON header | tensor bytes

The header is ``{"tree": node, "tensors": [[dtype name, shape, byte offset, byte length], ...]}``. A node is a JSON
scalar (``null``, ``true``, a number, a string) or one single-key object: ``{"l": [...]}`` a list, ``{"t": [...]}``
a tuple, ``{"d": [[key, value], ...]}`` a dict, ``{"T": i}`` the i-th tensor. Tensors are copied to the CPU and
sent contiguous. ``decode`` checks every field and raises :class:`~lightning_clapping.comm.wire.WireError` on any
other layout; an object of another type raises ``TypeError`` in ``encode``, on the sending side.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from lightning_clapping.comm.wire import WireError

MAGIC = b"CLFT1"
_LENGTH = struct.Struct("<Q")
_MAX_DEPTH = 64
#: the dtypes a state may hold, by name (the name is what travels)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def encode(state: Any) -> bytes:
    """One byte string for ``state`` (see the module docstring)."""
    tensors: list[torch.Tensor] = []

    def node(obj: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise TypeError(f"the state is nested deeper than {_MAX_DEPTH} levels")
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, torch.Tensor):
            if obj.dtype not in DTYPES.values():
                raise TypeError(f"a tensor of dtype {obj.dtype} cannot be sent to a rejoining replica")
            tensors.append(obj.detach().to("cpu").contiguous())
            return {"T": len(tensors) - 1}
        if type(obj) is tuple:
            return {"t": [node(x, depth + 1) for x in obj]}
        if isinstance(obj, (list, tuple)):
            return {"l": [node(x, depth + 1) for x in obj]}
        if isinstance(obj, dict):
            bad = [k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool)]
            if bad:
                raise TypeError(f"a state dict key must be a str or an int, got {bad[0]!r}")
            return {"d": [[k, node(v, depth + 1)] for k, v in obj.items()]}
        raise TypeError(
            f"a {type(obj).__name__} cannot be sent to a rejoining replica: states hold tensors, numbers, strings, "
            "None and lists/tuples/dicts of them (a scheduler or callback keeping other objects in its state_dict "
            "cannot be healed from a peer)"
        )

    tree = node(state, 0)
    table, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        table.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
        offset += nbytes
    header = json.dumps({"tree": tree, "tensors": table}, separators=(",", ":")).encode()
    body = bytearray(len(MAGIC) + _LENGTH.size + len(header) + offset)
    body[: len(MAGIC)] = MAGIC
    _LENGTH.pack_into(body, len(MAGIC), len(header))
    start = len(MAGIC) + _LENGTH.size
    body[start:start + len(header)] = header
    pos = start + len(header)
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        body[pos:pos + len(raw)] = raw
        pos += len(raw)
    return bytes(body)


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
        raise WireError(f"{where}: header of {length} bytes in a message of {len(data)}")
    try:
        header = json.loads(data[start:start + length].decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise WireError(f"{where}: header is not JSON ({err})") from None
    if not isinstance(header, dict) or set(header) != {"tree", "tensors"} or not isinstance(header["tensors"], list):
        raise WireError(f"{where}: header must hold exactly 'tree' and 'tensors'")
    body = data[start + length:]
    tensors = [_tensor(entry, body, where) for entry in header["tensors"]]
    used: set[int] = set()

    def node(obj: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise WireError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj
        if not isinstance(obj, dict) or len(obj) != 1:
            raise WireError(f"{where}: a node is a scalar or a one-key object, got {type(obj).__name__}")
        (tag, value), = obj.items()
        if tag == "T":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tensors) or value in used:
                raise WireError(f"{where}: tensor reference {value!r} is not one of {len(tensors)} unused tensors")
            used.add(value)
            return tensors[value]
        if tag in ("l", "t") and isinstance(value, list):
            items = [node(x, depth + 1) for x in value]
            return items if tag == "l" else tuple(items)
        if tag == "d" and isinstance(value, list):
            out = {}
            for pair in value:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], (str, int)) or isinstance(
                        pair[0], bool):
                    raise WireError(f"{where}: a dict item is [str or int key, node]")
                out[pair[0]] = node(pair[1], depth + 1)
            return out
        raise WireError(f"{where}: unknown node {tag!r}")

    state = node(header["tree"], 0)
    if len(used) != len(tensors):
        raise WireError(f"{where}: {len(tensors) - len(used)} tensors are not referenced by the tree")
    return state


def _tensor(entry: Any, body: bytes, where: str) -> torch.Tensor:
    ok = isinstance(entry, list) and len(entry) == 4 and entry[0] in DTYPES and isinstance(entry[1], list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry[1]) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry[2:])
    if not ok:
        raise WireError(f"{where}: a tensor entry is [dtype name, shape, offset, bytes], got {str(entry)[:80]}")
    name, shape, offset, nbytes = entry
    dtype = DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != nbytes or offset + nbytes > len(body):
        raise WireError(f"{where}: tensor {name}{shape} of {nbytes} bytes at {offset} does not fit the message")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(body[offset:offset + nbytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
