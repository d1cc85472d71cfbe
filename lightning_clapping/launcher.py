"""How the processes start, and how a hung one is noticed.

Every process runs the user's script (``start_method="popen"``, as ``python train.py``, torchrun or SLURM do); spawn
and fork are refused. A model that cannot be trained as a pipeline is refused in the launching process, before any
other process starts. Once the processes are connected, each starts the liveness watchdog
(:mod:`lightning_clapping.comm.liveness`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_clapping import _compat
from lightning_clapping.comm import liveness
from lightning_clapping.comm.placement import Placement

SPAWN_REFUSED = (
    "ClappingStrategy launches one process per stage by re-running your script (start_method='popen', as "
    "`python train.py`, torchrun or SLURM do). {how} is refused: a spawned or forked run copies back only rank 0's "
    "weights when it ends, so a model cut into stages would silently come back with most of its weights untrained."
)


def refuse_spawn(start_method: str) -> None:
    """Only ``"popen"``: the reason is in :data:`SPAWN_REFUSED`."""
    if start_method != "popen":
        raise ValueError(SPAWN_REFUSED.format(how=f"start_method={start_method!r}"))


class ClappingLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's script launcher, with the model checked before any process starts.

    ``check_model(model, partition)`` raises with what to change; ``partition=False`` when the model builds its
    layers in ``configure_model()`` (they do not exist yet: it is cut in ``setup()``, on every rank).
    """

    def __init__(self, check_model: Callable[[pl.LightningModule, bool], Any], *args: Any) -> None:
        super().__init__(*args)
        self._check_model = check_model

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        if model is None and trainer is not None:
            model = trainer.lightning_module
        if model is not None:
            self._check_model(model, not is_overridden("configure_model", model))
        return super().launch(function, *args, trainer=trainer, **kwargs)


def start_watchdog(placement: Placement, bound: timedelta, cluster_environment: Any) -> liveness.Watchdog:
    """This rank's heartbeat and the watch over the others' (``bound``: the silence after which one is hung)."""
    seconds = bound.total_seconds()
    # which rank serves the store (none under torchrun: its agent does) comes from the launcher's variables
    return liveness.Watchdog(
        _compat.default_store(), placement.global_rank, placement.num_ranks, stage_of_rank=placement.stage_of_rank,
        interval=min(1.0, seconds / 8), bound=seconds, store_rank=liveness.store_rank_from_env(),
    ).start()
