"""Which operations draw random numbers, and custom autograd Functions applied to values that crossed a cut.

Both serve :mod:`lightning_clapping.pipeline.crossings`: a random draw in the parent's code is not batch-only (each
stage's generator is elsewhere), so it is made by one stage and sent; and ``Function.apply``, which no torch function
mode sees, must get the real values of a later stage's crossing values, or its output hangs off a placeholder in
autograd and its gradient never reaches the stage that made the value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: operations that draw from a random generator (by the last part of their name); dropout-like ones only when they
#: are in training mode with a positive probability (see :func:`draws`)
_RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial",
    "normal", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "_sample_binomial", "gumbel_softmax",
    "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
    "native_dropout", "_fused_dropout",
})
_DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                      "feature_dropout", "rrelu", "rrelu_", "dropout_", "alpha_dropout_", "feature_alpha_dropout_"})


def draws(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the operation ``name`` draws random numbers with these arguments (dropout only while training with
    ``p > 0``; ``rrelu`` only while training)."""
    last = name.rpartition(".")[2]
    if last in _RANDOM:
        return True
    if last not in _DROPOUT:
        return False
    if last.startswith("rrelu"):
        training = kwargs.get("training", args[3] if len(args) > 3 else False)
        return bool(training)
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return bool(training) and float(p) > 0


def is_random(name: str) -> bool:
    """Whether ``name`` (an operation's name as :func:`op_name` gives it) is one that draws random numbers."""
    last = name.rpartition(".")[2]
    return last in _RANDOM or last in _DROPOUT


_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


@contextmanager
def apply_with_real_values(c: Any) -> Iterator[None]:
    """While a micro-batch runs: ``Function.apply`` from this stage's own code (after its entry, outside its modules,
    whose arguments are real already) gets the real values of tainted arguments (see the module docstring)."""
    original = _FUNCTION_APPLY.__func__

    def apply(cls, *args, **kwargs):
        if c.active and c.inside and not c.unit_depth:
            args, kwargs = c.real_values((args, kwargs), f"`{cls.__name__}.apply`")
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = _FUNCTION_APPLY  # type: ignore[method-assign]


__all__ = ["apply_with_real_values", "draws", "is_random"]
