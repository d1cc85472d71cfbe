"""The byte layout of a step's results (loss, logged values, batch fingerprint): built and read without pickle.

The last stage sends these bytes to every earlier stage with the step's last gradient message
(:func:`lightning_clapping.comm.wire.results_part`). They are read with the same distrust as the rest of a message:
every count and length is checked against the bytes that are left, every tag against the ones this layout has,
and anything else raises :class:`~lightning_clapping.comm.wire.WireError`. Nothing is unpickled and no name is
looked up from the bytes, so a crafted attachment can at worst be refused. All integers are little-endian::

    header    magic "CR", version (u8), flags (u8: 1 = a loss, 2 = a fingerprint), number of log records (u32)
    loss      float64                                         (if flag 1)
    print     count (u32), then that many u64                 (if flag 2: the batch fingerprint)
    records   each: name      length (u16) + UTF-8
                    value     form (u8: 0 a Python number, 1 a tensor), dtype code (u8, as in ``wire``), ndim (u8),
                              shape (ndim x i64), payload length (u32, = elements x item size), the raw bytes
                    options   count (u8), each: key (u8, its index in :data:`OPTION_NAMES`), tag (u8,
                              :data:`_NONE` ... :data:`_FN`) and its value
                    metric    0 (u8), or 1 then the attribute name (u32 length + UTF-8) and the step value (float64)

A record is what :meth:`lightning_clapping.log_relay.LogRelay.to_wire` makes of one ``self.log`` call:
``(name, value, options, metric)``. ``value`` is a Python ``float``, ``int`` or ``bool`` (sent as a 0-d float64,
int64 or bool tensor and read back as the same Python type) or a tensor (any dtype of the wire's table, any
shape; read back on the CPU). ``options`` are the non-default keyword arguments of ``self.log``: ``None``,
``bool``, ``int``, ``float``, ``str``, or as ``reduce_fx`` one of torch's or Python's ``sum``/``max``/``min`` or
``torch.mean`` (Lightning accepts no other reduction). ``metric`` is ``None``, or for a torchmetrics ``Metric``
``(attribute name, its value at this step)``. A value or option of any other type is refused when the results
are packed, with the name of the log key.
"""

from __future__ import annotations

import builtins
import math
import struct
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from lightning_clapping.comm.wire import DTYPE_CODE, DTYPES, MAX_NDIM, WireError

MAGIC = b"CR"
VERSION = 1
_HAS_LOSS, _HAS_FINGERPRINT = 1, 2
_HEAD = struct.Struct("<2sBBI")
_U8, _U16, _U32, _U64, _I64, _F64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q", "<q", "<d"))
_NUMBER, _TENSOR = 0, 1  # the forms of a value
_NUMBER_DTYPES = {float: torch.float64, int: torch.int64, bool: torch.bool}
_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _FN = range(7)  # the tags of an option's value
#: the reductions an option may name (``reduce_fx``), by their index on the wire
_FUNCTIONS = (torch.mean, torch.sum, torch.max, torch.min, builtins.sum, builtins.max, builtins.min)
#: the keyword arguments of ``LightningModule.log`` a record may carry, by their index on the wire (new ones go at
#: the end; :func:`pack` refuses a keyword that is not here)
OPTION_NAMES = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "sync_dist",
                "sync_dist_group", "add_dataloader_idx", "batch_size", "metric_attribute", "rank_zero_only")
_OPTION_INDEX = {name: i for i, name in enumerate(OPTION_NAMES)}
WHERE = "step results"


# ---------------------------------------------------------------------------------------------------- packing
def pack(loss: float | None, logs: Sequence[tuple[str, Any, dict[str, Any], Any]] | None,
         fingerprint: Sequence[int] | None) -> bytes:
    """The bytes of a step's results; raises ``TypeError``/``ValueError`` naming the log key of a value that this
    layout cannot carry."""
    logs = list(logs or [])
    out = bytearray(_HEAD.pack(MAGIC, VERSION, (loss is not None) * _HAS_LOSS
                               + (fingerprint is not None) * _HAS_FINGERPRINT, len(logs)))
    if loss is not None:
        out += _F64.pack(float(loss))
    if fingerprint is not None:
        out += _U32.pack(len(fingerprint))
        for v in fingerprint:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
                raise ValueError(f"a batch fingerprint holds unsigned 64-bit integers, got {v!r}")
            out += _U64.pack(v)
    for record in logs:
        _pack_record(out, record)
    return bytes(out)


def _pack_record(out: bytearray, record: Any) -> None:
    if not isinstance(record, (tuple, list)) or len(record) != 4 or not isinstance(record[0], str):
        raise TypeError(f"a log record is (name, value, options, metric), got {record!r}")
    name, value, options, metric = record

    def refuse(what: str) -> NoReturn:
        raise TypeError(f"self.log({name!r}, ...): {what} cannot be sent to the other stages. Log a float, an int, "
                        "a bool, a tensor or a torchmetrics Metric, with options that are None, bool, int, float or "
                        "str (reduce_fx: 'mean', 'sum', 'max', 'min' or torch's functions of those names)")

    _put_str(out, name, _U16)
    if isinstance(value, torch.Tensor):
        tensor, form = value.detach().cpu().contiguous(), _TENSOR
        if tensor.dtype not in DTYPE_CODE or tensor.dim() > MAX_NDIM:
            refuse(f"a tensor of {tensor.dtype} with {tensor.dim()} dimensions")
    elif type(value) in _NUMBER_DTYPES:
        if type(value) is int and not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"self.log({name!r}, ...): the integer {value} does not fit in 64 bits")
        tensor, form = torch.tensor(value, dtype=_NUMBER_DTYPES[type(value)]), _NUMBER
    else:
        refuse(f"a value of type {type(value).__name__}")
    out += bytes([form, DTYPE_CODE[tensor.dtype], tensor.dim()])
    for d in tensor.shape:
        out += _I64.pack(d)
    payload = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    if len(payload) >= 1 << 32:
        raise ValueError(f"self.log({name!r}, ...): a tensor of {len(payload)} bytes is too large to log")
    out += _U32.pack(len(payload)) + payload
    if not isinstance(options, dict) or len(options) > 255:
        refuse(f"options {options!r}")
    out += _U8.pack(len(options))
    for key, v in options.items():
        if key not in _OPTION_INDEX:
            refuse(f"the option {key!r} (not a parameter of LightningModule.log this layout knows)")
        out.append(_OPTION_INDEX[key])
        if v is None or isinstance(v, bool):
            out.append({None: _NONE, False: _FALSE, True: _TRUE}[v])
        elif type(v) is int and -(1 << 63) <= v < 1 << 63:
            out += bytes([_INT]) + _I64.pack(v)
        elif type(v) is float:
            out += bytes([_FLOAT]) + _F64.pack(v)
        elif type(v) is str:
            out.append(_STR)
            _put_str(out, v, _U32)
        elif any(v is f for f in _FUNCTIONS):
            out += bytes([_FN, next(i for i, f in enumerate(_FUNCTIONS) if v is f)])
        else:
            refuse(f"the option {key}={v!r}")
    if metric is None:
        out.append(0)
    elif isinstance(metric, (tuple, list)) and len(metric) == 2 and isinstance(metric[0], str) \
            and type(metric[1]) in (float, int):
        out.append(1)
        _put_str(out, metric[0], _U32)
        out += _F64.pack(float(metric[1]))
    else:
        refuse(f"the metric entry {metric!r} (expected (attribute name, step value))")


def _put_str(out: bytearray, text: str, length: struct.Struct) -> None:
    data = text.encode("utf-8")
    if len(data) >= 1 << (8 * length.size):
        raise ValueError(f"{text[:40]!r}...: {len(data)} bytes is too long for the step results")
    out += length.pack(len(data)) + data


# ---------------------------------------------------------------------------------------------------- reading
class _Reader:
    """Reads fields off ``blob``, refusing (WireError) any that would run past its end."""

    def __init__(self, blob: bytes) -> None:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise WireError(f"{WHERE}: expected bytes, got {type(blob).__name__}")
        self.blob, self.pos = bytes(blob), 0

    def fail(self, what: str) -> NoReturn:
        raise WireError(f"{WHERE}: {what} (at byte {self.pos} of {len(self.blob)})")

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.blob) - self.pos:
            self.fail(f"{what} of {n} bytes runs past the end")
        self.pos += n
        return self.blob[self.pos - n : self.pos]

    def field(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack(self.take(fmt.size, what))[0]

    def text(self, length: struct.Struct, what: str) -> str:
        raw = self.take(self.field(length, f"length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")


def unpack(blob: bytes) -> tuple[float | None, list[tuple[str, Any, dict[str, Any], Any]], tuple[int, ...] | None]:
    """(loss, log records, fingerprint) from :func:`pack`'s bytes; :class:`WireError` for anything else."""
    r = _Reader(blob)
    magic, version, flags, count = _HEAD.unpack(r.take(_HEAD.size, "header"))
    if magic != MAGIC or version != VERSION:
        r.fail(f"not step results of this version (magic {magic!r}, version {version}; expected {MAGIC!r}, "
               f"{VERSION}): both ends must run the same lightning-clapping")
    if flags & ~(_HAS_LOSS | _HAS_FINGERPRINT):
        r.fail(f"unknown flags {flags:#x}")
    loss = r.field(_F64, "loss") if flags & _HAS_LOSS else None
    fingerprint = None
    if flags & _HAS_FINGERPRINT:
        n = r.field(_U32, "fingerprint length")
        fingerprint = struct.unpack(f"<{n}Q", r.take(8 * n, f"fingerprint of {n} values"))
    logs = [_read_record(r, i, count) for i in range(count)]  # each record takes >= 11 bytes: a bad count fails fast
    if r.pos != len(r.blob):
        r.fail(f"{len(r.blob) - r.pos} bytes left after {count} records")
    return loss, logs, fingerprint


def _read_record(r: _Reader, i: int, count: int) -> tuple[str, Any, dict[str, Any], Any]:
    at = f"record {i} of {count}"
    name = r.text(_U16, f"{at}: name")
    at = f"{at} ({name!r})"
    form, dcode, ndim = r.take(3, f"{at}: value header")
    if form not in (_NUMBER, _TENSOR) or dcode >= len(DTYPES) or ndim > MAX_NDIM:
        r.fail(f"{at}: value of form {form}, dtype code {dcode}, {ndim} dimensions")
    dtype = DTYPES[dcode]
    shape = struct.unpack(f"<{ndim}q", r.take(8 * ndim, f"{at}: shape"))
    nbytes = r.field(_U32, f"{at}: value length")
    if min(shape, default=0) < 0 or nbytes != math.prod(shape) * dtype.itemsize:
        r.fail(f"{at}: {nbytes} value bytes for shape {shape} of {dtype}")
    raw = r.take(nbytes, f"{at}: value")
    if dtype == torch.bool and raw.translate(None, b"\x00\x01"):
        r.fail(f"{at}: a bool value holds a byte other than 0 and 1")
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    if form == _NUMBER:
        if ndim or dtype not in _NUMBER_DTYPES.values():
            r.fail(f"{at}: a number is a 0-d float64, int64 or bool, got shape {shape} of {dtype}")
        value: Any = tensor.item()
    else:
        value = tensor
    options: dict[str, Any] = {}
    for _ in range(r.field(_U8, f"{at}: option count")):
        index = r.field(_U8, f"{at}: option")
        key = OPTION_NAMES[index] if index < len(OPTION_NAMES) else None
        if key is None or key in options:
            r.fail(f"{at}: option {key or index!r} is unknown, or comes twice")
        options[key] = _read_option(r, f"{at}: option {key!r}")
    has_metric = r.field(_U8, f"{at}: metric flag")
    if has_metric > 1:
        r.fail(f"{at}: metric flag {has_metric}")
    metric = (r.text(_U32, f"{at}: metric attribute"), r.field(_F64, f"{at}: metric step value")) if has_metric else None
    return name, value, options, metric


def _read_option(r: _Reader, at: str) -> Any:
    tag = r.field(_U8, f"{at}: tag")
    if tag in (_NONE, _FALSE, _TRUE):
        return (None, False, True)[tag]
    if tag == _INT:
        return r.field(_I64, at)
    if tag == _FLOAT:
        return r.field(_F64, at)
    if tag == _STR:
        return r.text(_U32, at)
    if tag == _FN:
        index = r.field(_U8, at)
        if index < len(_FUNCTIONS):
            return _FUNCTIONS[index]
        r.fail(f"{at}: unknown reduction {index}")
    r.fail(f"{at}: unknown tag {tag}")
