"""Precision plugins under the pipeline: which ones work, and one loss-scale decision for all stages.

``bf16-mixed``, ``bf16-true``, ``16-true`` and ``32-true`` need nothing of the pipeline beyond what Lightning does:
autocast (or the converted module) covers the step, and messages carry whatever dtype the boundary tensors have.

``16-mixed`` uses a :class:`torch.amp.GradScaler`. Under one process the scaler multiplies the loss by its scale,
unscales the gradients before the optimizer step, skips the step when it finds inf/NaN in them and then halves the
scale (or grows it after enough clean steps). In a pipeline every stage holds its own scaler and sees only its own
gradients, so an overflow in one stage would make that stage skip while the others step, and the scales would drift
apart. :class:`SharedLossScale` makes the decision collective: right after each ``unscale_`` it combines the
found-inf flags with an ``all_reduce`` (MAX) over a process group (default: the whole world, every stage), so every
stage skips or steps together and every scaler's scale stays the same.

Since the pipeline runs the backward inside ``training_step``, the loss is scaled there too (Lightning's
``pre_backward`` scales a loss nobody differentiates any more): :func:`scale_loss_weights` folds the scale into the
per-micro-batch loss weights, and the scaled gradients cross the boundaries as they would inside one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping import _compat

_FP16_MIXED = ("16-mixed", "16")


def grad_scaler(plugin: Any) -> Any:
    """The plugin's enabled :class:`torch.amp.GradScaler`, or None (every precision but ``16-mixed``)."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def check_plugin(plugin: Any, variant: str) -> None:
    """Refuse the precision settings the pipeline cannot run, saying what to change."""
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision not in _FP16_MIXED:
        return
    if getattr(plugin, "scaler", None) is None:
        raise ValueError(
            f"precision='16-mixed' needs a gradient scaler, but the precision plugin {type(plugin).__name__} has none "
            "(no `scaler` attribute): use Lightning's MixedPrecision plugin, or precision='bf16-mixed'."
        )
    if variant != "uncompressed":
        raise ValueError(
            f"precision='16-mixed' with variant={variant!r}: a step whose scaled gradients overflow sends inf/NaN "
            "backward, which the codecs cannot compress. Use precision='bf16-mixed' (no loss scaling) with a "
            "compressed variant, or variant='uncompressed' with '16-mixed'."
        )


def scale_loss_weights(plugin: Any, weights: list[float], device: torch.device, optimizers: list[Any],
                       group: Any = None) -> list[float]:
    """The micro-batch loss weights times the loss scale (unchanged without a scaler).

    With a scaler, also makes sure its overflow decision is shared over ``group`` (default: the whole world), see
    :class:`SharedLossScale`. Every rank must call this in every training step.
    """
    scaler = grad_scaler(plugin)
    if scaler is None:
        return weights
    for optimizer in optimizers:
        if _compat.optimizer_handles_unscaling(optimizer):
            raise ValueError(
                f"precision='16-mixed' with {type(_compat.unwrap_optimizer(optimizer)).__name__}(fused=True): a fused "
                "optimizer unscales inside its step, where the stages' overflow checks cannot be combined, so one "
                "stage could step while another skips. Create the optimizer with fused=False."
            )
    SharedLossScale.install(scaler, device, group)
    scale = float(scaler.scale(torch.ones((), device=device)))  # the first call creates the scale tensor
    return [w * scale for w in weights]


class SharedLossScale:
    """Wraps a scaler's ``unscale_`` so that its found-inf flags are the maximum over ``group``.

    After the wrapped ``unscale_(optimizer)`` every rank of ``group`` holds the same flag for that optimizer: 1 if
    any rank found inf/NaN in its gradients. ``scaler.step`` then skips on all of them or on none, and
    ``scaler.update`` moves all scales alike. A rank whose optimizer had no gradients gets a flag too (the scaler
    refuses to step or update without one). Every rank of ``group`` must call ``unscale_`` at the same point; under
    Lightning, MixedPrecision's ``optimizer_step`` does, once per optimizer step.
    """

    def __init__(self, scaler: Any, device: torch.device, group: Any = None) -> None:
        self.scaler = scaler
        self.device = device
        self.group = group
        self.original = scaler.unscale_
        #: steps in which this rank's own gradients were finite but another rank's were not (it skipped with them)
        self.skipped_for_others = 0

    @classmethod
    def install(cls, scaler: Any, device: torch.device, group: Any = None) -> SharedLossScale:
        """Wrap ``scaler.unscale_`` once (an instance attribute); a later call returns the same wrapper."""
        current = scaler.__dict__.get("unscale_")
        shared = getattr(current, "shared_loss_scale", None)
        if shared is not None:
            shared.device, shared.group = device, group
            return shared
        shared = cls(scaler, device, group)

        def unscale_(optimizer: Any) -> None:
            shared.original(optimizer)
            shared.combine(optimizer)

        unscale_.shared_loss_scale = shared
        scaler.unscale_ = unscale_
        return shared

    def combine(self, optimizer: Any) -> None:
        flags = _compat.found_inf_per_device(self.scaler, optimizer)
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for flag in flags.values():
            local = torch.maximum(local, flag.to(self.device, torch.float32).reshape(()))
        combined = local.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self.group)
        if bool(combined > local):
            self.skipped_for_others += 1
        for flag in flags.values():
            flag.copy_(combined.to(flag.device, flag.dtype).reshape(flag.shape))
        if not flags:
            flags[self.device] = combined


__all__ = ["SharedLossScale", "check_plugin", "grad_scaler", "scale_loss_weights"]
