"""Codec names: ``get_codec("q4:group128")`` and friends, and ``register_codec`` for codecs of your own."""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import torch

from lightning_clapping.codecs.base import Codec

__all__ = ["available_codecs", "compression_ratio", "get_codec", "register_codec"]

_FACTORIES: dict[str, Callable[[str | None], Codec]] = {}


def register_codec(prefix: str, factory: Callable[[str | None], Codec], *, replace: bool = False) -> None:
    """Make ``get_codec("<prefix>")`` and ``get_codec("<prefix>:<options>")`` call ``factory(options or None)``."""
    if not isinstance(prefix, str) or not prefix or ":" in prefix or prefix != prefix.strip():
        raise ValueError(f"a codec prefix is a non-empty name without ':' or spaces, got {prefix!r}")
    if prefix in _FACTORIES and not replace:
        raise ValueError(f"codec {prefix!r} is already registered (pass replace=True to override it)")
    _FACTORIES[prefix] = factory


def available_codecs() -> list[str]:
    """Registered prefixes, in registration order."""
    return list(_FACTORIES)


def get_codec(spec: str | Codec) -> Codec:
    """A codec from its string (``"q4:group128:sr"``, ``"topk:0.1+q8"``, ...); a :class:`Codec` passes through."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a codec is given by name or as a Codec instance, got {type(spec).__name__}")
    prefix, colon, options = spec.strip().partition(":")
    factory = _FACTORIES.get(prefix)
    if factory is None:
        if re.fullmatch(r"q\d+", prefix):
            raise ValueError(f"quantizer bits must be 1..8 (q1 ... q8), got {spec!r}")
        raise ValueError(f"unknown codec {spec!r}; known: {', '.join(available_codecs())}")
    return factory(options if colon else None)


def compression_ratio(codec: str | Codec, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> float:
    """float32 bytes of a tensor of ``shape`` divided by the codec's payload bytes for it (dtype as sent)."""
    codec = get_codec(codec)
    fp32_bytes = 4 * math.prod(shape)
    payload = codec.payload_nbytes(shape, dtype)
    if payload == 0:
        return 1.0 if fp32_bytes == 0 else math.inf
    return fp32_bytes / payload


def no_options(name: str, make: Callable[[], Codec]) -> Callable[[str | None], Codec]:
    """A registry factory for a codec that takes no options."""

    def factory(options: str | None) -> Codec:
        if options is not None:
            raise ValueError(f"codec {name!r} takes no options, got {name}:{options}")
        return make()

    return factory
