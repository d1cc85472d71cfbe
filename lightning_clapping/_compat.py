"""Every private name this package takes from Lightning or torch, in one place.

Lightning's strategy API needs a few private pieces (the script launcher, the process-group bootstrap, the
optimizer-to-device helper) and torch's pytree utilities are private too. Keeping them here means a Lightning or
torch upgrade that moves one of them breaks exactly one file. The tested range is pinned in ``pyproject.toml``.
"""

from __future__ import annotations

from lightning.fabric.utilities.distributed import (  # noqa: F401
    _all_gather_ddp_if_available as all_gather_if_available,
    _distributed_is_initialized as distributed_is_initialized,
    _get_default_process_group_backend_for_device as default_backend_for_device,
    _init_dist_connection as init_dist_connection,
    _sync_ddp_if_available as sync_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: F401
from lightning.fabric.utilities.seed import reset_seed  # noqa: F401
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers  # noqa: F401
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: F401
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401



def set_metric_step_value(metric, value) -> None:
    """Lightning reads a logged torchmetrics Metric's per-step value from its private ``_forward_cache``."""
    metric._forward_cache = value


__all__ = [
    "set_metric_step_value",
    "SubprocessScriptLauncher",
    "all_gather_if_available",
    "default_backend_for_device",
    "distributed_is_initialized",
    "init_dist_connection",
    "optimizers_to_device",
    "reset_seed",
    "sync_if_available",
    "tree_flatten",
    "tree_unflatten",
]
