"""Turning a model built on the meta device into real tensors, one stage at a time.

Big models are built without memory: layers created in ``LightningModule.configure_model()`` or under
``trainer.init_module(empty_init=True)`` land on the meta device (shapes only). Each rank then materializes only the
modules of its own stage: ``to_empty`` allocates them, and the module's own initialisation fills them in:

* ``reset_parameters()`` (what ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, ... have; torch's own
  ``_reset_parameters()`` of ``nn.MultiheadAttention`` and ``nn.Transformer`` counts too), or
* ``init_weights()`` (the name torchtitan-style models use), called with no arguments.

Modules are initialised children first, as eager construction does (a parent's initialisation, e.g.
``nn.MultiheadAttention`` zeroing its output projection's bias, wins over the child's).

Reproducibility: each module's initialisation runs under its own seed, derived from the global seed
(``seed_everything``) and the module's fully qualified name, so a module gets the same weights whatever the number
of stages and whichever rank builds it. :func:`materialize_module` does the same on a whole model in one process;
a plain single-device run that builds the model eagerly draws from one sequential stream instead, so its weights
differ (call :func:`materialize_module` on a meta-built model to start a single-device run from the pipeline's
weights).

Every materialized floating-point tensor is filled with NaN before its module's initialisation, so a parameter or
buffer that the initialisation forgot is caught and named instead of training on uninitialised memory.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn


class MaterializeError(RuntimeError):
    """A meta-built module cannot be materialized; the message names the module and what to add."""


def global_seed() -> int:
    """The seed ``seed_everything`` set (``PL_GLOBAL_SEED``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def module_seed(seed: int, name: str) -> int:
    """A seed for one module's initialisation: the same on every rank and for every partition."""
    return (zlib.crc32(name.encode()) * 0x9E3779B1 + seed * 0x85EBCA77) % (2**63 - 1)


def _direct_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for _, t in _direct_tensors(module))


def _initialiser(module: nn.Module):
    for hook in ("reset_parameters", "_reset_parameters", "init_weights"):
        fn = getattr(module, hook, None)
        if callable(fn):
            return fn
    return None


def materialize(modules: Iterable[tuple[str, nn.Module]], device: torch.device | str, seed: int | None = None) -> int:
    """Allocate and initialise every module of ``(qualified name, module)`` pairs that still holds meta tensors.

    Modules whose tensors are already real are left alone (a second run on the same model, or an eagerly built
    model). Returns the number of modules materialized. torch's global random state is the same afterwards as
    before, so every rank's stream stays in step however much its stage initialised.
    """
    seed = global_seed() if seed is None else seed
    todo = [(name, m) for name, m in modules if _is_meta(m)]
    for name, m in todo:
        fn = _initialiser(m)
        if fn is None:
            what = ", ".join(n for n, _ in _direct_tensors(m))
            raise MaterializeError(
                f"module {name or '<root>'!r} ({type(m).__name__}) was built on the meta device and holds {what}, but "
                "has no reset_parameters() to initialise them once its stage is materialized. Add "
                f"`def reset_parameters(self): ...` to {type(m).__name__} that initialises these tensors (it may "
                "call nn.init functions), or build this module eagerly in __init__ instead of configure_model()."
            )
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for _, t in _direct_tensors(m):
                t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else 0)
    # children first: named_modules() is pre-order, so reversed() visits every child before its parent
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        for name, m in reversed(todo):
            torch.manual_seed(module_seed(seed, name))
            with torch.no_grad():
                _initialiser(m)()
    for name, m in todo:
        for tname, t in _direct_tensors(m):
            if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()):
                full = f"{name}.{tname}" if name else tname
                raise MaterializeError(
                    f"{full!r} is still uninitialised after {type(m).__name__}.{_initialiser(m).__name__}() ran on "
                    "the materialized stage: that method must set every parameter and buffer of its module. "
                    "Initialise it there (buffers computed from constants too, e.g. rotary tables)."
                )
    return len(todo)


def materialize_module(model: nn.Module, device: torch.device | str = "cpu", seed: int | None = None) -> nn.Module:
    """Materialize a whole meta-built model in one process exactly as the pipeline's stages do (same weights)."""
    materialize(model.named_modules(), device, seed)
    return model


__all__ = ["MaterializeError", "global_seed", "materialize", "materialize_module", "module_seed"]
