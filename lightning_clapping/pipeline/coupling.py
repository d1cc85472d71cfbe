"""Losses that couple the samples of a batch see one micro-batch at a time: found once and warned about.

With ``microbatches > 1`` the user's step runs once per micro-batch. A step that mixes samples across the batch (an
in-batch permutation for mixup, ``flip(0)``, ``roll`` along the batch, a contrastive or pairwise loss over ``z @ z.T``)
then mixes the samples of one micro-batch only, which one process with the whole batch does not do. The pass that
finds the crossing values follows every operation of the step's own code; :func:`batch_coupling` reads what it saw
against the micro-batch size and names the first such operation, and the step driver warns once (``microbatches=1``
gives the one-process result).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

_PERMUTATIONS = frozenset({"torch.randperm"})
_ALONG_DIM = frozenset({"torch.flip", "torch.Tensor.flip", "torch.roll", "torch.Tensor.roll"})
_PAIRWISE = frozenset({"torch.matmul", "torch.Tensor.matmul", "torch.Tensor.__matmul__", "torch.mm", "torch.Tensor.mm",
                       "torch.cdist", "torch.einsum", "torch.functional.einsum", "torch.bmm",
                       "torch.nn.functional.cosine_similarity"})


def record(name: str, args: tuple, kwargs: dict, out: Any) -> tuple | None:
    """What :func:`batch_coupling` needs of an operation (None for operations that cannot couple samples)."""
    if name in _PERMUTATIONS and args and isinstance(args[0], int):
        return (name, "size", args[0])
    if name in _ALONG_DIM and args and isinstance(args[0], Tensor):
        at = 1 if name.endswith("flip") else 2  # flip(input, dims), roll(input, shifts, dims=None)
        dims = kwargs["dims"] if "dims" in kwargs else args[at] if len(args) > at else None
        dims = (0,) if dims is None else (dims,) if isinstance(dims, int) else tuple(dims)  # roll without dims: flat
        if 0 in dims or -args[0].dim() in dims:
            return (name, "size", args[0].shape[0])
    if name in _PAIRWISE and isinstance(out, Tensor) and out.dim() >= 2:
        return (name, "square", tuple(out.shape[-2:]))
    return None


def batch_coupling(seen: list[tuple], microbatch_size: int) -> str | None:
    """The first recorded operation that mixes the samples of a micro-batch of ``microbatch_size``, or None."""
    for name, kind, value in seen:
        if kind == "size" and value == microbatch_size:
            return name
        if kind == "square" and value == (microbatch_size, microbatch_size):
            return name
    return None


__all__ = ["batch_coupling", "record"]
