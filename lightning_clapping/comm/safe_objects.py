"""Python objects between ranks without pickle: a JSON outline plus the tensors' raw bytes.

``torch.distributed``'s object collectives unpickle what a peer sent, which runs any code a crafted message holds.
The engine's collectives after set-up (autotune's measurements and choices, which stage uses a shared parameter,
a full checkpoint's outline, predictions handed to every stage) carry plain data, so they travel here instead:

* :func:`encode` turns a tree of ``dict`` (and ``OrderedDict``) / ``list`` / ``tuple`` / ``str`` / ``int`` /
  ``float`` / ``bool`` / ``None`` / paths / :class:`torch.dtype` / ``torch.Size`` / :class:`~torch.Tensor` into
  UTF-8 JSON (every container tagged, so tuples stay tuples and dict keys keep their type) and the list of its
  tensors; anything else is a ``TypeError`` that names the type, raised before anything is sent.
* :func:`decode` reads it back and raises only :class:`~lightning_clapping.comm.wire.WireError` on bytes that do not
  follow the layout. Tensors come back as the bytes the sender had (same dtype, shape and values).
* :func:`all_gather`, :func:`all_gather_outlines` and :func:`broadcast` move encoded objects as uint8 tensors on
  the group's device (CUDA under NCCL, which carries no CPU tensors), lengths first. An object that cannot be
  encoded on one rank raises ``TypeError`` on every rank, so that none waits for it.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping.comm.wire import DTYPE_CODE, DTYPES, WireError

__all__ = ["all_gather", "all_gather_bytes", "all_gather_outlines", "broadcast", "decode", "encode", "fill",
           "group_device", "outline", "tensor_bytes"]

Group = Any
_MAX_DEPTH = 64


def group_device(group: Group = None) -> torch.device:
    """Where a collective over ``group`` keeps its tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------ the layout
def encode(obj: Any) -> tuple[bytes, list[Tensor]]:
    """``obj`` as (JSON bytes, its tensors in order). A tensor is written as its dtype, shape and position."""
    tensors: list[Tensor] = []

    def enc(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise TypeError(f"objects nested deeper than {_MAX_DEPTH} levels are not sent")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return ["f", repr(x)] if not math.isfinite(x) else x
        if isinstance(x, Tensor):
            if x.dtype not in DTYPE_CODE:
                raise TypeError(f"tensors of dtype {x.dtype} are not sent")
            tensors.append(x)
            return ["X", DTYPE_CODE[x.dtype], list(x.shape)]
        if isinstance(x, torch.dtype):
            if x not in DTYPE_CODE:
                raise TypeError(f"the dtype {x} is not sent")
            return ["d", DTYPE_CODE[x]]
        if isinstance(x, torch.Size):
            return ["S", [int(v) for v in x]]
        if isinstance(x, PurePath):  # checkpoint and log folders
            return ["P", str(x)]
        if type(x) is tuple:
            return ["T", [enc(v, depth + 1) for v in x]]
        if type(x) is list:
            return ["L", [enc(v, depth + 1) for v in x]]
        if type(x) is dict or type(x) is OrderedDict:  # state dicts are OrderedDicts
            tag = "D" if type(x) is dict else "O"
            return [tag, [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        raise TypeError(f"a {type(x).__qualname__} is not sent between ranks (only plain data and tensors)")

    body = enc(obj, 0)
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), tensors


def outline(blob: bytes) -> tuple[Any, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """Read :func:`encode`'s JSON: (the object with ``None`` where its tensors go, their (dtype, shape))."""
    try:
        body = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise WireError(f"an object outline is not valid JSON: {err}") from None
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def dec(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise WireError("an object outline is nested too deeply")
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if not (isinstance(x, list) and len(x) >= 2 and isinstance(x[0], str)):
            raise WireError(f"an object outline holds an untagged value: {str(x)[:60]}")
        tag, args = x[0], x[1:]
        if tag == "f" and len(args) == 1 and args[0] in ("inf", "-inf", "nan"):
            return float(args[0])
        if tag == "X" and len(args) == 2 and _is_index(args[0], len(DTYPES)) and _is_shape(args[1]):
            specs.append((DTYPES[args[0]], tuple(args[1])))
            return _TensorSlot(len(specs) - 1)
        if tag == "d" and len(args) == 1 and _is_index(args[0], len(DTYPES)):
            return DTYPES[args[0]]
        if tag == "S" and len(args) == 1 and _is_shape(args[0]):
            return torch.Size(args[0])
        if tag == "P" and len(args) == 1 and isinstance(args[0], str):
            return Path(args[0])
        if tag in ("T", "L") and len(args) == 1 and isinstance(args[0], list):
            items = [dec(v, depth + 1) for v in args[0]]
            return tuple(items) if tag == "T" else items
        if tag in ("D", "O") and len(args) == 1 and isinstance(args[0], list):
            out = {} if tag == "D" else OrderedDict()
            for pair in args[0]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise WireError("an object outline holds a malformed dict entry")
                key = dec(pair[0], depth + 1)
                if isinstance(key, _TensorSlot):
                    raise WireError("an object outline holds a tensor as a dict key")
                try:
                    out[key] = dec(pair[1], depth + 1)
                except TypeError:  # an unhashable key
                    raise WireError("an object outline holds an unhashable dict key") from None
            return out
        raise WireError(f"an object outline holds an unknown tag {tag!r}")

    return dec(body, 0), specs


def decode(blob: bytes, data: Tensor | bytes | None = None) -> Any:
    """The object :func:`encode` wrote; ``data`` is its tensors' bytes back to back (see :func:`tensor_bytes`)."""
    obj, specs = outline(blob)
    if isinstance(data, (bytes, bytearray)):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    data = torch.empty(0, dtype=torch.uint8) if data is None else data.reshape(-1)
    tensors, pos = [], 0
    for dtype, shape in specs:
        n = math.prod(shape) * _itemsize(dtype)
        if pos + n > data.numel():
            raise WireError(f"an object's tensors need more than the {data.numel()} bytes that came")
        tensors.append(data[pos : pos + n].clone().view(dtype).reshape(shape) if n else
                       torch.empty(shape, dtype=dtype, device=data.device))
        pos += n
    if pos != data.numel():
        raise WireError(f"an object's tensors take {pos} bytes, {data.numel()} came")
    return fill(obj, tensors)


def tensor_bytes(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The tensors' bytes back to back, as one uint8 tensor on ``device``."""
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


class _TensorSlot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def fill(x: Any, tensors: list[Tensor]) -> Any:
    """The object :func:`outline` read, with its tensors put in their places."""
    if isinstance(x, _TensorSlot):
        return tensors[x.index]
    if type(x) is tuple:
        return tuple(fill(v, tensors) for v in x)
    if type(x) is list:
        return [fill(v, tensors) for v in x]
    if type(x) is dict or type(x) is OrderedDict:
        return type(x)((k, fill(v, tensors)) for k, v in x.items())
    return x


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _is_index(x: Any, n: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n


def _is_shape(x: Any) -> bool:
    return (isinstance(x, list) and len(x) <= 32
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**40 for v in x))


# ------------------------------------------------------------------------------------------------ collectives
def _as_tensor(blob: bytes, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if blob else \
        torch.empty(0, dtype=torch.uint8, device=device)


def all_gather_bytes(blob: bytes, group: Group, device: torch.device) -> list[bytes]:
    """Every rank's ``blob`` over ``group``, in group-rank order (all_gather of the lengths, then of the bytes)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(blob)] = _as_tensor(blob, device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, sizes)]


_REFUSED = b"\0"  # starts a refusal instead of an outline (JSON never starts with a NUL byte)


def all_gather_outlines(obj: Any, group: Group = None,
                        device: torch.device | None = None) -> tuple[list[bytes], list[Tensor]]:
    """Every rank's :func:`encode` outline of its ``obj`` (group-rank order; read each with :func:`outline`) and this
    rank's own tensors, which the caller sends as it sees fit (all ranks call)."""
    device = group_device(group) if device is None else device
    try:
        blob, tensors = encode(obj)
    except TypeError as err:
        blob, tensors = _REFUSED + str(err).encode(), []
    blobs = all_gather_bytes(blob, group, device)
    refused = [b[1:].decode(errors="replace") for b in blobs if b.startswith(_REFUSED)]
    if refused:
        raise TypeError(f"an object that is not sent between ranks: {refused[0]}")
    return blobs, tensors


def all_gather(obj: Any, group: Group = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` over ``group``, in group-rank order (all ranks call). Plain data only: an ``obj`` holding
    tensors is a :class:`~lightning_clapping.comm.wire.WireError` on every rank (their bytes are not sent; use
    :func:`broadcast` or :func:`all_gather_outlines`)."""
    blobs, _ = all_gather_outlines(obj, group, device)
    return [decode(b) for b in blobs]


def broadcast(obj: Any, src: int, group: Group = None, device: torch.device | None = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (all ranks call; the others pass anything).

    Three broadcasts: the lengths, the JSON outline, the tensors' bytes. Tensors arrive on ``device`` (default: the
    group's device). A ``TypeError`` from encoding on ``src`` is raised on every rank, so none waits for a
    broadcast that never comes."""
    device = group_device(group) if device is None else device
    me = dist.get_rank()
    blob, data, failure = b"", None, b""
    if me == src:
        try:
            blob, tensors = encode(obj)
            data = tensor_bytes(tensors, device)
        except TypeError as err:
            failure = str(err).encode()
    sizes = torch.tensor([len(blob), 0 if data is None else data.numel(), len(failure)], dtype=torch.int64,
                         device=device)
    dist.broadcast(sizes, src, group=group)
    n_blob, n_data, n_fail = (int(v) for v in sizes.tolist())
    head = _as_tensor(blob + failure, device) if me == src else \
        torch.empty(n_blob + n_fail, dtype=torch.uint8, device=device)
    dist.broadcast(head, src, group=group)
    head_bytes = head.cpu().numpy().tobytes()
    if n_fail:
        raise TypeError(f"rank {src} could not send its object: {head_bytes[n_blob:].decode(errors='replace')}")
    if me != src:
        data = torch.empty(n_data, dtype=torch.uint8, device=device)
    if n_data:
        dist.broadcast(data, src, group=group)
    return obj if me == src else decode(head_bytes[:n_blob], data)
