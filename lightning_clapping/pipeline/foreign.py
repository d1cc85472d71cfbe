"""Code outside the step that mixes another stage's tensors with this stage's: refused, never silently wrong.

A stage holds only its own parameters and buffers; every other stage's are placeholders on the meta device, which
hold no values. Inside the step the pipeline handles them (the modules of other stages are skipped). In the
LightningModule's hooks around the step, user code runs as written, and code that reads the whole model there (a
mean teacher or BYOL target updated as a moving average of the student in ``on_train_batch_end``, a norm of all
parameters) would compute with placeholders: ``real.add_(meta)`` leaves the real tensor as it was without an error,
so the teacher silently decays. :class:`ForeignStateGuard` follows the hook's torch operations and raises on the
first one that takes a placeholder of another stage together with a tensor that holds values, naming the hook, the
tensor and the stage that holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


class ForeignStateError(RuntimeError):
    """A hook mixed another stage's placeholder tensor with this stage's tensors."""


def _tensors(args: Iterable[Any]) -> Iterable[Tensor]:
    for x in args:
        if isinstance(x, Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (y for y in x if isinstance(y, Tensor))


class ForeignStateGuard:
    """Refuses, inside the hooks it wraps (:meth:`wrap`), an operation that mixes a placeholder of another stage's
    state with real tensors. ``stage_of`` maps state-dict keys to the stage that holds them."""

    def __init__(self, module: nn.Module, stage: int, stage_of: dict[str, int | None]) -> None:
        self.module = module
        self.stage = stage
        self.stage_of = stage_of

    def _foreign(self) -> dict[int, str]:
        """Placeholders of other stages' tensors, by id (read at every hook call: a restore may replace tensors)."""
        named = [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers()]
        return {id(t): k for k, t in named
                if t.device.type == "meta" and self.stage_of.get(k) not in (None, self.stage)}

    def wrap(self, hook: str, original: Callable) -> Callable:
        guard = self

        def guarded(*args: Any, **kwargs: Any) -> Any:
            with _Mode(guard, hook, guard._foreign()):
                return original(*args, **kwargs)

        return guarded


class _Mode(TorchFunctionMode):
    def __init__(self, guard: ForeignStateGuard, hook: str, foreign: dict[int, str]) -> None:
        super().__init__()
        self.guard, self.hook, self.foreign = guard, hook, foreign

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.foreign:
            tensors = list(_tensors((*args, *kwargs.values())))
            placeholder = next((self.foreign[id(t)] for t in tensors if id(t) in self.foreign), None)
            if placeholder is not None and any(t.device.type != "meta" for t in tensors):
                g = self.guard
                raise ForeignStateError(
                    f"{self.hook} uses {placeholder!r} together with stage {g.stage}'s own tensors, but that tensor "
                    f"is held by stage {g.stage_of[placeholder]}: on stage {g.stage} it is a placeholder without "
                    "values (the meta device), so the result would be silently wrong. Code in the LightningModule's"
                    " hooks that reads the whole model (a mean teacher or BYOL target updated as a moving average of the "
                    "student, a norm over all parameters) cannot run on a pipeline stage, which holds only its own "
                    "part: compute what it needs inside training_step (values crossing the cut are sent), or train "
                    "this model without the pipeline (DDP, FSDP).")
        return func(*args, **kwargs)


#: the LightningModule's hooks around the training step that the guard covers (when the module overrides them)
GUARDED_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                 "on_before_optimizer_step", "on_before_zero_grad", "on_train_epoch_start",
                 "on_train_epoch_end")

__all__ = ["ForeignStateError", "ForeignStateGuard", "GUARDED_HOOKS"]
