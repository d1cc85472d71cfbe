"""The Lightning side of checkpoints: what this rank adds to a save, and reads back on a load.

Lightning calls ``lightning_module_state_dict()`` and ``optimizer_state()`` on every rank, then ``save_checkpoint()``
on every rank. ``"full"``: the first two gather replica 0's tensors to rank 0 (collectives within its pipeline), which
writes the file. ``"sharded"``: they return this stage's own part, keyed by name, and every stage of replica 0 writes
it (``torch.distributed.checkpoint``). The replicas hold the same weights and optimizer states; only their
error-feedback buffers differ, and every replica saves its own. The tensor work itself (gathering, merging, the
sharded layout) is :mod:`lightning_clapping.checkpoint.state`.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_clapping import _compat
from lightning_clapping.checkpoint import state as ckpt
from lightning_clapping.comm.placement import Placement
from lightning_clapping.options import ClappingOptions
from lightning_clapping.pipeline.executor import PipelineExecutor
from lightning_clapping.pipeline.partition import Partition
from lightning_clapping.pipeline.stage import StageRunner
from lightning_clapping.sync import ReplicaSync
from lightning_clapping.tuning import Tuning

#: the replica sync's state among a rank's buffers (no message rule has this name)
SYNC_KEY = "replica_sync"


class StageCheckpoints:
    """This rank's part of saving and loading, for the options' ``state_dict_type``, ``"full"`` or ``"sharded"``.

    ``sharded_loaded`` says that the last load read a sharded folder (model and optimizer states were read then,
    by name); ``last_feedback`` holds this rank's error-feedback buffers from the last teardown, for a checkpoint
    saved after ``fit`` returns.
    """

    def __init__(self, options: ClappingOptions) -> None:
        self.options = options
        self.sharded_loaded = False
        self.last_feedback: dict[str, Any] = {}
        #: the other names of each tied tensor -> the name one process keeps (the partition's ``aliases``, noted when
        #: the model's state is saved or loaded, which Lightning does before the optimizers')
        self.tied_alias: dict[str, str] = {}

    def _note_ties(self, partition: Partition) -> None:
        self.tied_alias = dict(partition.aliases)

    # ------------------------------------------------------------------ saving
    def model_state(self, module: pl.LightningModule, partition: Partition, placement: Placement) -> dict[str, Any]:
        self._note_ties(partition)
        if placement.replica != 0:
            return {}
        mine = partition.owned_state_keys(placement.stage)
        local = {k: v for k, v in module.state_dict().items() if k in mine}
        if self.options.state_dict_type == "sharded":
            return local
        parts = ckpt.gather_to_zero(local, placement.device, group=placement.pp_group)
        if parts is None:
            return {}
        return ckpt.merge_model_states(parts, list(partition.state_stage), [g.keys for g in partition.tied])

    def optimizer_state(self, module: pl.LightningModule, optimizer: Any, placement: Placement) -> dict[str, Any]:
        if placement.replica != 0:
            return {}
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        names = ckpt.param_names(module, optimizer)
        local = ckpt.state_by_name(ckpt.local_optimizer_state(optimizer, optimizer.state_dict()), names)
        if self.options.state_dict_type == "sharded":
            return local
        # gathered and merged by name: positions are each stage's own and need not agree between stages
        parts = ckpt.gather_to_zero(local, placement.device, group=placement.pp_group)
        if parts is None:
            return {}
        # positions as one process has them: a tied tensor once (each stage lists its own copy apart)
        return ckpt.one_process_positions(ckpt.merge_optimizer_states(parts, names), names, self.tied_alias)

    def feedback_state(self, executor: PipelineExecutor | None, placement: Placement,
                       driver: Any = None) -> dict[str, Any]:
        """This rank's buffers: its rules' error feedback and its replica sync's state (``replica_sync``)."""
        return {feedback_key(placement): rank_buffers(executor, driver) if executor is not None else self.last_feedback}

    def add_run_record(self, checkpoint: dict[str, Any], partition: Partition | None, num_stages: int,
                       tuning: Tuning) -> None:
        """How this run was cut and tuned: a resumed run uses the saved buffers only if it is cut the same way."""
        checkpoint["clapping"] = {"cut_points": list(partition.cut_points) if partition else [],
                                  "num_stages": num_stages, "autotune": tuning.to_wire(),
                                  "codecs": tuning.codecs_wire()}

    def complete_full(self, checkpoint: dict[str, Any], feedback: dict[str, Any], placement: Placement,
                      module: pl.LightningModule, filepath: Any) -> None:
        """``"full"``, collective over every rank: all error-feedback buffers (and whole hyperparameter modules)
        into rank 0's checkpoint, and ``filepath`` made ready for the file (a sharded folder there is removed, see
        :func:`~lightning_clapping.checkpoint.state.claim_path`; a path with a protocol, ``s3://...``, is left to
        Lightning's checkpoint IO)."""
        if "://" not in str(filepath):
            ckpt.claim_path(Path(filepath), sharded=False, device=placement.device)
        parts = ckpt.gather_to_zero(feedback, placement.device)
        if parts is not None:
            checkpoint["clapping_feedback"] = {k: v for part in parts for k, v in part.items()}
        if placement.global_rank == 0:
            ckpt.whole_hparams_modules(checkpoint, module, self.tied_alias)

    def save_sharded(self, checkpoint: dict[str, Any], path: Path, feedback: dict[str, Any],
                     placement: Placement) -> None:
        """``"sharded"``: every stage of replica 0 writes its tensors, the other replicas their buffers only. The
        folder is written beside ``path`` and renamed into place when complete (:func:`lightning_clapping.checkpoint.state.save_sharded`)."""
        tensors = {"model": checkpoint.pop("state_dict"), "clapping_feedback": feedback}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        if placement.replica != 0:  # the other replicas add only their own error-feedback buffers
            tensors = {"clapping_feedback": tensors["clapping_feedback"]}
        held = [k for k, v in (checkpoint.get("hyper_parameters") or {}).items() if isinstance(v, torch.nn.Module)]
        if held:
            rank_zero_warn(
                f"the saved hyperparameters hold modules ({', '.join(held)}); a sharded checkpoint stores them without "
                "their weights (no rank holds the whole model), so load_from_checkpoint of the consolidated file "
                f"cannot rebuild the model from them. Use `self.save_hyperparameters(ignore={held!r})` and build "
                "those modules in the LightningModule, or state_dict_type='full'."
            )
        ckpt.save_sharded(path, tensors, checkpoint if placement.global_rank == 0 else None, placement.device)

    # ------------------------------------------------------------------ loading
    def load_sharded(self, path: Path, module: pl.LightningModule, partition: Partition, placement: Placement,
                     optimizers: list[Any], fitting: bool, weights_only: bool | None) -> tuple[dict[str, Any], Any]:
        """Every rank reads only its own tensors by name (optimizer states only when ``fitting``); returns the rest
        (``meta.pt``) and this rank's error-feedback buffers."""
        self._note_ties(partition)
        # None: torch's default (weights only, since torch 2.6), as Lightning and FSDP load
        meta = torch.load(path / ckpt.META_FILE, map_location="cpu", weights_only=weights_only)
        saved = ckpt.saved_model_keys(path)
        if module.strict_loading:
            ckpt.check_model_keys(saved, list(partition.state_stage), path)
        mine = partition.owned_state_keys(placement.stage)
        ckpt.load_sharded_model(path, {k: v for k, v in module.state_dict().items() if k in mine and k in saved})
        prefixes = [f"clapping_feedback.{feedback_key(placement)}"]
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        names = [ckpt.param_names(module, o) for o in optimizers]
        if fitting:
            for i, (opt, opt_names) in enumerate(zip(optimizers, names)):
                prefixes.append(f"optimizer_{i}.param_groups")
                for j in sorted(ckpt.owned_indices(opt)):  # a tied copy's state may sit under its first name
                    prefixes += sorted({f"optimizer_{i}.state.{n}" for n in (opt_names[j],
                                                                              partition.aliases.get(opt_names[j]))
                                        if n})
        loaded = ckpt.load_sharded_entries(path, prefixes)
        for i, (opt, opt_names) in enumerate(zip(optimizers, names)):
            if f"optimizer_{i}" in loaded:
                opt.load_state_dict(ckpt.state_for_layout(loaded[f"optimizer_{i}"], opt, opt_names, partition.aliases))
                _compat.optimizers_to_device([opt], placement.device)
        return meta, loaded.get("clapping_feedback", {})

    def load_model(self, checkpoint: dict[str, Any], module: pl.LightningModule, partition: Partition,
                   stage: int, strict: bool) -> None:
        self._note_ties(partition)
        mine = partition.owned_state_keys(stage)
        full = checkpoint["state_dict"]
        missing = [k for k in mine if k not in full]
        if strict and missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} entries of stage {stage}, e.g. {missing[:5]}")
        module.load_state_dict({k: v for k, v in full.items() if k in mine}, strict=False)

    def load_optimizers(self, checkpoint: dict[str, Any], module: pl.LightningModule, optimizers: list[Any],
                        device: torch.device) -> None:
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            names = ckpt.param_names(module, optimizer)
            state = ckpt.stage_positions(ckpt.state_by_position(state, names), names, self.tied_alias, optimizer)
            optimizer.load_state_dict(ckpt.local_optimizer_state(optimizer, state))
            _compat.optimizers_to_device([optimizer], device)


def feedback_key(placement: Placement) -> str:
    """Where this rank's error-feedback buffers live in a checkpoint (replica 0 keeps the one-replica names)."""
    return f"stage{placement.stage}" if placement.replica == 0 else f"replica{placement.replica}_stage{placement.stage}"


def rank_buffers(executor: PipelineExecutor, driver: Any) -> dict[str, Any]:
    """What a checkpoint keeps of this rank beyond the model and optimizer: error feedback by rule, and the replica
    sync's state (under ``SYNC_KEY``, a name no rule has) of the step ``driver``, if it has one."""
    state = executor.feedback_state()
    sync: ReplicaSync | None = getattr(driver, "sync", None)
    saved = sync.state_dict() if sync is not None else {}
    if saved:
        state[SYNC_KEY] = {**saved, f"mode.{sync.name}": torch.ones(1)}
    return state


def restore_feedback(checkpoint: dict[str, Any], partition: Partition | None, executor: PipelineExecutor | None,
                     placement: Placement, tuning: Tuning, driver: Any = None) -> None:
    """Load this rank's saved error-feedback buffers into its rules, if the checkpoint was cut the same way."""
    saved = checkpoint.get("clapping")
    if not saved or executor is None or partition is None:
        return
    if list(saved.get("cut_points", [])) != list(partition.cut_points):
        if checkpoint.get("clapping_feedback"):
            rank_zero_warn(
                f"the checkpoint was cut at {saved.get('cut_points')} and this run at "
                f"{list(partition.cut_points)}: its error-feedback buffers belong to other boundaries, so "
                "they are not used and restart empty (the first messages go in full precision)."
            )
        return
    tuning.restore(saved.get("autotune"), executor, saved.get("codecs"))  # so that its buffers fit the rules
    for name, state in checkpoint.get("clapping_feedback", {}).get(feedback_key(placement), {}).items():
        if name == SYNC_KEY:
            _restore_sync(state, getattr(driver, "sync", None))
        rule = executor.rules.get(name)
        if rule is not None:
            rule.load_state(state, placement.device)


def _restore_sync(state: dict[str, Any], sync: ReplicaSync | None) -> None:
    """The replica sync's saved state, into a sync of the same mode; another mode starts afresh (with a warning)."""
    saved = next((k.split(".", 1)[1] for k in state if k.startswith("mode.")), None)
    if sync is None or saved != sync.name:
        rank_zero_warn(f"the checkpoint holds the state of replica_sync={saved!r} and this run syncs its replicas "
                       f"with {getattr(sync, 'name', 'nothing (one replica)')!r}: that state is not used")
        return
    sync.load_state_dict({k: v for k, v in state.items() if not k.startswith("mode.")})


@contextmanager
def plain_forwards(runner: StageRunner | None) -> Generator[None, None, None]:
    """Without the stage wrappers: saved hyperparameters may hold the model's own modules (``net: nn.Module``),
    which must pickle as in one process."""
    if runner is None:
        yield
        return
    runner.uninstall()
    try:
        yield
    finally:
        runner.install()
