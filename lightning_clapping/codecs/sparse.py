"""Sparsifiers: ``topk`` (the largest magnitudes, with their indices) and ``randk`` (positions from the shared seed).

The kept values travel as fp16 (saturating), or quantized by a ``q<b>`` quantizer named after a ``+``:
``topk:0.1+q8`` sends the values' codes and scales instead of fp16 values. The quantizer sees the kept values as
one 1-D tensor in increasing position order, so its default is one scale for all of them; ``+q4:group64`` gives one
scale per 64 kept values, ``+q4:fp16`` sends fp16 scales, ``+q4:sr`` rounds stochastically.
"""

from __future__ import annotations

import abc
import math
from fractions import Fraction
from typing import Sequence

import torch
from torch import Tensor

from lightning_clapping.bitpack import pack_bits, packed_nbytes, unpack_bits
from lightning_clapping.codecs.base import BuiltinCodec, bytes_as, check_finite, require_float, seeded
from lightning_clapping.codecs.quant import QuantCodec
from lightning_clapping.codecs.registry import get_codec

__all__ = ["RandKCodec", "TopKCodec", "sparse_factory"]

_FP16_MAX = 65504.0


def _parse_ratio(text: str | float | Fraction, kind: str) -> Fraction:
    try:
        ratio = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{kind} needs a ratio in (0, 1] such as '{kind}:0.1', got {text!r}") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"{kind} needs a ratio in (0, 1] such as '{kind}:0.1', got {text!r}")
    return ratio


def _values_seed(seed: int) -> int:
    """The seed of the value quantizer's stochastic rounding: not the one randk draws its positions from."""
    return (int(seed) * 6364136223846793005 + 1442695040888963407) & 0xFFFF_FFFF_FFFF_FFFF


class _Sparsifier(BuiltinCodec):
    """Sends ``k = ceil(ratio*n)`` values first in the payload (fp16, or ``values``' payload of them as a 1-D
    tensor); positions not sent decode to 0."""

    kind = ""

    def __init__(self, ratio: str | float | Fraction, values: QuantCodec | None = None):
        if values is not None and not isinstance(values, QuantCodec):
            raise TypeError(f"{self.kind}: kept values are sent as fp16 or by a QuantCodec, got {values!r}")
        self.ratio = _parse_ratio(ratio, self.kind)
        self.values = values
        self.name = f"{self.kind}:{str(ratio).strip()}" + (f"+{values.name}" if values is not None else "")

    def count(self, n: int) -> int:
        """Values kept out of ``n``: ``ceil(ratio * n)`` in exact arithmetic."""
        return math.ceil(self.ratio * n)

    def values_nbytes(self, k: int) -> int:
        """Bytes of ``k`` kept values: ``2k`` as fp16, else the quantizer's payload for shape ``(k,)``."""
        return 2 * k if self.values is None else self.values.payload_nbytes((k,), torch.float32)

    def _encode_values(self, kept: Tensor, out: Tensor, seed: int) -> None:
        if self.values is not None:
            self.values.encode_into(kept, out, seed=_values_seed(seed))
        else:
            out.view(torch.float16).copy_(kept.clamp(-_FP16_MAX, _FP16_MAX))  # saturating, never inf

    @abc.abstractmethod
    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        """The flat positions of the ``k`` values in ``payload`` (on its device)."""

    def _decode_contiguous(self, payload: Tensor, out: Tensor, n: int, seed: int) -> Tensor:
        k = self.count(n)
        out.zero_()
        if k:
            index = self._sent_positions(payload, n, k, seed)
            head = payload[: self.values_nbytes(k)]
            if self.values is None:
                kept = bytes_as(head, torch.float16)
            else:
                kept = self.values.decode(head, torch.Size([k]), out.dtype, seed=_values_seed(seed))
            out.view(-1)[index] = kept.to(out.dtype)
        return out


def _largest(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries (ties broken arbitrarily), like ``topk`` but faster for large inputs.

    A threshold read off a random sample with a safety margin of four standard deviations keeps a candidate set
    that almost surely holds the top k; when it does not (fewer than k candidates), plain topk runs instead.
    """
    n = magnitude.numel()
    if n >= 65536 and 4 * k <= n:
        samples, below = 16384, 1 - k / n
        rank = int(samples * below - 4 * math.sqrt(samples * below * (1 - below)))
        if rank >= 1:
            picks = torch.randint(n, (samples,), generator=seeded(0, magnitude.device), device=magnitude.device)
            threshold = magnitude[picks].kthvalue(rank).values
            candidates = (magnitude >= threshold).nonzero().view(-1)
            if candidates.numel() >= k:  # then every top-k value is >= threshold, i.e. a candidate
                return candidates[magnitude[candidates].topk(k, sorted=False).indices]
    return magnitude.topk(k, sorted=False).indices


class TopKCodec(_Sparsifier):
    """Keeps the ``ceil(ratio*n)`` values of largest magnitude and their flat indices.

    Payload: ``[k values][k indices, ceil(log2 n) bits each, packed by pack_bits]``, indices in increasing order,
    values in that order (fp16, saturating, or the ``values`` quantizer's payload). The positions not sent decode
    to zero.
    """

    kind = "topk"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        n = math.prod(shape)
        k = self.count(n)
        return self.values_nbytes(k) + packed_nbytes(k, max(n - 1, 0).bit_length())

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        require_float(x, self)
        flat = x.detach().reshape(-1)
        n = flat.numel()
        k = self.count(n)
        payload = self._empty_payload(x)
        if k == 0:
            return payload
        check_finite(flat)  # one pass; the sampled threshold of _largest would pass over a NaN
        index = _largest(flat.abs(), k).sort().values
        head = self.values_nbytes(k)
        self._encode_values(flat[index], payload[:head], seed)
        pack_bits(index, (n - 1).bit_length(), out=payload[head:])
        return payload

    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        return unpack_bits(payload[self.values_nbytes(k) :], k, (n - 1).bit_length()).long()

    def check_received(self, payload: Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                       indices: bool | None = None) -> None:
        """As :meth:`Codec.check_received`, and with ``indices`` every flat index inside the tensor.

        An index past the end makes the decoder write out of bounds: on an accelerator a device-side assert that
        ends the process, so ``indices=None`` checks them there; on the CPU an IndexError, which the wire's decode
        entry points turn into a WireError, so the check (a second unpacking of the indices, some 15-40% of a topk
        decode) is left out there."""
        if indices is None:
            indices = payload.device.type != "cpu"
        super().check_received(payload, shape, dtype)
        n = math.prod(shape)
        k = self.count(n) if indices else 0
        if k:
            index = unpack_bits(payload[self.values_nbytes(k):], k, max(n - 1, 0).bit_length())
            top = int(index.max())
            if top >= n:
                raise ValueError(f"flat index {top} is past the tensor's {n} values")


def _random_subset(n: int, k: int, generator: torch.Generator) -> Tensor:
    """A uniformly random k-subset of ``range(n)``, sorted, without a full permutation of ``n`` for small ``k``.

    The distinct values among i.i.d. uniform draws form a uniform random subset of their size; drawing a few more
    than needed and dropping a uniform random subset of the surplus (recursively) leaves a uniform k-subset.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    if 2 * k > n:  # the complement is the smaller problem
        keep = torch.ones(n, dtype=torch.bool)
        keep[_random_subset(n, n - k, generator)] = False
        return keep.nonzero().view(-1)
    if n <= 65536 or 4 * k > n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    draws = math.ceil(-n * math.log1p(-k / n) * 1.02) + 16  # expected distinct count: a little over k
    pool = torch.randint(n, (draws,), generator=generator).unique()
    while pool.numel() < k:
        more = torch.randint(n, (2 * (k - pool.numel()) + 16,), generator=generator)
        pool = torch.cat([pool, more]).unique()
    if pool.numel() > k:
        keep = torch.ones(pool.numel(), dtype=torch.bool)
        keep[_random_subset(pool.numel(), pool.numel() - k, generator)] = False
        pool = pool[keep]
    return pool


class RandKCodec(_Sparsifier):
    """Sends the values at ``ceil(ratio*n)`` distinct positions drawn from the shared seed.

    Sender and receiver draw the same positions from ``seed`` (on the CPU, so devices do not matter), so no index
    is sent: the payload is the kept values alone (fp16, saturating, or the ``values`` quantizer's payload). The
    values are not rescaled by ``n/k``: the codec stays contractive, as error feedback expects. Every value is
    checked for NaN and inf, sent or not.
    """

    kind = "randk"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.values_nbytes(self.count(math.prod(shape)))

    def positions(self, n: int, seed: int) -> Tensor:
        """The ``count(n)`` distinct flat positions for ``seed``, sorted, as a CPU int64 tensor."""
        return _random_subset(n, self.count(n), seeded(seed))

    def encode(self, x: Tensor, *, seed: int = 0) -> Tensor:
        require_float(x, self)
        flat = x.detach().reshape(-1)
        check_finite(flat)
        payload = self._empty_payload(x)
        n = flat.numel()
        if n:
            self._encode_values(flat[self.positions(n, seed).to(x.device)], payload, seed)
        return payload

    def _sent_positions(self, payload: Tensor, n: int, k: int, seed: int) -> Tensor:
        return self.positions(n, seed).to(payload.device)


def sparse_factory(cls: type[_Sparsifier]):
    """The registry factory of ``cls``: options ``<ratio>`` or ``<ratio>+q<b>[:<quantizer options>]``."""

    def factory(options: str | None) -> _Sparsifier:
        if options is None:
            raise ValueError(f"{cls.kind} needs a ratio in (0, 1], e.g. '{cls.kind}:0.1' or '{cls.kind}:0.1+q8'")
        ratio, plus, spec = options.partition("+")
        if not plus:
            return cls(ratio)
        try:
            values = get_codec(spec)
        except ValueError as err:
            raise ValueError(f"bad value quantizer in '{cls.kind}:{options}': {err}") from None
        if not isinstance(values, QuantCodec):
            raise ValueError(
                f"{cls.kind} sends its kept values as fp16 or quantized: after '+' comes a quantizer q1..q8 with "
                f"its options (e.g. '{cls.kind}:{ratio}+q8', '{cls.kind}:{ratio}+q4:group64:fp16'), got {spec!r}"
            )
        return cls(ratio, values)

    return factory
