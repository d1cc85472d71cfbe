"""``ClappingStrategy(fault_tolerance="torchft")`` in Lightning's fit loop: replica groups that drop out and rejoin.

Each replica group (one job of ``stages`` processes: ``devices x num_nodes = stages``) trains its own shard; stage
``s`` of every live group averages gradients through torchft (:mod:`lightning_clapping.ft`). What this module adds
to a fit, all through attributes set for the run (:class:`~lightning_clapping.stage_setup.Patches`):

* the step's gradient average: the step driver's ``GradientAverager`` with torchft's all-reduce as its DDP hook;
* the optimizer step runs only when torchft's vote says every rank of every live group got through the step
  (a group that died mid-step fails it for the others, who then skip that one update, as torchft's own optimizer
  wrapper does); a skipped update also leaves the error-feedback residuals of a compressed tied sum (``tied_codec``)
  as they were before the step;
* the quorum of the next step is formed at the end of each step (a callback's ``on_train_batch_end``, where
  Lightning's own mid-epoch checkpoints are taken); there a group that is behind takes a live peer's state:
  this stage's parameters and buffers, optimizer, LR schedulers and precision state;
* a restarted group joins once its train loader is set up, before its first step: with the peer's state it also
  takes the fit loop's state (epoch, batch, global step) and resumes its own shard there: a plain ``DataLoader``
  skips the batches the others took this epoch, a lazy loader gets the peer's position for its own shard. The
  error-feedback buffers are not taken from a peer: they belong to the group's own pipeline, whose both ends
  restarted together and start afresh (``warm_start``), as in a new run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_clapping.comm.replicas import GradientAverager
from lightning_clapping.data import LazySamplingDataModule
from lightning_clapping.ft.config import FaultTolerance
from lightning_clapping.ft.group import ReplicaGroup, average_bucket
from lightning_clapping.ft.sampler import shard_loader
from lightning_clapping.lazy.sampler import LazySampler
from lightning_clapping.lazy.source import make_source
from lightning_clapping.stage_setup import Patches, shard_lazy_data
from lightning_clapping.sync.every_step import EveryStepSync

log = logging.getLogger(__name__)


def attach(driver: Any, patches: Patches) -> None:
    """In ``setup()``, when fitting with ``fault_tolerance`` set: the run's step driver joins the quorum."""
    config = driver.options.fault_tolerance
    trainer = driver.module.trainer
    if config is not None and trainer.state.fn == TrainerFn.FITTING:
        FaultTolerantFit(driver, trainer, config.resolved(), patches)


def replica_group(trainer: pl.Trainer) -> ReplicaGroup | None:
    """The running fit's :class:`~lightning_clapping.ft.group.ReplicaGroup` (its votes, its heals), if any."""
    return next((cb.fit.group for cb in trainer.callbacks if isinstance(cb, QuorumCallback)), None)


class QuorumCallback(pl.Callback):
    """Forms the next step's quorum at the end of each training batch (not after the last one)."""

    def __init__(self, fit: FaultTolerantFit) -> None:
        self.fit = fit

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        loop = trainer.fit_loop
        last_epoch = trainer.max_epochs is not None and trainer.max_epochs != -1 and (
            trainer.current_epoch + 1 >= trainer.max_epochs and loop.epoch_loop.batch_progress.is_last_batch)
        if trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step or last_epoch:
            return
        self.fit.group.start_quorum()


class FaultTolerantFit:
    """One fit of one rank of a replica group (see the module docstring)."""

    def __init__(self, driver: Any, trainer: pl.Trainer, config: FaultTolerance, patches: Patches) -> None:
        placement, strategy = driver.placement, trainer.strategy
        if placement.num_replicas != 1:
            raise ValueError(
                f"with fault_tolerance every replica group is a job of its own: this Trainer runs "
                f"{placement.num_replicas} replicas of {placement.num_stages} stages in one job. Start one job per "
                f"replica group with devices x num_nodes = stages = {placement.num_stages} (docs/fault_tolerance.md)."
            )
        if len(strategy.optimizers) != 1:
            raise ValueError(f"fault_tolerance steps one optimizer per training step; configure_optimizers returned "
                             f"{len(strategy.optimizers)}")
        self.trainer, self.strategy, self.driver, self.config = trainer, strategy, driver, config
        self.group = ReplicaGroup(config, placement.global_rank, placement.num_ranks, placement.device)
        driver.sync = EveryStepSync(GradientAverager(None, config.num_replica_groups, comm_hook=average_bucket,
                                                     comm_state=self.group))
        self.lazy = isinstance(trainer.datamodule, LazySamplingDataModule)
        if self.lazy:
            shard_lazy_data(trainer.datamodule, config.num_replica_groups, config.replica_group, patches)
        self._loop_state: dict | None = None  # a peer's fit-loop state, taken at the first quorum
        self._joining = True  # until the first quorum: the loop and data positions may come from a peer
        optimizer = strategy.optimizers[0]
        patches.set(optimizer, "step", self._gated(optimizer.step, driver.ties))
        patches.set(strategy, "process_dataloader", self._processing(strategy.process_dataloader))
        patches.set(strategy, "teardown", self._closing(strategy.teardown))
        patches.set(trainer, "callbacks", [*trainer.callbacks, QuorumCallback(self)])
        rank_zero_info(f"ClappingStrategy: replica group {config.replica_group} of {config.num_replica_groups}, "
                       f"lighthouse {config.lighthouse}")

    # ------------------------------------------------------------------ the step
    def _gated(self, step: Any, ties: Any = None) -> Any:
        """``step`` only when the vote commits; a refused step also leaves the tied sum's error-feedback residuals
        (``ties``, updated in the closure's backward) as they were before it."""
        def gated_step(closure: Any = None, **kwargs: Any) -> Any:
            loss = closure() if closure is not None else None
            if self.group.should_commit():
                step(**kwargs)
            else:
                if ties is not None:
                    ties.discard_step()
                log.warning("replica group %d: step %d not committed (a peer failed during it)",
                            self.config.replica_group, self.trainer.global_step)
            return loss

        return gated_step

    def _closing(self, teardown: Any) -> Any:
        def closing_teardown() -> None:
            self.group.close()
            teardown()

        return closing_teardown

    # ------------------------------------------------------------------ joining, and the data
    def _processing(self, process: Any) -> Any:
        def process_dataloader(dataloader: object) -> object:
            dataloader = process(dataloader)
            state = self.trainer.state
            if state.fn != TrainerFn.FITTING or state.stage != RunningStage.TRAINING:
                return dataloader
            if self.group.manager is None:  # the first train loader (or, with lazy sampling, the one it wraps)
                self.group.connect(self.state_dict, self.load_state_dict)
                self.group.start_quorum()
                self._joining = False
                self._check_join()
            outer = isinstance(dataloader, LazySampler) if self.lazy else True
            if outer:
                self._resume_data(dataloader)
            return dataloader

        return process_dataloader

    def _check_join(self) -> None:
        """Collective over the group: every rank took the same peer step, or none did; else the group restarts."""
        import torch
        import torch.distributed as dist

        taken = -1 if self._loop_state is None else int(self._loop_state["epoch_loop.batch_progress"]["total"]["ready"])
        failed = self.group.manager.errored() is not None
        flags = torch.tensor([float(failed), taken, -taken], device=self.driver.placement.device)
        if self.driver.placement.num_ranks > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0 or flags[1] != -flags[2]:
            raise RuntimeError(
                f"replica group {self.config.replica_group} could not take a live peer's state on all its ranks "
                f"(a fetch failed, or the ranks took different steps: {self.group.manager.errored()}); its processes "
                "stop so that the launcher restarts the group and it joins again"
            )

    def _resume_data(self, loader: Any) -> None:
        """The train loader as Lightning will iterate it: this group's shard, at the peer's position if one was taken."""
        cfg, loop = self.config, self._loop_state
        self._loop_state = None
        sampler = None if self.lazy else shard_loader(loader, cfg.num_replica_groups, cfg.replica_group,
                                                      int(os.environ.get("PL_GLOBAL_SEED", 0)))
        if loop is None:
            return
        if self.lazy:
            entries = loop.get("state_dict", {}).get("combined_loader", [])
            loop["state_dict"]["combined_loader"] = [_retarget(e, loader, cfg.replica_group) for e in entries]
        self.trainer.fit_loop.load_state_dict(loop)
        done = int(loop["epoch_loop.batch_progress"]["current"]["ready"])
        if sampler is not None and done < _epoch_batches(self.trainer, len(loader)):
            sampler.skip_once(done * loader.batch_size)
        rank_zero_info(f"ClappingStrategy: replica group {cfg.replica_group} rejoined at epoch "
                       f"{self.trainer.current_epoch}, batch {done}, global step {self.trainer.global_step}")

    # ------------------------------------------------------------------ the state a peer takes
    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the replicas' common state (called by torchft while training waits for the quorum)."""
        trainer, strategy = self.trainer, self.strategy
        return {
            "module": _own_tensors(trainer.lightning_module),
            "optimizer": strategy.optimizers[0].state_dict(),
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": strategy.precision_plugin.state_dict(),
            "loop": trainer.fit_loop.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer, strategy, module = self.trainer, self.strategy, self.trainer.lightning_module
        mine = set(_own_tensors(module))
        if set(state["module"]) != mine:
            raise RuntimeError(
                f"replica group {self.config.replica_group}: a peer's stage holds other tensors than this one "
                f"({sorted(set(state['module']) ^ mine)[:5]}): every replica group must run the same code and cuts"
            )
        module.load_state_dict(state["module"], strict=False)
        strategy.optimizers[0].load_state_dict(state["optimizer"])
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(saved)
        strategy.precision_plugin.load_state_dict(state["precision"])
        progress = state["loop"]["epoch_loop.batch_progress"]["total"]["ready"]
        if self._joining and progress > 0:  # a group that restarted: it goes on where the others are
            self._loop_state = state["loop"]


def _own_tensors(module: Any) -> dict[str, Any]:
    return {k: v for k, v in module.state_dict().items() if not v.is_meta}


def _epoch_batches(trainer: pl.Trainer, length: int) -> int:
    limit = trainer.limit_train_batches
    return min(length, int(limit)) if isinstance(limit, int) else int(length * limit)


def _retarget(entry: Any, loader: Any, group: int) -> Any:
    """A peer's lazy-loader state, made this group's: the same position in the same decision stream, on this
    group's shard (its reused batch's sample ids and the epoch's order fingerprint are this shard's own)."""
    if not isinstance(entry, dict) or "replica_rank" not in entry:
        return entry
    entry = {**entry, "replica_rank": group, "batch": None}
    if entry.get("source_kind") == "map" and int(entry["pos"]) > 0:
        own = make_source(loader.source, int(entry["num_replicas"]), group, int(entry["seed"]))
        own.begin(int(entry["epoch"]))
        entry.update(own.checkpoint())
        fresh = int(entry["fresh"])
        entry["ids"] = None if fresh == 0 else _as_ids(own.order[fresh - 1])
        own.end()
    return entry


def _as_ids(item: Any) -> Any:
    import torch

    return torch.tensor(item if isinstance(item, list) else [item], dtype=torch.long)
