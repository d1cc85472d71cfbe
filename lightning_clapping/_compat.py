"""Every private name this package takes from Lightning or torch, in one place.

Lightning's strategy API needs a few private pieces (the script launcher, the process-group bootstrap, the
optimizer-to-device helper) and torch's pytree utilities are private too. Keeping them here means a Lightning or
torch upgrade that moves one of them breaks exactly one file. The tested range is pinned in ``pyproject.toml``.

The engine's sub-packages (pipeline, comm, codecs, checkpoint, autotune, lazy) import only torch's names from here;
Lightning's private names are imported on first use (module ``__getattr__``), so importing this module imports no
Lightning and the engine stays free of it (``tests/test_layout.py``).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.checkpoint.default_planner import (  # noqa: F401
    _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_state_dict  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401 - stage.py: shapes of skipped modules
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: F401 - materialize.py: a storage's identity
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401


#: Lightning's private names, imported on first use (see :func:`__getattr__`)
LIGHTNING_NAMES = (
    "all_gather_if_available", "distributed_is_initialized", "default_backend_for_device", "init_dist_connection",
    "sync_if_available", "optimizers_to_device", "reset_seed", "SubprocessScriptLauncher",
)


def __getattr__(name: str):
    """Lightning's private names, imported when first asked for (never by the Lightning-free engine)."""
    if name not in LIGHTNING_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning.fabric.utilities.distributed import (
        _all_gather_ddp_if_available as all_gather_if_available,
        _distributed_is_initialized as distributed_is_initialized,
        _get_default_process_group_backend_for_device as default_backend_for_device,
        _init_dist_connection as init_dist_connection,
        _sync_ddp_if_available as sync_if_available,
    )
    from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as SubprocessScriptLauncher,
    )

    found = locals()
    globals().update({n: found[n] for n in LIGHTNING_NAMES})
    return found[name]


def tree_map_tensors(fn, tree):
    """``fn`` applied to every tensor of a nested structure (torch's private pytree)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) if isinstance(x, Tensor) else x for x in leaves], spec)



def default_store():
    """The process group's rendezvous key-value store (private ``_get_default_store``); None without one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def restore_weights_only(module, weights_only):
    """The ``weights_only`` a checkpoint restore should use. Lightning 2.6's ``Trainer._run`` drops the one given to
    ``fit``/``validate``/``test``/``predict`` when the strategy restores after setup (it calls private
    ``_restore_modules_and_callbacks(ckpt_path)`` without it), so it is read from that call's frame; ``weights_only``
    itself when given, or when no such frame is found."""
    import sys

    trainer = getattr(module, "_trainer", None)
    if weights_only is not None or trainer is None:
        return weights_only
    runs = [cls.__dict__["_run"] for cls in type(trainer).__mro__ if "_run" in cls.__dict__]
    codes = {getattr(run, "__code__", None) for run in runs}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


def accelerator_connector(trainer):
    """The trainer's private ``_accelerator_connector``, whose ``use_distributed_sampler`` the data connector reads."""
    return trainer._accelerator_connector


def kernel_device_patches(module, device) -> list[tuple[object, str, str]]:
    """(model, attribute, value) for every Hugging Face model inside ``module``: the device its kernels are chosen for.

    transformers (5.x, with the ``kernels`` package installed) chooses a pretrained model's kernels again whenever
    ``train()``/``eval()`` changes its mode, for the device of its first parameter unless its private
    ``_kernels_device`` names one. On a stage that does not hold that parameter (the embeddings) it lies on the meta
    device, which the chooser refuses, so the first validation of a model in training mode would fail there.
    """
    return [(m, "_kernels_device", device.type) for m in module.modules()
            if isinstance(getattr(type(m), "kernels_mode", None), property)]


def set_metric_step_value(metric, value) -> None:
    """Lightning reads a logged torchmetrics Metric's per-step value from its private ``_forward_cache``."""
    metric._forward_cache = value


__all__ = [
    "EmptyStateDictLoadPlanner",
    "FakeTensorMode",
    "StorageWeakRef",
    "accelerator_connector",
    "restore_weights_only",
    "default_store",
    "dcp_load_state_dict",
    "kernel_device_patches",
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
    "tree_map_tensors",
    "tree_unflatten",
]


# --------------------------------------------------------------------------------------------------------------------
# The fit loop's hold on the train loader (used by lightning_clapping.data; Lightning reads a train loader's length
# once, lazy epochs differ in length, and checkpoints must be taken at the batch the loop has consumed)


def training_batch(trainer, batch):
    """``batch`` prepared as the fit loop prepares a training batch: the precision plugin's ``convert_input``, the
    ``on_before_batch_transfer`` hook (the module's or the datamodule's: private ``_on_before_batch_transfer``), then
    the strategy's ``batch_to_device`` (``transfer_batch_to_device`` and ``on_after_batch_transfer``)."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def fit_combined_loader(trainer):
    """The fit loop's CombinedLoader (private ``fit_loop._combined_loader``): where the running train loader sits."""
    return trainer.fit_loop._combined_loader


def loader_wrapper_children(obj) -> list:
    """Where a wrapper keeps its loader: ``loader``, ``dataloader``, private ``_dataloader`` (Fabric) or ``_loader``."""
    return [getattr(obj, name, None) for name in ("loader", "dataloader", "_loader", "_dataloader")]


def train_batches_ready(trainer) -> int:
    """Batches the fit loop took this epoch (``epoch_loop.batch_progress.current.ready``): where to checkpoint from."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def set_train_epoch_length(trainer, length: int) -> bool:
    """Lazy epochs vary: set ``fit_loop.max_batches``, limits, private ``_data_fetcher.length`` (False: unchanged)."""
    fit_loop = trainer.fit_loop
    if fit_loop.max_batches == length:
        return False
    fit_loop._combined_loader.limits = [length]
    fit_loop.max_batches = length
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and getattr(fetcher, "length", None) is not None:
        fetcher.length = length
    return True


def rescale_val_check_batch(trainer, length: int) -> None:
    """Refit ``trainer.val_check_batch`` to a new epoch length for a float interval (not with private time checks)."""
    interval = trainer.val_check_interval
    if (
        isinstance(interval, float)
        and getattr(trainer, "_val_check_time_interval", None) is None
        and trainer.val_check_batch not in (None, float("inf"))
    ):
        trainer.val_check_batch = max(1, int(length * interval))


__all__ += [
    "fit_combined_loader",
    "loader_wrapper_children",
    "rescale_val_check_batch",
    "set_train_epoch_length",
    "train_batches_ready",
]


def should_accumulate(trainer) -> bool:
    """Whether this training step only accumulates gradients (the fit loop's private ``_should_accumulate``)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def sigterm_without_collectives(trainer) -> list[tuple[object, str, object]]:
    """(object, attribute, value) patches that keep Lightning's SIGTERM handling from running collectives.

    With ``trainer.world_size > 1`` Lightning broadcasts its SIGTERM flag from rank 0 at every training step and from
    its signal handler (private ``_broadcast_sigterm_tensor`` and ``_sigterm_notifier_fn``): a world-wide collective
    per step, and one that a stage blocked in a pipeline transfer would never join. Each process of a preempted run
    gets the signal from the launcher or the scheduler itself; what stays is what Lightning does for one process.
    """
    connector = trainer._signal_connector

    def notifier(signum, frame) -> None:
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        connector.received_sigterm = True

    return [(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", lambda: None),
            (connector, "_sigterm_notifier_fn", notifier)]


__all__ += ["should_accumulate", "sigterm_without_collectives"]


# --------------------------------------------------------------------------------------------------------------------
# Loss scaling under 16-mixed (used by lightning_clapping.precision): the stages' overflow flags are combined between
# the scaler's unscale_ and its step, which torch keeps in a private per-optimizer dict


def found_inf_per_device(scaler, optimizer) -> dict:
    """The scaler's found-inf flags of ``optimizer`` by device (private ``_per_optimizer_states``), the dict itself:
    what ``step`` and ``update`` read after ``unscale_``."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def optimizer_handles_unscaling(optimizer) -> bool:
    """Lightning's private ``_optimizer_handles_unscaling``: a fused optimizer unscales inside its own step."""
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return bool(_optimizer_handles_unscaling(unwrap_optimizer(optimizer)))


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a LightningOptimizer (private ``_optimizer``), or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)


__all__ += ["found_inf_per_device", "optimizer_handles_unscaling", "unwrap_optimizer"]
