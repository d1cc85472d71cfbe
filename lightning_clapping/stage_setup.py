"""Setting up this rank's stage of the user's model, and undoing at teardown what the run changed.

:func:`check_model` is what can be refused before processes start. :func:`build_stage` runs in ``setup()`` on every
rank: it cuts the model (the same way on every process), warns about cuts that train differently from one device,
builds the :class:`~lightning_clapping.pipeline.stage.StageRunner` of this rank's stage, materializes only that
stage of a meta-built model, and sets the attributes the run needs (on the module, the trainer, the data module) as
:class:`Patches`, which :func:`release_stage` puts back at teardown.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_clapping import _compat
from lightning_clapping import precision
from lightning_clapping.checkpoint.state import gather_to_zero, retie
from lightning_clapping.comm import safe_objects
from lightning_clapping.comm.placement import Placement
from lightning_clapping.data import LazySamplingDataModule
from lightning_clapping.options import ClappingOptions
from lightning_clapping.pipeline.materialize import building_on_meta, materialize
from lightning_clapping.pipeline.partition import Partition, build_partition
from lightning_clapping.pipeline.stage import StageRunner

log = logging.getLogger(__name__)


class Patches:
    """Attributes set for the duration of a run; :meth:`restore` puts the previous values back, last set first."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, bool, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        had, previous = name in obj.__dict__, obj.__dict__.get(name)
        setattr(obj, name, value)
        self._saved.append((obj, name, had, previous))

    def restore(self) -> None:
        for obj, name, had, previous in reversed(self._saved):
            if had:
                setattr(obj, name, previous)
            else:
                obj.__dict__.pop(name, None)
        self._saved.clear()


def check_model(model: pl.LightningModule, precision_plugin: Any, options: ClappingOptions, num_stages: int,
                partition: bool = True) -> Partition | None:
    """Everything that can be checked before processes start: raises with a message that says what to change.

    ``partition=False`` skips cutting the model (its layers may not exist yet: ``configure_model()`` runs later).
    """
    if not model.automatic_optimization:
        raise ValueError(
            "ClappingStrategy supports automatic optimization only: the pipeline runs forward and backward of all "
            "micro-batches inside one training step. Remove `self.automatic_optimization = False` and return the "
            "loss from training_step."
        )
    precision.check_plugin(precision_plugin, options.variant)
    return build_partition(model, num_stages, options.split_points) if partition else None


def build_stage(trainer: pl.Trainer, module: pl.LightningModule, options: ClappingOptions, placement: Placement,
                precision_plugin: Any, schedule: str, patches: Patches) -> tuple[Partition, StageRunner]:
    """Cut the model and build this rank's stage of it (see the module docstring); ``schedule`` is the one that
    runs, for the stage table printed when fitting."""
    partition = check_model(module, precision_plugin, options, placement.num_stages)
    assert partition is not None
    check_same_cuts(partition, placement.num_ranks)
    refuse_weight_averaging(trainer.callbacks, placement.num_stages)
    if trainer.state.fn == TrainerFn.FITTING:
        rank_zero_info(f"ClappingStrategy: {placement.num_stages} stages, schedule {schedule}, "
                       f"{options.microbatches} micro-batches\n{partition.table()}\n{placement.topology.describe()}")
    warn_batchnorm(module, options.microbatches)
    warn_empty_stages(partition, placement.num_stages)
    options.check_codec_boundaries(placement.num_stages)
    runner = StageRunner(module, partition, placement.stage, options.activation_checkpointing)
    runner.release_foreign_state()
    materialize_own_stage(module, partition, placement.stage, placement.device, options.pretrained)
    for obj, name, value in _compat.kernel_device_patches(module, placement.device):
        patches.set(obj, name, value)
    runner.install()
    patches.set(module, "optimizer_zero_grad", None)  # the step driver zeroes the gradients itself
    if placement.num_replicas == 1:
        if options.ddp_comm_hook is not None:
            rank_zero_warn("ddp_comm_hook is ignored: with one pipeline replica there are no gradients to average")
        # one pipeline replica: the data must come in the user's own order, so Lightning injects no sampler
        patches.set(_compat.accelerator_connector(trainer), "use_distributed_sampler", False)
    else:
        shard_lazy_data(trainer.datamodule, placement.num_replicas, placement.replica, patches)
    if placement.num_ranks > 1:
        for obj, name, value in _compat.sigterm_without_collectives(trainer):
            patches.set(obj, name, value)
    return partition, runner


#: Lightning's callbacks that keep an averaged copy of the whole LightningModule (both Lightning namespaces)
_AVERAGING = ("StochasticWeightAveraging", "WeightAveraging")


def refuse_weight_averaging(callbacks: list[Any], num_stages: int) -> None:
    """Refuse Lightning's weight-averaging callbacks before any step: they copy the whole LightningModule into an
    averaged model, update it from every parameter and save it in place of the trained weights, while a stage holds
    only its own part (the others' layers are on the meta device), so the copy fails or the averaged model would miss
    every other stage's weights."""
    if num_stages < 2:
        return
    for cb in callbacks:
        names = [c.__name__ for c in type(cb).__mro__
                 if c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")]
        if any(n in _AVERAGING for n in names):
            raise ValueError(
                f"{type(cb).__name__} cannot run under ClappingStrategy with {num_stages} stages: it keeps an averaged "
                "copy of the whole LightningModule and saves it in place of the trained weights, but each stage holds "
                "only its own layers, so the copy would miss the other stages' weights. Remove the callback (train "
                "without weight averaging), or average in one process with the plain or DDP strategy.")


def check_same_cuts(partition: Partition, num_ranks: int) -> None:
    """Collective, once per run: every process must have cut the model at the same modules (a node started with
    other split points, whose boundary tensors happen to have the same shapes, would train silently wrong)."""
    if num_ranks == 1:
        return
    cuts = safe_objects.all_gather(list(partition.cut_points))
    other = next((r for r, c in enumerate(cuts) if c != cuts[0]), None)
    if other is not None:
        raise ValueError(
            f"the processes cut the model differently: rank 0 at {cuts[0]}, rank {other} at {cuts[other]}. "
            "Start every process (every node) with the same code and the same split_points / stages."
        )


def check_tied_param_groups(optimizers: list[Any], module: pl.LightningModule, partition: Partition,
                            placement: Placement) -> None:
    """Collective over the pipeline, once per fit, after ``configure_optimizers``: every copy of a tensor tied across
    stages must sit in a parameter group with the same settings (the same optimizer, and every hyperparameter but the
    parameter list), else each stage steps its copy with its own group's settings and the copies drift apart. Groups
    built by name (decay / no decay, an lr per module) put the names of one tied tensor in different groups: one
    process lists the tensor once, under its first name, but each stage lists its own copy under its own name."""
    if not partition.tied or placement.num_stages < 2:
        return

    def where(param: torch.nn.Parameter) -> list[Any] | None:
        for o, optimizer in enumerate(optimizers):
            for g, group in enumerate(getattr(optimizer, "_optimizer", optimizer).param_groups):
                if any(p is param for p in group["params"]):
                    settings = {k: repr(v) for k, v in sorted(group.items()) if k != "params"}
                    return [o, g, settings]
        return None

    stage = placement.stage
    mine = [[i, key, where(module.get_parameter(key))] for i, g in enumerate(partition.tied)
            if (key := g.key_on(stage)) is not None]
    every = safe_objects.all_gather({"stage": stage, "copies": mine}, group=placement.pp_group)
    copies: dict[int, list[tuple[int, str, Any]]] = {}
    for part in every:
        for i, key, found in part["copies"]:
            copies.setdefault(i, []).append((part["stage"], key, found))
    for i, held in sorted(copies.items()):
        found = [f for _, _, f in held]
        if len({None if f is None else (f[0], tuple(sorted(f[2].items()))) for f in found}) == 1:
            continue
        differ = sorted({k for f in found if f is not None for k, v in f[2].items()
                         if any(o is None or o[2].get(k) != v for o in found)})

        def said(s: int, key: str, f: Any) -> str:
            if f is None:
                return f"stage {s} steps {key!r} in no optimizer"
            return (f"stage {s} steps {key!r} in optimizer {f[0]}, param group {f[1]}"
                    + "".join(f", {k}={f[2].get(k)}" for k in differ))

        keys = partition.tied[i].keys
        raise ValueError(
            f"ClappingStrategy: the tied tensor {' / '.join(map(repr, keys))} is one tensor, of which every stage that "
            f"uses it trains a copy, but configure_optimizers put the copies in parameter groups with different "
            f"settings: {'; '.join(said(*h) for h in sorted(held, key=lambda h: h[0]))}. The copies would drift apart. "
            f"One process lists the tensor once, under {keys[0]!r}; here each stage lists its copy under its own "
            f"name. Put all of {' and '.join(map(repr, keys))} in the same parameter group (choose groups by tensor, "
            f"not by name: give every name of a tied tensor the group of its first name)."
        )


def warn_empty_stages(partition: Partition, num_stages: int) -> None:
    empty = [s for s, n in enumerate(partition.stage_params) if n == 0]
    if empty and not partition.shared_params:
        firsts = ("<start>",) + partition.cut_points
        rank_zero_warn(
            f"ClappingStrategy: stage(s) {', '.join(f'{s} (from {firsts[s]!r})' for s in empty)} hold no "
            "parameters: such a process only passes activations on, and adds a link and its delay to every step. "
            f"Choose split_points that give every stage some layers, or split_points=None to balance "
            f"{num_stages} stages by parameter count."
        )


def warn_batchnorm(module: pl.LightningModule, microbatches: int) -> None:
    norms = [n for n, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms and microbatches > 1 and module.trainer.state.fn == TrainerFn.FITTING:
        rank_zero_warn(
            f"{len(norms)} BatchNorm layers ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) see one "
            f"micro-batch at a time: with microbatches={microbatches} their batch statistics (and running "
            "averages) come from micro-batches of the batch, not the whole batch, so training differs from one "
            "device. Use microbatches=1, GroupNorm/LayerNorm, or accept per-micro-batch statistics."
        )


def materialize_own_stage(module: pl.LightningModule, partition: Partition, stage: int, device: torch.device,
                          pretrained: dict[str, Any] | None = None, seed: int | None = None) -> None:
    """Allocate and initialise the meta-built modules of this rank's stage, the replicated buffers and the modules
    that hold buffers but no parameters (rotary tables: they run on every stage), then read ``pretrained`` weights
    for them (see :mod:`lightning_clapping.pipeline.materialize`)."""
    units = partition.units_of(stage)
    spanning = set(partition.spanning)  # their own tensors can only be replicated buffers
    buffers_only = {n for n, m in module.named_modules() if next(m.parameters(), None) is None}

    def own(name: str) -> bool:
        return name in spanning or any(u == "" or name == u or name.startswith(u + ".") for u in units)

    pairs = [(n, m) for n, m in module.named_modules() if own(n) or n in buffers_only]
    foreign = {n for n, _ in pairs if not own(n)}
    done = materialize(pairs, device, seed, root=module, pretrained=pretrained, optional=foreign)
    for i, report in enumerate(done.pretrained):
        if report.missing:
            warnings.warn(report.warnings(stage)[0], stacklevel=2)
        if report.unexpected:
            rank_zero_warn(report.warnings(stage)[-1])
        log.info("stage %d read %d tensors from %s (%d files)", stage, len(report.read), report.path, len(report.files))
    if done:
        log.debug("stage %d materialized %d modules from the meta device", stage, done.modules)


def move_to_device(module: pl.LightningModule, runner: StageRunner, partition: Partition | None,
                   device: torch.device) -> None:
    """This stage's modules, and the buffers of the modules that span stages, onto this rank's device."""
    for unit in runner.own_units():
        unit.to(device)
    for name in partition.spanning if partition else ():
        sub = module.get_submodule(name)
        for bname, buf in list(sub.named_buffers(recurse=False)):
            sub._buffers[bname] = buf.to(device)


def isolate_metrics(module: pl.LightningModule, dp_group: Any, patches: Patches) -> None:
    """torchmetrics syncs ``compute()`` over the default (whole-world) group, but only the last stage has metric
    state and calls it: give every Metric the group of the ranks that run the same stage (its replicas)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return
    if dp_group is None:
        return
    for m in module.modules():
        if isinstance(m, Metric):
            patches.set(m, "process_group", dp_group)


def shard_lazy_data(dm: Any, num_replicas: int, replica: int, patches: Patches) -> None:
    """A :class:`LazySamplingDataModule` (which Lightning gives no sampler) shards its data over the replicas."""
    if not isinstance(dm, LazySamplingDataModule):
        return
    if dm.num_replicas not in (1, num_replicas):
        raise ValueError(
            f"LazySamplingDataModule(num_replicas={dm.num_replicas}) but ClappingStrategy runs "
            f"{num_replicas} data-parallel replicas: leave num_replicas at its default (the strategy sets it "
            f"and the replica rank) or pass num_replicas={num_replicas}"
        )
    if dm.loader is not None and (dm.loader.num_replicas, dm.loader.replica_rank) != (num_replicas, replica):
        raise ValueError("the LazySamplingDataModule's loader was built before the strategy could shard it over "
                         "the replicas; do not call train_dataloader() before trainer.fit()")
    patches.set(dm, "num_replicas", num_replicas)
    patches.set(dm, "replica_rank", replica)


def foreign_buffers(module: pl.LightningModule, placement: Placement) -> dict[str, Any]:
    """Collective over replica 0's pipeline: the non-persistent buffers (``position_ids``, rotary tables, causal
    masks: not in a state dict) that global rank 0 holds on the meta device, from the stages that hold them; ``{}`` on
    the other ranks. With the state dict they make the launching process's module whole."""
    if placement.replica != 0:
        return {}
    persistent = set(module.state_dict(keep_vars=True))
    mine = {n: b for n, b in module.named_buffers() if n not in persistent and not b.is_meta}
    parts = gather_to_zero(mine, placement.device, group=placement.pp_group)
    if parts is None:
        return {}
    lacking = {n for n, b in module.named_buffers() if n not in persistent and b.is_meta}
    return {n: b for part in parts for n, b in part.items() if n in lacking}


def _set_buffers(module: torch.nn.Module, buffers: dict[str, Any]) -> dict[str, Any]:
    """Put ``buffers`` (qualified name -> tensor) into ``module``; returns the tensors they replace."""
    before = {}
    for name, tensor in buffers.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        before[name] = owner._buffers[leaf]
        owner._buffers[leaf] = tensor
    return before


@contextmanager
def whole_buffers(module: pl.LightningModule, placement: Placement) -> Generator[None, None, None]:
    """Collective (see :func:`foreign_buffers`): while a ``"full"`` checkpoint is written, rank 0's module holds every
    stage's non-persistent buffers, so saved hyperparameters that hold the network (``save_hyperparameters()`` with
    an ``nn.Module`` argument) hold real buffers and ``load_from_checkpoint`` rebuilds a working model."""
    before = _set_buffers(module, foreign_buffers(module, placement))
    try:
        yield
    finally:
        _set_buffers(module, before)


def release_stage(module: pl.LightningModule | None, runner: StageRunner | None, patches: Patches,
                  full_state: dict[str, Any] | None, optimizers: list[Any] = ()) -> None:
    """At teardown: the module's own forwards and attributes back, the whole model loaded into it on rank 0 after a
    ``"full"`` run (``full_state``: the state dict and the other stages' non-persistent buffers; ``optimizers`` then
    hold the loaded parameters, so a checkpoint saved after fit finds them in the module), and its tensors back on
    the CPU."""
    if runner is not None:
        runner.uninstall()
    patches.restore()
    if module is not None and full_state is not None:
        before = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        keys = set(module.state_dict(keep_vars=True))
        module.load_state_dict({k: v for k, v in full_state.items() if k in keys}, assign=True)
        _set_buffers(module, {k: v for k, v in full_state.items() if k not in keys})
        if runner is not None:  # assign=True gave every name a parameter of its own: tie them again
            retie(module, runner.partition.aliases)
        _rebind_optimizers(optimizers, before, dict(module.named_parameters(remove_duplicate=False)))
    if module is not None:
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type not in ("meta", "cpu"):
                t.data = t.data.cpu()


def _rebind_optimizers(optimizers: list[Any], before: dict[int, str], after: dict[str, Any]) -> None:
    """Point the optimizers' parameter lists (and their state) at the parameters the full load put in the module.

    The stages' copies of a tied tensor (each a parameter of its own, listed apart) became one parameter again
    (:func:`retie`): it is listed once, where its first copy was, as one process lists it, and keeps the state of the
    copy this rank trained (not a released one's, on the meta device)."""
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        swap = {id(p): after[before[id(p)]] for g in optimizer.param_groups for p in g["params"] if id(p) in before}
        listed: set[int] = set()
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                p = swap.get(id(p), p)
                if id(p) not in listed:
                    listed.add(id(p))
                    params.append(p)
            group["params"] = params
        state: dict[Any, Any] = {}
        for p, s in optimizer.state.items():
            if swap.get(id(p), p) not in state or not p.is_meta:
                state[swap.get(id(p), p)] = s
        optimizer.state.clear()
        optimizer.state.update(state)

