"""``ClappingStrategy(fault_tolerance="torchft")`` in Lightning's fit loop: replica groups that drop out and rejoin.

Each replica group (one job of ``stages`` processes: ``devices x num_nodes = stages``) trains its own shard; stage
``s`` of every live group averages gradients through torchft (:mod:`lightning_clapping.ft`). The fit's replica sync
is :class:`TorchftSync` (every-step averaging) or, with ``replica_sync=DiLoCo(...)``, :class:`TorchftLocalUpdates`
(the groups meet at the outer steps only; see its docstring); both take their seat in the quorum through
:class:`GroupSeat` and act through the hooks the step driver calls on every sync (:mod:`lightning_clapping.sync.base`).
For every-step averaging:

* the step's gradient average (``after_backward``, ``before_step``): every-step averaging with torchft's
  all-reduce as its DDP hook;
* the vote (``commit``): the optimizer step runs only when torchft says every rank of every live group got through
  the step (a group that died mid-step fails it for the others, who then skip that one update, as torchft's own
  optimizer wrapper does); the step driver then also leaves the error-feedback residuals of a compressed tied sum
  (``tied_codec``) as they were before the step;
* the quorum (``before_batch``): formed as each training batch starts (after the previous batch's callbacks, where
  Lightning's own mid-epoch checkpoints are taken; none after the last batch); there a group that is behind takes a
  live peer's state: this stage's parameters and buffers, optimizer, LR schedulers and precision state;
* joining (``on_loader``): a restarted group joins once its train loader is set up, before its first step: with the peer's state it also
  takes the fit loop's state (epoch, batch, global step) and resumes its own shard there: a plain ``DataLoader``
  skips the batches the others took this epoch, a lazy loader gets the peer's position for its own shard. The
  error-feedback buffers are not taken from a peer: they belong to the group's own pipeline, whose both ends
  restarted together and start afresh (``warm_start``), as in a new run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_clapping.comm.replicas import GradientAverager, ring_share
from lightning_clapping.data import LazySamplingDataModule
from lightning_clapping.ft.config import FaultTolerance
from lightning_clapping.ft.group import ReplicaGroup, average_bucket
from lightning_clapping.ft.sampler import shard_loader
from lightning_clapping.lazy.sampler import LazySampler
from lightning_clapping.lazy.source import make_source
from lightning_clapping.stage_setup import Patches, shard_lazy_data
from lightning_clapping.sync.base import stage_params
from lightning_clapping.sync.config import DiLoCo
from lightning_clapping.sync.every_step import EveryStepSync
from lightning_clapping.sync.local_updates import LocalUpdates

log = logging.getLogger(__name__)


def join(driver: Any, patches: Patches) -> GroupSeat | None:
    """In ``setup()``, when fitting with ``fault_tolerance`` set: the replica sync of the run's step driver, which
    joins the quorum (``patches``: the lazy data module's sharding, set for the run)."""
    config = driver.options.fault_tolerance
    trainer = driver.module.trainer
    if config is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    mode = driver.options.replica_sync
    if isinstance(mode, DiLoCo):
        return TorchftLocalUpdates(driver, trainer, config.resolved(), patches, mode)
    return TorchftSync(driver, trainer, config.resolved(), patches)


def replica_group(trainer: pl.Trainer) -> ReplicaGroup | None:
    """The running fit's :class:`~lightning_clapping.ft.group.ReplicaGroup` (its votes, its heals), if any."""
    steps = getattr(trainer.strategy, "_steps", None)
    return steps.sync.group if steps is not None and isinstance(steps.sync, GroupSeat) else None


class GroupSeat:
    """What every fault-tolerant replica sync does besides its own averaging (see the module docstring): the seat in
    the quorum, joining, the state a peer takes. Mixed in before the mode's :class:`~lightning_clapping.sync.base.
    ReplicaSync`."""

    votes = True

    def _take_seat(self, driver: Any, trainer: pl.Trainer, config: FaultTolerance, patches: Patches) -> None:
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
        self.lazy = isinstance(trainer.datamodule, LazySamplingDataModule)
        if self.lazy:
            shard_lazy_data(trainer.datamodule, config.num_replica_groups, config.replica_group, patches)
        self._loop_state: dict | None = None  # a peer's fit-loop state, taken at the first quorum
        self._loader_state: Any = None  # the lazy loader's state at the last batch end (see after_step)
        self._joining = True  # until the first quorum: the loop and data positions may come from a peer
        self.healed = False  # whether this rank took a peer's state in the quorum now open
        rank_zero_info(f"ClappingStrategy: replica group {config.replica_group} of {config.num_replica_groups}, "
                       f"lighthouse {config.lighthouse}")

    def open_quorum(self) -> None:
        """The quorum of the coming collective (a no-op while one is open); a group that is behind heals in it."""
        if not self.group.quorum_open:
            heals = self.group.heals
            self.group.start_quorum()
            self.healed = self.group.heals > heals

    def close(self) -> None:
        self.group.close()

    # ------------------------------------------------------------------ joining, and the data
    def on_loader(self, dataloader: Any) -> Any:
        state = self.trainer.state
        if state.fn != TrainerFn.FITTING or state.stage != RunningStage.TRAINING:
            return dataloader
        if self.group.manager is None:  # the first train loader (or, with lazy sampling, the one it wraps)
            self.group.connect(self.peer_state, self.load_peer_state)
            self.open_quorum()
            self._joining = False
            self._check_join()
        outer = isinstance(dataloader, LazySampler) if self.lazy else True
        if outer:
            self._resume_data(dataloader)
        return dataloader

    def _check_join(self) -> None:
        """Collective over the group: every rank took the same peer step, or none did; else the group restarts."""
        taken = -1 if self._loop_state is None else _completed(self._loop_state, "total")
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
        done = _completed(loop, "current")
        if sampler is not None and done < _epoch_batches(self.trainer, len(loader)):
            sampler.skip_once(done * loader.batch_size)
        rank_zero_info(f"ClappingStrategy: replica group {cfg.replica_group} rejoined at epoch "
                       f"{self.trainer.current_epoch}, batch {done}, global step {self.trainer.global_step}")

    # ------------------------------------------------------------------ the state a peer takes
    def after_step(self, params: list[Any]) -> None:
        """With lazy data: the loader's state as the batch ends (Lightning has fetched one batch ahead), which a
        joining group takes with the loop's counters of the next batch's start (see :meth:`before_batch`)."""
        if self.lazy:
            self._loader_state = self.trainer.fit_loop.state_dict().get("state_dict", {}).get("combined_loader")
        super().after_step(params)  # type: ignore[misc]

    def _loop_at_batch_end(self) -> dict[str, Any]:
        loop = self.trainer.fit_loop.state_dict()
        if self._loader_state is not None:
            loop.setdefault("state_dict", {})["combined_loader"] = self._loader_state
        return loop

    def peer_state(self) -> dict[str, Any]:
        """This rank's share of the replicas' common state (called by torchft while training waits for the quorum)."""
        trainer, strategy = self.trainer, self.strategy
        return {
            "module": _own_tensors(trainer.lightning_module),
            "optimizer": strategy.optimizers[0].state_dict(),
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": strategy.precision_plugin.state_dict(),
            "loop": self._loop_at_batch_end(),
            "sync": self.state_dict(),  # type: ignore[attr-defined]  # the mode's own (DiLoCo: anchor, momentum)
        }

    def load_peer_state(self, state: dict[str, Any]) -> None:
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
        self.load_state_dict(state["sync"])  # type: ignore[attr-defined]
        progress = _completed(state["loop"], "total")
        if self._joining and progress > 0:  # a group that restarted: it goes on where the others are
            self._loop_state = state["loop"]


class TorchftSync(GroupSeat, EveryStepSync):
    """Every-step averaging over the live replica groups: each step's gradients through torchft's all-reduce, and
    a vote on every optimizer step."""

    def __init__(self, driver: Any, trainer: pl.Trainer, config: FaultTolerance, patches: Patches) -> None:
        self._take_seat(driver, trainer, config, patches)
        EveryStepSync.__init__(self, GradientAverager(None, config.num_replica_groups, comm_hook=average_bucket,
                                                      comm_state=self.group))

    def commit(self, step: int) -> bool:
        if self.group.should_commit():
            return True
        log.warning("replica group %d: step %d not committed (a peer failed during it)", self.config.replica_group,
                    step)
        return False

    def before_batch(self) -> None:
        """The quorum of this step, formed as its batch starts: after the previous batch's callbacks (Lightning's
        mid-epoch checkpoints), none after the last batch. A peer's fit-loop state read meanwhile counts this batch
        as ready but not completed; a joining group goes on from the completed ones, as Lightning's own restart
        does. The first step's quorum is the join's, still open."""
        self.open_quorum()


class TorchftLocalUpdates(GroupSeat, LocalUpdates):
    """DiLoCo over the live replica groups. The inner steps need no quorum and no vote; each outer step (due after
    optimizer step ``k``) runs as batch ``k + 1`` starts, where every-step averaging forms its quorum, so that a
    joining group takes a peer's state between two batches, including the anchor and the outer momentum. The
    average counts the groups that trained since the anchor (a group that healed in this quorum adds nothing), and
    the vote decides: committed, the outer step; not (a group failed during the sync), every group drops its inner
    steps since the anchor and goes on from it. A lost group costs the others at most that one sync's inner steps."""

    deferred = True

    def __init__(self, driver: Any, trainer: pl.Trainer, config: FaultTolerance, patches: Patches,
                 mode: DiLoCo) -> None:
        LocalUpdates.__init__(self, mode, None, config.num_replica_groups, 0, driver.placement.device)
        self._take_seat(driver, trainer, config, patches)

    def commit(self, step: int) -> bool:
        return True  # an inner step: this group's own

    def before_batch(self) -> None:
        self._outer_step(self.pending())

    def finish(self, params: list[Any]) -> None:
        late = [i for i in range(len(self.anchor)) if self.synced_at.get(i, 0) != self.steps]
        self._outer_step(late if self.steps else [])

    def _outer_step(self, indices: list[int]) -> None:
        if not indices:
            return
        self.open_quorum()
        self.sync(self._params or stage_params(self.strategy.optimizers), indices)

    def agree(self) -> bool:
        if self.group.should_commit():
            return True
        log.warning("replica group %d: the outer step after step %d not committed (a peer failed during it); the "
                    "inner steps since the last one are dropped", self.config.replica_group, self.steps)
        return False

    def _start_mean(self, flat: Tensor) -> Callable[[], Tensor]:
        weight = 0.0 if self.healed else 1.0
        buf = torch.cat([flat * weight, flat.new_full((1,), weight)])
        self.group.manager.allreduce(buf, reduce_op=dist.ReduceOp.SUM).wait()
        self.count(ring_share(max(self.group.manager.num_participants(), 1)) * buf.numel() * 4)
        mean = buf[:-1] / buf[-1].clamp(min=1.0)
        return lambda: mean


def _completed(loop: dict[str, Any], which: str) -> int:
    """The training batches a fit-loop state has completed (``which``: "current" epoch or "total")."""
    return int(loop["epoch_loop.batch_progress"][which]["completed"])


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
    return torch.tensor(item if isinstance(item, list) else [item], dtype=torch.long)
