"""The byte format of a message between stages: how it is laid out, built and read back.

Every message between stages is ONE ``uint8`` tensor handed to ``torch.distributed``::

    header   16 bytes  magic "CL", version, kind, number of parts, reserved, total length
    parts    16 bytes each + 8 per dimension: codec id, dtype, ndim, flags, reserved, payload bytes, shape
    (padding to 8 bytes)
    payloads each the codec's packed bytes, padded to 8 bytes

So the bytes a channel counts are exactly the bytes that crossed the process boundary, and a compressed payload
travels as its packed bytes, never as floats. All integers are little-endian.

Two kinds of message share the header:

* a **data** message (:data:`KIND_DATA`, built by :func:`pack`, read by :func:`unpack`) carries parts;
* a **resize** message (:data:`KIND_RESIZE`, built by :func:`resize_message`, read by :func:`announced_size`) has no
  parts and its length field announces the size of the message that follows it (the protocol that uses it is
  :class:`lightning_clapping.comm.channel.PeerChannel`'s). It is sent at the size the receiver expects, zero-padded.

A part's codec id says how its payload is to be read (the wire form): :data:`RAW`, :data:`CODEC`, :data:`FULL` and
:data:`SKIP` are the forms of the error-feedback rules (:mod:`lightning_clapping.codecs.feedback` says when each is
used and what each payload holds), :data:`ATTACHMENT` the step's results that ride on the last gradient message of
a step (:func:`results_part`: their length as 8 bytes, the bytes, zeros up to a multiple of 256 bytes so that the
message keeps its size from step to step). The only flag is :data:`FLAG_REQUIRES_GRAD` (the receiver makes the
tensor a leaf that requires grad).

The receiver trusts nothing it reads: every header field is checked (and every announced size bounded) before it is
used, and a malformed message raises :class:`WireError` naming the message (e.g. "boundary 1, backward,
micro-batch 3"), never another exception, an allocation of the announced size or a receive that aborts gloo.

Why this module knows the framing and nothing else: it sits below the codecs and the rules (``comm/`` imports no
``codecs/`` and no ``pipeline/``). Whether a payload is what a codec makes is the codec's to say
(:class:`PayloadCodec`), whether a part is one a rule can have sent is the rule's (:class:`MessageDecoder`); the
entry points here (:func:`decode_payload`, :func:`decode_message`) call them through those two small interfaces and
turn what they refuse into a :class:`WireError` naming the message, so a new codec or rule needs no change here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from lightning_clapping.bitpack import pack_bits, packed_nbytes, unpack_bits

MAGIC = b"CL"
VERSION = 2  # 2: a torch.bool tensor's RAW payload is one bit per value
KIND_DATA = 0
KIND_RESIZE = 1
_HEAD = struct.Struct("<2sBBHHQ")  # magic, version, kind, parts, reserved, total bytes
_PART = struct.Struct("<BBBBIQ")  # codec, dtype, ndim, flags, reserved, payload bytes
_DIM = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")  # the length that starts an attachment
HEADER_BYTES = _HEAD.size
FLAG_REQUIRES_GRAD = 1
KNOWN_FLAGS = FLAG_REQUIRES_GRAD
MAX_NDIM = 16
#: default cap on the size a resize message may announce (``PeerChannel(max_message_bytes=...)`` overrides it)
MAX_MESSAGE_BYTES = 4 << 30

#: the wire forms of a part (its codec id); see :mod:`lightning_clapping.codecs.feedback`
RAW, CODEC, FULL, SKIP = 0, 1, 2, 3
#: the forms a message rule decodes
RULE_FORMS = (RAW, CODEC, FULL, SKIP)
#: codec id of the step's results (loss, logged values) appended to the last gradient message of a step
ATTACHMENT = 255
_ATTACHMENT_ALIGN = 256  # results are padded to this, so their message keeps its size from step to step

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES.append(getattr(torch, _name))
DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
#: the dtypes a message can carry, by their code on the wire
DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPES)


class WireError(RuntimeError):
    """A message did not have the expected layout: the two ends disagree about the protocol."""


def _fail(what: str, where: str | None) -> NoReturn:
    raise WireError(f"{where}: {what}" if where else what)


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class Part:
    """One tensor inside a message, in its encoded form."""

    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload: torch.Tensor  # 1-D uint8
    flags: int = 0


def raw_payload_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of the RAW (or FULL) payload of a tensor: its own bytes, except ``torch.bool``, sent as one bit per value
    (an attention mask that crosses a cut travels 8x smaller, without loss)."""
    n = math.prod(shape)
    return packed_nbytes(n, 1) if dtype == torch.bool else n * dtype.itemsize


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own bytes as a flat uint8 view (a copy only when it is not contiguous); a bool tensor's values
    packed one bit each (:func:`~lightning_clapping.bitpack.pack_bits`)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:  # ne(0): a bool made by a view may hold any non-zero byte for True
        return pack_bits(t.reshape(-1).view(torch.uint8).ne(0).view(torch.uint8), 1)
    return t.reshape(-1).view(torch.uint8)


def from_raw_bytes(payload: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`raw_bytes` (``payload`` holds ``raw_payload_nbytes(shape, dtype)`` bytes)."""
    if dtype == torch.bool:
        return unpack_bits(payload, math.prod(shape), 1).view(torch.bool).reshape(shape)
    return payload.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------- building messages
def pack(parts: list[Part], device: torch.device | None = None) -> torch.Tensor:
    """Lay out ``parts`` as one data message."""
    meta = bytearray()
    for p in parts:
        meta += _PART.pack(p.codec, DTYPE_CODE[p.dtype], len(p.shape), p.flags, 0, p.payload.numel())
        for d in p.shape:
            meta += _DIM.pack(d)
    head_len = _align(HEADER_BYTES + len(meta))
    offsets, total = [], head_len
    for p in parts:
        offsets.append(total)
        total += _align(p.payload.numel())
    total = max(total, HEADER_BYTES)
    device = device or (parts[0].payload.device if parts else torch.device("cpu"))
    msg = torch.zeros(total, dtype=torch.uint8, device=device) if total <= 4096 else torch.empty(
        total, dtype=torch.uint8, device=device
    )
    head = _HEAD.pack(MAGIC, VERSION, KIND_DATA, len(parts), 0, total) + bytes(meta)
    msg[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    for p, off in zip(parts, offsets):
        n = p.payload.numel()
        msg[off : off + n] = p.payload
    return msg


def message_nbytes(parts: list[tuple[tuple[int, ...], int]]) -> int:
    """Size of a data message holding tensors of these (shape, payload bytes), without building it."""
    head = HEADER_BYTES + sum(_PART.size + _DIM.size * len(shape) for shape, _ in parts)
    return max(_align(head) + sum(_align(n) for _, n in parts), HEADER_BYTES)


def raw_nbytes(t: torch.Tensor) -> int:
    """A tensor's payload uncompressed: floating tensors as float32, the others as they are sent (bool: a bit each)."""
    if t.dtype.is_floating_point:
        return 4 * t.numel()
    return raw_payload_nbytes(t.shape, t.dtype)


def uncompressed_nbytes(tensors: Sequence[torch.Tensor], attachment: Part | None = None) -> int:
    """Size the message of ``tensors`` would have uncompressed, floating tensors as float32 (and ``attachment``,
    the step's results, as it is): what a compressed message is compared with."""
    parts = [(tuple(t.shape), raw_nbytes(t)) for t in tensors]
    if attachment is not None:
        parts.append((attachment.shape, attachment.payload.numel()))
    return message_nbytes(parts)


def resize_message(announced: int, length: int, device: torch.device) -> torch.Tensor:
    """A message of ``length`` bytes that tells the receiver the next message has ``announced`` bytes."""
    msg = torch.zeros(max(length, HEADER_BYTES), dtype=torch.uint8, device=device)
    head = _HEAD.pack(MAGIC, VERSION, KIND_RESIZE, 0, 0, announced)
    msg[:HEADER_BYTES] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return msg


def results_part(blob: bytes) -> Part:
    """``blob`` (the step's results) as the last part of a message: its length, the bytes, zeros up to a multiple of
    256 bytes."""
    size = -(-(len(blob) + _LENGTH.size) // _ATTACHMENT_ALIGN) * _ATTACHMENT_ALIGN
    buf = bytearray(size)
    _LENGTH.pack_into(buf, 0, len(blob))
    buf[_LENGTH.size : _LENGTH.size + len(blob)] = blob
    return Part(ATTACHMENT, torch.uint8, (size,), torch.frombuffer(buf, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- reading messages
def read_header(msg: torch.Tensor, where: str | None = None) -> tuple[int, int, int]:
    """(kind, number of parts, total length) of a message; ``where`` names the message in errors."""
    if not isinstance(msg, torch.Tensor) or msg.dtype != torch.uint8 or msg.dim() != 1:
        _fail(f"a message is a 1-D torch.uint8 tensor, got {getattr(msg, 'dtype', type(msg).__name__)}", where)
    if msg.numel() < HEADER_BYTES:
        _fail(f"message of {msg.numel()} bytes is shorter than the {HEADER_BYTES}-byte header", where)
    magic, version, kind, nparts, reserved, total = _HEAD.unpack(msg[:HEADER_BYTES].cpu().numpy().tobytes())
    if magic != MAGIC or version != VERSION:
        _fail(f"not a lightning-clapping message (magic {magic!r}, version {version})", where)
    if kind not in (KIND_DATA, KIND_RESIZE) or reserved:
        _fail(f"unknown message kind {kind} or reserved field {reserved} (not 0)", where)
    return kind, nparts, total


def announced_size(msg: torch.Tensor, max_message_bytes: int, where: str | None = None) -> int | None:
    """None for a data message; for a resize message the size it announces, checked before anything is allocated
    or received (a short buffer would abort gloo, a huge one the host): a multiple of 8 bytes in
    [:data:`HEADER_BYTES`, ``max_message_bytes``]."""
    kind, nparts, total = read_header(msg, where)
    if kind != KIND_RESIZE:
        return None
    if nparts or total < HEADER_BYTES or total % 8 or total > max_message_bytes:
        _fail(f"resize message announces {total} bytes ({nparts} parts); a message has a multiple of 8 "
              f"bytes in [{HEADER_BYTES}, max_message_bytes={max_message_bytes}]", where)
    return total


def _descriptor(raw: bytes, pos: int, known_codecs: Container[int] | None) -> tuple | str:
    """The part descriptor at ``pos``: (codec, dtype, shape, flags, payload bytes, end), or what is wrong with it."""
    if pos + _PART.size > len(raw):
        return "descriptor runs past the end of the message"
    codec, dcode, ndim, flags, reserved, nbytes = _PART.unpack_from(raw, pos)
    end = pos + _PART.size + _DIM.size * ndim
    if dcode >= len(_DTYPES):
        return f"unknown dtype code {dcode}"
    if ndim > MAX_NDIM:
        return f"{ndim} dimensions (at most {MAX_NDIM})"
    if end > len(raw):
        return f"its {ndim} dimensions run past the end of the message"
    if flags & ~KNOWN_FLAGS:
        return f"unknown flags {flags:#x}"
    if reserved:
        return f"reserved field is {reserved}, not 0"
    if known_codecs is not None and codec not in known_codecs:
        return f"unknown codec id {codec}"
    shape = struct.unpack_from(f"<{ndim}q", raw, pos + _PART.size)
    if min(shape, default=0) < 0 or math.prod(shape) >= 1 << 63:
        return f"bad shape {shape} (negative dimension or too many elements)"
    return codec, _DTYPES[dcode], shape, flags, nbytes, end


def unpack(msg: torch.Tensor, *, known_codecs: Container[int] | None = None, expected_parts: int | None = None,
           where: str | None = None) -> list[Part]:
    """The parts of a data message; payloads are views into ``msg``.

    Raises :class:`WireError` (naming ``where``) for anything but a well-formed data message: ``known_codecs`` are
    the codec ids the receiver understands, ``expected_parts`` the number of tensors it expects (None: any).
    """
    kind, nparts, total = read_header(msg, where)
    if kind != KIND_DATA:
        _fail(f"expected a data message, got kind {kind}", where)
    if total != msg.numel():
        _fail(f"message says {total} bytes but {msg.numel()} arrived", where)
    if expected_parts is not None and nparts != expected_parts:
        _fail(f"message has {nparts} parts, expected {expected_parts}", where)
    # descriptors are variable-length; read enough of the head to parse them (never past the message)
    raw = msg[: min(total, HEADER_BYTES + nparts * (_PART.size + _DIM.size * MAX_NDIM))].cpu().numpy().tobytes()
    pos = HEADER_BYTES
    descs = []
    for i in range(nparts):
        desc = _descriptor(raw, pos, known_codecs)
        if isinstance(desc, str):
            _fail(f"part {i} of {nparts}: {desc}", where)
        descs.append(desc[:5])
        pos = desc[5]
    off = _align(pos)
    parts = []
    for i, (codec, dtype, shape, flags, nbytes) in enumerate(descs):
        if off + nbytes > total:
            _fail(f"part {i} of {nparts}: payload of {nbytes} bytes at byte {off} runs past the {total}-byte message",
                  where)
        parts.append(Part(codec, dtype, shape, msg[off : off + nbytes], flags))
        off += _align(nbytes)
    if off != total:
        _fail(f"message parts end at byte {off}, header says {total}", where)
    return parts


def results_of(parts: list[Part], where: str) -> bytes:
    """Remove the results part from ``parts`` (it must be the last, and the only one) and return its bytes."""
    found = [i for i, p in enumerate(parts) if p.codec == ATTACHMENT]
    if found != [len(parts) - 1]:
        raise WireError(f"{where}: expected the step results as the last part, found them at parts {found}")
    part = parts.pop()
    raw = part.payload.cpu().numpy().tobytes()
    length = _LENGTH.unpack_from(raw)[0] if len(raw) >= _LENGTH.size else -1
    if part.dtype != torch.uint8 or part.shape != (len(raw),) or not 0 <= length <= len(raw) - _LENGTH.size:
        raise WireError(f"{where}: malformed step results ({len(raw)} bytes announcing {length})")
    return raw[_LENGTH.size : _LENGTH.size + length]


# ------------------------------------------------------------------------------------------ decoding what arrived
#: what a codec or a rule may raise on bytes that passed the checks below but still make no sense to it; the
#: decode entry points turn these into WireError
DECODE_ERRORS = (RuntimeError, ValueError, IndexError, KeyError, TypeError, OverflowError, ZeroDivisionError)
FORM_NAMES = {RAW: "RAW", CODEC: "CODEC", FULL: "FULL", SKIP: "SKIP", ATTACHMENT: "ATTACHMENT"}


class PayloadCodec(Protocol):
    """What the wire asks of a codec (every :class:`lightning_clapping.codecs.Codec` is one)."""

    name: str

    def check_received(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                       indices: bool | None = None) -> None:
        """Raise ValueError saying what is wrong unless ``payload`` is what this codec makes of a tensor of
        ``shape`` and ``dtype`` (``indices``: also check what the decoder would index with; None: where an
        out-of-bounds index would not raise but abort, i.e. off the CPU)."""

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int: ...

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> torch.Tensor: ...

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype, *,
               seed: int = 0) -> torch.Tensor: ...


class MessageDecoder(Protocol):
    """What the wire asks of the receiving end of a boundary (every
    :class:`lightning_clapping.codecs.feedback.MessageRule` is one)."""

    variant: str

    def check_part(self, slot: int, k: int, part: Part, ctx: Any) -> None:
        """Raise ValueError saying what is wrong unless ``part`` (tensor ``k`` of micro-batch ``slot``) is one this
        rule's sender can have sent at the step ``ctx``: its form, its payload, the state it relies on."""

    def decode(self, slot: int, parts: list[Part], ctx: Any) -> list[torch.Tensor]: ...


def check_codec_payload(codec: PayloadCodec, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
                        where: str | None = None, indices: bool | None = None) -> None:
    """Raise :class:`WireError` unless ``payload`` is what ``codec`` makes of a tensor of ``shape`` and ``dtype``, as
    the codec's :meth:`~PayloadCodec.check_received` says (for the built-in codecs: a floating dtype, exactly
    :meth:`~lightning_clapping.codecs.Codec.payload_nbytes` bytes, and with ``indices`` top-k's flat indices inside
    the tensor; ``indices=None`` checks them where an index past the end would abort the process, off the CPU)."""
    try:
        codec.check_received(payload, shape, dtype, indices=indices)
    except DECODE_ERRORS as err:
        _fail(f"{codec.name} payload for shape {tuple(shape)} {dtype}: {err}", where)


def decode_payload(codec: PayloadCodec, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                   seed: int, where: str | None = None) -> torch.Tensor:
    """The tensor a codec payload that arrived from a peer stands for. Checked first
    (:func:`check_codec_payload`); anything malformed raises :class:`WireError` naming the codec and ``where``."""
    check_codec_payload(codec, payload, shape, dtype, where)
    try:
        return codec.decode(payload, torch.Size(shape), dtype, seed=seed)
    except DECODE_ERRORS as err:
        _fail(f"{codec.name} payload for shape {tuple(shape)} {dtype} could not be decoded ({err})", where)


def decode_message(rule: MessageDecoder, slot: int, parts: list[Part], ctx: Any,
                   where: str | None = None) -> list[torch.Tensor]:
    """The tensors of a data message's ``parts`` (from :func:`unpack`, results removed), decoded by ``rule`` (the
    receiving :class:`~lightning_clapping.codecs.feedback.MessageRule`) for micro-batch ``slot`` of the step
    ``ctx``: the one way a received message becomes tensors.

    Before the rule decodes them, it checks every part against what its sender can have sent
    (:meth:`~MessageDecoder.check_part`: the form, the payload's length, the state the form relies on); what it
    refuses, and what it or its codec still raise while decoding, is re-raised as :class:`WireError` naming the
    message, the part and its form."""
    for k, p in enumerate(parts):
        try:
            rule.check_part(slot, k, p, ctx)
        except DECODE_ERRORS as err:
            _fail(f"part {k} of {len(parts)} ({FORM_NAMES.get(p.codec, p.codec)}): {err}", where)
    try:
        return rule.decode(slot, parts, ctx)
    except DECODE_ERRORS as err:
        forms = ", ".join(FORM_NAMES.get(p.codec, str(p.codec)) for p in parts)
        _fail(f"parts ({forms}) could not be decoded by the {rule.variant} rule ({type(err).__name__}: {err})", where)
