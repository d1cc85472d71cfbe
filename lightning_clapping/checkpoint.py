"""Whole-model checkpoints from a partitioned model.

Each rank holds its own stage's tensors. For saving, the state (model and optimizer) is gathered to global rank 0,
which writes one ordinary Lightning checkpoint: the full ``state_dict`` under the model's own parameter names, which
``MyModule.load_from_checkpoint(path)`` loads in a single process without this package. For loading, every rank
keeps only the entries of its own stage.

Every rank builds its optimizer over *all* of the module's parameters (other stages' parameters sit on the meta
device and never get a gradient, so optimizers skip them). Optimizer state is therefore indexed by the same global
parameter positions on every rank, and the per-rank states combine into exactly the state a single process would
have, independent of how the model was cut.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def gather_to_zero(local: Any, world_size: int) -> list[Any] | None:
    """All ranks' ``local`` objects on rank 0 (in rank order), ``None`` elsewhere."""
    if world_size == 1 or not dist.is_initialized():
        return [local]
    rank = dist.get_rank()
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(_cpu(local), out, dst=0)
    return out


def merge_model_states(parts: list[dict[str, Tensor]], order: list[str]) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"no stage holds {len(missing)} state entries, e.g. {missing[:5]}")
    return {k: merged[k] for k in order}


def merge_optimizer_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, Any] = {}
    for part in parts:
        state.update(part.get("state", {}))
    merged = dict(parts[0])
    merged["state"] = dict(sorted(state.items()))
    return merged


def owned_indices(optimizer: Optimizer) -> set[int]:
    """Positions (as in ``optimizer.state_dict()``) of the parameters materialized on this rank."""
    out, i = set(), 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type != "meta":
                out.add(i)
            i += 1
    return out


def local_optimizer_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    keep = owned_indices(optimizer)
    local = dict(state_dict)
    local["state"] = {k: v for k, v in state_dict.get("state", {}).items() if int(k) in keep}
    return local


__all__ = [
    "gather_to_zero",
    "local_optimizer_state",
    "merge_model_states",
    "merge_optimizer_states",
    "owned_indices",
]
