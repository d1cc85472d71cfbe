"""``replica_sync=``: how the data-parallel replicas of each stage agree, chosen by one argument.

* ``"every-step"`` (default, :class:`EveryStep`): each stage's gradients are averaged over its replicas before every
  optimizer step, as under DDP (optionally through a DDP communication hook, ``ddp_comm_hook``).
* ``"lag"`` (:class:`LAG`): Lazily Aggregated Gradients. A replica sends a parameter's gradient innovation only when
  it changed more than the parameters moved lately; the others reuse the stale sum (:mod:`.lag`).
* ``"diloco"`` (:class:`DiLoCo`): local updates. Each replica runs ``inner_steps`` steps of the user's optimizer on
  its own, then the replicas average the change since the last sync and an outer Nesterov SGD applies it
  (:mod:`.local_updates`).

Strings take the defaults; the classes take their constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EveryStep:
    """Average every stage's gradients over its replicas before every optimizer step (the default)."""

    name = "every-step"


@dataclass(frozen=True)
class LAG:
    """LAG's worker-side trigger (LAG-WK) on each parameter tensor of a stage, over its replicas.

    Replica ``r`` sends parameter ``p``'s innovation ``g - g_last`` (``g_last``: the gradient it last sent for ``p``)
    when ``||g - g_last||^2 > threshold / (memory * lr^2) * sum of the last `memory` ||p_(k+1-d) - p_(k-d)||^2``, and
    nothing otherwise; every replica then applies the same stale average. The paper's constants are the defaults:
    ``memory`` D = 10 and ``xi_d = 1 / D`` (``threshold`` = 1). ``lr`` is the step size alpha of the trigger
    (``None``: the optimizer's first parameter group's learning rate at each step). ``threshold=0`` sends every
    changed gradient (every-step averaging, to rounding).

    ``reference="average"`` replaces ``||p_(k+1-d) - p_(k-d)||^2 / lr^2`` by ``||S_(k-d)||^2``, the squared norm of
    the averaged gradient the optimizer stepped with: the same quantity under gradient descent, and one that Adam's
    per-coordinate steps do not inflate (see :mod:`lightning_clapping.sync.lag`).
    """

    threshold: float = 1.0
    memory: int = 10
    lr: float | None = None
    reference: str = "steps"

    name = "lag"


@dataclass(frozen=True)
class DiLoCo:
    """Local updates with an outer step (DiLoCo).

    Every replica runs ``inner_steps`` optimizer steps with the user's optimizer on its own data; then each stage's
    replicas average their change since the last sync (the pseudo-gradient, ``anchor - params``) and an outer
    ``torch.optim.SGD(lr=outer_lr, momentum=momentum, nesterov=nesterov)`` applies it to the anchor, which every
    replica then takes as its parameters. ``fragments`` > 1 (streaming) splits the stage's parameters into that many
    fragments synced at staggered steps (fragment ``f`` at steps ``f * inner_steps / fragments`` past each multiple
    of ``inner_steps``): the same bytes, spread over the interval. ``codec`` (e.g. ``"topk:0.02+q4"``) compresses each
    replica's pseudo-gradient under error feedback; compressed payloads are all-gathered and every replica decodes
    and averages them in replica order, so they stay identical. ``overlap`` > 0 (streaming) lets each sync's
    collective run while the replica takes that many more inner steps, which are kept on top of the new anchor when
    the outer step lands (``overlap < inner_steps``; 0: the step waits for the sync). With ``inner_steps=1``,
    ``outer_lr=1`` and ``momentum=0`` under SGD it is every-step averaging.
    """

    inner_steps: int = 32
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    codec: Any = None
    overlap: int = 0

    name = "diloco"


MODES = {"every-step": EveryStep, "lag": LAG, "diloco": DiLoCo}


def resolve(value: Any) -> EveryStep | LAG | DiLoCo:
    """The checked ``replica_sync`` argument: a mode name or one of the classes above."""
    if value is None:
        return EveryStep()
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"replica_sync={value!r} is not a mode: use one of {sorted(MODES)}, or LAG(...) / "
                             "DiLoCo(...) from lightning_clapping for their constants")
        return MODES[value]()
    if isinstance(value, dict) and "mode" in value:  # from a config file: {"mode": "diloco", "inner_steps": 16}
        kwargs = {k: v for k, v in value.items() if k != "mode"}
        return resolve(value["mode"]) if not kwargs else MODES[resolve(value["mode"]).name](**kwargs)
    if isinstance(value, (EveryStep, LAG, DiLoCo)):
        _check(value)
        return value
    raise TypeError(f"replica_sync must be 'every-step', 'lag', 'diloco', LAG(...) or DiLoCo(...); got {value!r}")


def _check(mode: Any) -> None:
    from lightning_clapping.codecs import get_codec

    if isinstance(mode, LAG):
        if mode.threshold < 0 or mode.memory < 1:
            raise ValueError(f"LAG needs threshold >= 0 and memory >= 1, got {mode}")
        if mode.lr is not None and mode.lr <= 0:
            raise ValueError(f"LAG(lr=...) is the trigger's step size and must be > 0, got {mode.lr}")
        if mode.reference not in ("steps", "average"):
            raise ValueError(f"LAG(reference=...) is 'steps' (the paper's) or 'average', got {mode.reference!r}")
    if isinstance(mode, DiLoCo):
        if mode.inner_steps < 1 or mode.fragments < 1 or mode.fragments > mode.inner_steps:
            raise ValueError(f"DiLoCo needs inner_steps >= 1 and 1 <= fragments <= inner_steps, got {mode}")
        if not isinstance(mode.overlap, int) or not 0 <= mode.overlap < mode.inner_steps:
            raise ValueError(f"DiLoCo needs 0 <= overlap < inner_steps (the inner steps a sync runs beside), got {mode}")
        if mode.outer_lr <= 0 or not 0 <= mode.momentum < 1:
            raise ValueError(f"DiLoCo needs outer_lr > 0 and 0 <= momentum < 1, got {mode}")
    codec = getattr(mode, "codec", None)
    if codec is not None:
        try:
            get_codec(codec)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"replica_sync codec {codec!r} is not a codec: {err}") from err
