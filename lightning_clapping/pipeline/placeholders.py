"""What a stage computes in place of a module that an earlier stage runs: placeholders of the right shape.

A stage skips the modules of earlier stages, but the parent's code around them still runs, so each skipped call
returns placeholders shaped like the module's output (NaN where a step sends, a finite stand-in in the pass that finds
the crossing values: see :meth:`~lightning_clapping.pipeline.stage.StageRunner._stub`). The shapes come from running
the module on the meta device (:func:`run_on_meta`), or on fake tensors where that fails (:func:`run_on_fake`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_clapping._compat import FakeTensorMode, tree_unflatten


def run_on_meta(original: Callable, leaves: list, spec: Any) -> Any:
    """Run the unit on meta tensors; under ``torch.device("meta")`` the tensors its forward creates without
    ``device=`` (causal masks, position ids, rotary tables, ``torch.full``, ``randn``) are meta tensors too."""
    meta = [x.to("meta") if isinstance(x, Tensor) else x for x in leaves]
    margs, mkwargs = tree_unflatten(meta, spec)
    with torch.no_grad(), torch.device("meta"):
        return original(*margs, **mkwargs)


def run_on_fake(unit: nn.Module, original: Callable, leaves: list, spec: Any, device: torch.device | None) -> Any:
    """Run the unit on fake tensors of the stage's device: what the meta device cannot run but fake tensors can.

    Fake tensors carry a device, so a tensor made with an explicit ``device="cpu"`` or kept as a plain (non-buffer)
    attribute mixes with them, and small constants built in forward (``torch.tensor(d).rsqrt().item()``, which
    the meta device cannot read) keep their values. The unit's own parameters and buffers (on the meta device,
    released by this stage) are swapped for fake ones of the stage's device for the call, through the module's
    ``_parameters`` / ``_buffers`` dicts (so no hooks run and nothing is registered), and put back after. Code that
    reads the values of its inputs (``.item()``, ``.tolist()``, ``nonzero``, ``if x.sum() > 0``) still fails.
    """
    device = device if device is not None else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, Tensor]] = []
    try:
        with torch.no_grad(), mode:
            fakes: dict[int, Tensor] = {}  # by id: tied tensors stay tied

            def fake_of(t: Tensor) -> Tensor:
                if id(t) not in fakes:
                    fakes[id(t)] = (torch.empty(t.shape, dtype=t.dtype, device=device) if t.device.type == "meta"
                                    else mode.from_tensor(t))
                return fakes[id(t)]

            for mod in unit.modules():
                for store in (mod._parameters, mod._buffers):
                    for k, t in store.items():
                        if t is not None and t.device.type == "meta":
                            swapped.append((store, k, t))
                            store[k] = fake_of(t)
            fleaves = [fake_of(x) if isinstance(x, Tensor) else x for x in leaves]
            fargs, fkwargs = tree_unflatten(fleaves, spec)
            return original(*fargs, **fkwargs)
    finally:
        for store, k, t in reversed(swapped):
            store[k] = t


def signature(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if x is None or isinstance(x, (bool, int, float, str)):
        return (type(x).__name__, x)
    return (type(x).__name__,)


def placeholder(shape: tuple, dtype: torch.dtype, device: torch.device | None, fill: float = math.nan) -> Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


__all__ = ["placeholder", "run_on_fake", "run_on_meta", "signature"]
