"""Splitting a batch into micro-batches and putting step outputs back together."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_clapping._compat import tree_flatten, tree_unflatten


def split_batch(batch: Any, n: int) -> tuple[list[Any], list[int]]:
    """Cut every tensor of ``batch`` whose first dimension is the batch size into ``min(n, batch size)`` parts.

    Other entries (tensors of another length, numbers, strings) are repeated in every micro-batch. The split is
    deterministic: the same batch always gives the same micro-batches in the same order.
    """
    leaves, spec = tree_flatten(batch)
    sizes = [x.shape[0] for x in leaves if isinstance(x, Tensor) and x.dim() > 0]
    if not sizes:
        raise ValueError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor with a "
            "batch dimension"
        )
    total = sizes[0]
    parts = min(n, total)
    pieces = [
        x.tensor_split(parts) if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == total else None
        for x in leaves
    ]
    micro = []
    for j in range(parts):
        micro.append(tree_unflatten([p[j] if p is not None else x for p, x in zip(pieces, leaves)], spec))
    base, extra = divmod(total, parts)
    counts = [base + (1 if j < extra else 0) for j in range(parts)]
    return micro, counts


def merge_outputs(outputs: list[Any], sizes: list[int]) -> Any:
    """One step output from per-micro-batch outputs.

    Tensors with a batch dimension are concatenated, scalars are averaged weighted by micro-batch size, dicts are
    merged key by key, and anything else is returned as the list of per-micro-batch values.
    """
    if not outputs:
        return None
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(o.detach() * (n / total) for o, n in zip(outputs, sizes))
        return torch.cat([o.detach() if o.requires_grad else o for o in outputs], dim=0)
    if isinstance(first, dict):
        return {k: merge_outputs([o[k] for o in outputs], sizes) for k in first}
    if first is None:
        return None
    return list(outputs)
