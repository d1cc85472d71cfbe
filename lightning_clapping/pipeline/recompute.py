"""Activation checkpointing inside a stage: chosen submodules keep no activations and recompute them in backward.

The choice (``activation_checkpointing=`` of the strategy) is ``True`` for the model's blocks (the elements of its
block lists, where automatic cuts go) or a set of module classes, as Lightning's FSDP ``activation_checkpointing_policy``.
Each stage wraps only the matching modules that lie inside its own units: a module that spans stages is never wrapped
(its children are, where they match), and of nested matches only the outermost is.

The recompute must see the dropout masks of the original forward: a micro-batch's forward runs under its frozen seed
(``freeze_rng``), but its backward, where the recompute happens, runs outside it. ``torch.utils.checkpoint`` with
``preserve_rng_state=True`` saves the RNG state at the wrapped call and restores it for the recompute, so the
recomputed forward draws exactly what the original drew. Without gradients (evaluation, the shape-only runs of
other stages' modules) the wrapper calls the forward directly.

``torch.utils.checkpoint`` written by the user around a unit's call in the parent's code (``x = checkpoint(blk, x)``
in the loop over blocks) recomputes the unit in backward, outside the micro-batch, with the tensors the parent
passed: placeholders where the stage received or was sent the real ones. The stage's wrapper records what it handed
the unit instead (:func:`remember_substitution`) and hands it again in the recompute (:func:`substitution_again`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_clapping._compat import tree_flatten, tree_unflatten
from lightning_clapping.pipeline.partition import Partition, block_candidates

Policy = bool | frozenset  # True: the model's blocks; a frozenset of nn.Module subclasses


#: on a tensor the forward passed to units whose wrapper gave them another one instead (the received tensor at the
#: entry, a crossing value's real one): unit name -> what the unit got. ``torch.utils.checkpoint`` around a unit's
#: call, in the user's code, keeps the tensors the forward passed and calls the unit with them again in backward,
#: outside the micro-batch; the wrapper then hands the unit what it got the first time.
_STOOD_FOR = "_clapping_stood_for"


def remember_substitution(name: str, given: tuple, used: tuple) -> None:
    if used is given:
        return
    for x, t in zip(tree_flatten(given)[0], tree_flatten(used)[0]):
        if isinstance(x, Tensor) and x is not t:
            stood = x.__dict__.setdefault(_STOOD_FOR, {})
            stood[name] = t


def substitution_again(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor that stood for another in an earlier call of unit ``name`` replaced by it
    (the recompute of a checkpointed call; see :data:`_STOOD_FOR`)."""
    leaves, spec = tree_flatten((args, kwargs))
    found = False
    for i, x in enumerate(leaves):
        stood = getattr(x, _STOOD_FOR, None) if isinstance(x, Tensor) else None
        if stood is not None and name in stood:
            leaves[i], found = stood[name], True
    return tree_unflatten(leaves, spec) if found else (args, kwargs)


def check_policy(value: Any) -> Policy | None:
    """Validate ``activation_checkpointing=``: None/False (off), True, or module classes. Returns the normal form."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    classes = [value] if isinstance(value, type) else value
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        raise TypeError(_bad(value))
    classes = list(classes)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(_bad(value))
    return frozenset(classes)


def _bad(value: Any) -> str:
    return (f"activation_checkpointing must be True (checkpoint each block of the model's block lists), a set of "
            f"nn.Module subclasses such as {{nn.TransformerEncoderLayer}}, or None; got {value!r}")


def targets(module: nn.Module, partition: Partition, stage: int, policy: Policy | None) -> list[str]:
    """Names of the submodules of ``stage`` to checkpoint, outermost matches only."""
    if policy is None:
        return []
    units = [u for u in partition.units_of(stage) if u != ""]
    whole = partition.units_of(stage) == [""]  # one stage: the root is its only unit

    def inside(name: str) -> bool:
        return whole or any(name == u or name.startswith(u + ".") for u in units)

    if policy is True:
        wanted = set(block_candidates(module))
        match: Callable[[str, nn.Module], bool] = lambda name, _: name in wanted
    else:
        classes = tuple(policy)
        match = lambda _, sub: isinstance(sub, classes)  # noqa: E731
    chosen: list[str] = []
    for name, sub in module.named_modules():
        if name == "" or not inside(name) or any(name.startswith(c + ".") for c in chosen):
            continue
        if match(name, sub):
            chosen.append(name)
    return chosen


def wrap(sub: nn.Module) -> Any:
    """Make ``sub``'s forward checkpointed (an instance attribute); returns what :func:`unwrap` needs."""
    saved = sub.__dict__.get("forward")
    forward = sub.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # every input tensor, keyword ones included, is passed positionally: checkpoint saves the RNG state of the
        # devices of its tensor arguments (a GPU's dropout masks, for a block called with keywords only), and the
        # keywords' names could collide with checkpoint's own
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]

        def run(*tensors: Tensor) -> Any:
            filled = list(leaves)
            for i, t in zip(slots, tensors):
                filled[i] = t
            a, k = tree_unflatten(filled, spec)
            return forward(*a, **k)

        return checkpoint(run, *[leaves[i] for i in slots], use_reentrant=False, preserve_rng_state=True)

    sub.forward = checkpointed
    return saved


def unwrap(sub: nn.Module, saved: Any) -> None:
    if saved is None:
        sub.__dict__.pop("forward", None)
    else:
        sub.forward = saved


__all__ = ["Policy", "check_policy", "targets", "unwrap", "wrap"]
