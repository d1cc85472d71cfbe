"""One Lightning step as one run of the pipeline schedule, and what every rank learns from it.

A training step splits the batch into micro-batches, runs the schedule (the user's ``training_step`` once per
micro-batch, on the last stage; the earlier stages stop at their cut), and ends with the same numbers on every rank:
the last stage's loss and logged values ride back with the last gradient message
(:mod:`lightning_clapping.comm.step_results`) and are logged on every rank through
:mod:`lightning_clapping.log_relay`; the byte numbers are gathered off the critical path. Evaluation steps and
epoch-end hooks, which send nothing backward, relay the last stage's logs with one broadcast.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_clapping import _compat, fault_tolerance, first_pass
from lightning_clapping import precision
from lightning_clapping.codecs.feedback import StepContext
from lightning_clapping.comm import failures, safe_objects
from lightning_clapping.comm.placement import Placement
from lightning_clapping.comm.step_results import ByteStats, broadcast_results, pack_results, unpack_results
from lightning_clapping.comm.ties import TiedGradients
from lightning_clapping.data import find_lazy_loader
from lightning_clapping.hooks import EPOCH_END_HOOKS, EpochEndHooks
from lightning_clapping.log_relay import LogRelay
from lightning_clapping.options import ClappingOptions
from lightning_clapping.comm.step_stats import StepStats
from lightning_clapping.pipeline.executor import PipelineExecutor
from lightning_clapping.pipeline import coupling
from lightning_clapping.pipeline.foreign import GUARDED_HOOKS, ForeignStateGuard
from lightning_clapping.pipeline.microbatch import merge_outputs, split_batch
from lightning_clapping.pipeline.partition import Partition
from lightning_clapping.pipeline.stage import StageRunner
from lightning_clapping.stage_setup import Patches
from lightning_clapping.sync import make_sync
from lightning_clapping.sync.base import check_same_start, stage_params
from lightning_clapping.tuning import Tuning


class StepDriver:
    """Runs this rank's part of each step of one Trainer run (built in ``setup()``, dropped at teardown)."""

    def __init__(self, module: pl.LightningModule, options: ClappingOptions, placement: Placement,
                 partition: Partition, runner: StageRunner, executor: PipelineExecutor, precision_plugin: Any,
                 byte_stats: ByteStats, tuning: Tuning) -> None:
        self.module, self.options, self.placement = module, options, placement
        self.partition, self.runner, self.executor = partition, runner, executor
        self.precision_plugin, self.byte_stats, self.tuning = precision_plugin, byte_stats, tuning
        self.relay = LogRelay(module)
        #: how this stage's replicas stay together (lightning_clapping.sync); None with one replica
        self.sync = make_sync(options.replica_sync, placement, options.ddp_comm_hook, options.ddp_comm_state)
        self._stage_params: list[torch.nn.Parameter] = []
        self._local_logs: list[Any] | None = None
        self._checked_batch = False
        self._lazy_checked = False
        self._lazy_loader: Any = None
        self._owners_settled = False
        self._warned_predictions = False
        #: tensors tied across stages: their copies' gradients are summed every optimizer step (comm/ties.py)
        self.ties = TiedGradients(partition.tied, placement.stage, placement.rank_of_stage, placement.pp_group,
                                  placement.device, options.tied_codec, options.timeout) if partition.tied else None
        self._tie_sum_due = False

    def patch_hooks(self, patches: Patches) -> None:
        """The epoch-end hooks run on the last stage only (:mod:`lightning_clapping.hooks`), the hooks around the
        step refuse to mix other stages' placeholders with real tensors (:mod:`lightning_clapping.pipeline.foreign`),
        and clipping goes by the whole model's norm."""
        hooks = EpochEndHooks(self.module, self.placement, self.relay, self.broadcast_logs)
        for hook in EPOCH_END_HOOKS:  # on the last stage, with a rule for collectives (see hooks.py)
            patches.set(self.module, hook, hooks.wrap(hook, getattr(self.module, hook)))
        if self.placement.num_stages > 1:  # hooks that mix another stage's placeholders with real tensors: refused
            guard = ForeignStateGuard(self.module, self.placement.stage, self.partition.state_stage)
            for hook in GUARDED_HOOKS:
                if not getattr(type(self.module), hook).__module__.startswith(("lightning.", "pytorch_lightning.")):
                    patches.set(self.module, hook, guard.wrap(hook, getattr(self.module, hook)))
        patches.set(self.precision_plugin, "clip_grad_by_norm", self.clip_grad_by_norm)
        self.sync = fault_tolerance.join(self, patches) or self.sync  # torchft over the replica groups, if asked

    # ------------------------------------------------------------------ training
    def train(self, optimizers: list[Any], batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``training_step``: the schedule's forwards and backwards of all micro-batches, the gradients
        left in ``.grad`` for the optimizer step, and the last stage's loss (and outputs) returned on every rank."""
        module, trainer, device = self.module, self.module.trainer, self.placement.device
        if self.sync is not None and not self._stage_params:  # the fit's first step (a resumed replica's own state)
            self._stage_params = stage_params(optimizers)
            if self.placement.num_replicas > 1:
                check_same_start(self._stage_params, self.placement.dp_group, device, self.placement.stage)
            self.sync.on_train_start(self._stage_params, optimizers)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in optimizers:
                type(module).optimizer_zero_grad(module, trainer.current_epoch, batch_idx, optimizer)
        microbatches, sizes = self._split(batch)
        total = sum(sizes)
        weights = precision.scale_loss_weights(self.precision_plugin, [n / total / accumulate for n in sizes],
                                               device, optimizers)
        ctx, batch_id, info = self._step_context(trainer, batch_idx, sizes)
        relay, stage = self.relay, self.placement.stage
        relay.clear()

        def step(mb: Any, j: int) -> Any:
            with relay.capture(sizes[j]):
                return module.training_step(mb, batch_idx, *args, **kwargs)

        seed = (lambda j: _mix(_rng_base(), batch_id, stage, j)) if self.options.freeze_rng else None
        fingerprint = failures.fingerprint(batch) if ctx.fresh and self.placement.num_stages > 1 else None
        results = (lambda outs: self._step_results(outs, sizes, fingerprint)) if self.executor.is_last else None
        if self.executor.needs_plan("train"):
            with self._reported(), self.precision_plugin.train_step_context(), first_pass.quiet(module, relay):
                self._report_plan(self.executor.plan_crossings("train", microbatches[0], step))
            self._warn_batch_coupling(sizes)
        with self._reported(), self.precision_plugin.train_step_context(), self._settling_shared_owners():
            if self.ties is not None:
                self.ties.sync_copies(module)  # once: every copy of a tied tensor starts from the same values
            check = trainer.global_step if self.executor.recheck.due(trainer.global_step) else None
            outputs, stats = self.executor.train_step(microbatches, step, weights, ctx, seed, results, check)
        loss = self._finish_step(outputs, sizes, stats, fingerprint, info, optimizers)
        if self.executor.is_last and isinstance(outputs[-1], dict):
            return {**merge_outputs(outputs, sizes), "loss": loss}
        return loss

    def _finish_step(self, outputs: list[Any], sizes: list[int], stats: StepStats,
                     fingerprint: tuple[int, ...] | None, info: Any, optimizers: list[Any]) -> Tensor:
        """After the schedule: average over the replicas, take the last stage's results, log, maybe autotune."""
        last_backward = not _compat.should_accumulate(self.module.trainer)
        if self.sync is not None and last_backward:
            # this stage's last backward is done: the replicas may sync while the pipeline drains
            self._stage_params = stage_params(optimizers)
            self.sync.after_backward(self._stage_params, optimizers)
        if self.sync is not None:  # what it sent since the last step (a local-update sync: after that step)
            stats.replica_bytes, stats.replica_raw_bytes = self.sync.take_bytes()
        self._tie_sum_due = self.ties is not None and last_backward
        # the last stage's results came back with the last gradient message (on one stage, nothing was sent)
        blob = self.executor.results if self.placement.num_stages > 1 else self._step_results(outputs, sizes, None)
        loss = self._apply_results(blob, fingerprint)
        if self.options.log_bytes:
            self._log_step_stats(stats, sum(sizes), info)
        self.tuning.after_train_step(stats, len(sizes), self.executor, self.placement, self.module)
        return loss

    def finish_average(self) -> None:
        """Before clipping and the optimizer step: wait for the replicas' average of the gradients."""
        if self.sync is not None:
            self.sync.before_step()
        if self._tie_sum_due:  # after the replicas' average: every replica then sums the same values
            assert self.ties is not None
            self._tie_sum_due = False
            with self._reported():
                self.ties.sum_gradients(self.module, self.module.trainer.global_step)

    def optimizer_step(self, step: Callable[[Any], Any], closure: Any) -> Any:
        """Lightning's optimizer step, ``step(closure)``, then the replica sync's ``after_step``. A sync that votes
        runs the closure (training step, backward, the average) first and the update only if the step is committed;
        a refused step also leaves the tied sum's error-feedback residuals as they were before it."""
        sync = self.sync
        if sync is None or not sync.votes:
            out = step(closure)
        else:
            out = closure()
            if sync.commit(self.module.trainer.global_step):
                loss = out
                out = step(lambda: loss)
            elif self.ties is not None:
                self.ties.discard_step()
        if sync is not None and self._stage_params:
            sync.after_step(self._stage_params)
        return out

    def process_dataloader(self, dataloader: Any) -> Any:
        return self.sync.on_loader(dataloader) if self.sync is not None else dataloader

    def before_batch(self) -> None:
        if self.sync is not None:
            self.sync.before_batch()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    def end_of_fit(self) -> None:
        """Collective, at the end of a fit: the replica sync's last word, and its bytes into the totals."""
        if self.sync is None:
            return
        if self._stage_params:
            self.sync.finish(self._stage_params)
        self.byte_stats.add_replica_bytes(*self.sync.take_bytes())

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the norm of the whole model's gradient, combined over all stages (a tied tensor counted once)."""
        device = self.placement.device
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        uncounted = self.ties.uncounted(self.module) if self.ties is not None else set()
        grads = [p.grad for p in params if id(p) not in uncounted]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=device)
        squared = local.detach().double().pow(2).to(device)
        if self.placement.num_stages > 1:  # the replicas hold the same averaged gradients: their pipeline's is enough
            dist.all_reduce(squared, group=self.placement.pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, squared.sqrt().to(local.dtype))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, hook: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``hook`` (validation, test or predict step) over the micro-batches; forward only."""
        device, placement = self.placement.device, self.placement
        fn = getattr(self.module, hook)
        outputs, sizes = self.forward_only(hook, batch, lambda mb, j: fn(mb, *args, **kwargs))
        merged = merge_outputs(outputs, sizes) if self.executor.is_last else None
        if hook != "predict_step":
            self.broadcast_logs()  # evaluation sends nothing backward for its results to ride on
        elif placement.num_stages > 1:
            # every rank returns the predictions, as under DDP: scripts that use them run on every rank. They travel
            # as JSON and raw tensor bytes (never pickled); predictions holding other objects stay on the last stage
            try:
                shared = safe_objects.broadcast(merged, placement.last_rank, group=placement.pp_group)
            except TypeError as err:
                if not self._warned_predictions:
                    rank_zero_warn(f"ClappingStrategy: predict_step's outputs are returned on the last stage only "
                                   f"(the other stages get None): {err}")
                    self._warned_predictions = True
                shared = None
            if not self.executor.is_last:
                merged = None if shared is None else _compat.tree_map_tensors(lambda t: t.to(device), shared)
        return merged

    def forward_only(self, kind: str, batch: Any, fn: Any, check_size: bool = True) -> tuple[list[Any], list[int]]:
        """Collective over the pipeline: ``fn(microbatch, index)`` on every stage for each micro-batch of ``batch``,
        forward only (messages as evaluation sends them), its ``self.log`` calls recorded in the relay. Steps of each
        ``kind`` get their plan of the values crossing cuts first. Returns the last stage's outputs (else []) and the
        micro-batch sizes. ``check_size=False`` leaves the first batch's size check to a later batch."""
        microbatches, sizes = self._split(batch, check_size)
        relay = self.relay
        relay.clear()

        def step(mb: Any, j: int) -> Any:
            with relay.capture(sizes[j]):
                return fn(mb, j)

        if self.executor.needs_plan(kind):
            with self._reported(), first_pass.quiet(self.module, relay):
                self._report_plan(self.executor.plan_crossings(kind, microbatches[0], step))
        with self._reported(), self._settling_shared_owners():
            return self.executor.eval_step(microbatches, step, StepContext(sizes=sizes), kind), sizes

    def _warn_batch_coupling(self, sizes: list[int]) -> None:
        """Once: with several micro-batches, an operation of the step that mixes a batch's samples mixes those of one
        micro-batch (:mod:`lightning_clapping.pipeline.coupling`)."""
        crossings = self.runner.crossings
        found = coupling.batch_coupling(crossings.coupled, sizes[0]) if crossings and len(sizes) > 1 else None
        if found is not None:
            warnings.warn(
                f"ClappingStrategy: stage {self.placement.stage}'s part of the step calls `{found}` across the batch "
                f"(a permutation, flip or pairwise term over its {sizes[0]} samples), but with microbatches="
                f"{len(sizes)} the step sees one micro-batch at a time, so it mixes only the samples of each "
                "micro-batch, unlike one process with the whole batch. Use microbatches=1 for the one-process "
                "result.", UserWarning, stacklevel=2)

    @staticmethod
    def _report_plan(plan: Any) -> None:
        if plan.needs:
            rank_zero_info(f"ClappingStrategy: {plan.describe()}")

    # ------------------------------------------------------------------ what every step needs
    def _split(self, batch: Any, check_size: bool = True) -> tuple[list[Any], list[int]]:
        n = self.options.microbatches
        microbatches, sizes = split_batch(batch, n)
        if check_size and not self._checked_batch:
            self._checked_batch = True
            if sum(sizes) < n:
                raise ValueError(
                    f"microbatches={n} is larger than the batch ({sum(sizes)} samples): each "
                    f"micro-batch needs at least one sample. Use microbatches <= {sum(sizes)} or a larger batch size."
                )
        return microbatches, sizes

    def _reported(self) -> Any:
        return failures.reported(self.placement.stage, self.placement.global_rank, self.placement.num_ranks)

    def _step_context(self, trainer: pl.Trainer, batch_idx: int, sizes: list[int]) -> tuple[StepContext, int, Any]:
        """What every stage knows about this step: its number, whether the batch is fresh, its sample ids."""
        if not self._lazy_checked:
            self._lazy_checked = True
            self._lazy_loader = find_lazy_loader(trainer)
            if self._lazy_loader is None and self.options.variant in ("clapping-fc", "clapping-fu"):
                rank_zero_info(
                    f"ClappingStrategy: variant={self.options.variant!r} without LazySamplingDataModule: every batch "
                    "is fresh, so the error feedback works across unrelated batches (the ef21 baseline)."
                )
        step = trainer.global_step * trainer.accumulate_grad_batches + batch_idx % trainer.accumulate_grad_batches
        if self._lazy_loader is None:
            return StepContext(step=step, fresh=True, sample_ids=None, sizes=sizes), step, None
        info = self._lazy_loader.batch_info(batch_idx)
        ids = list(info.sample_ids.to(self.placement.device).split(sizes)) if info.sample_ids is not None else None
        return StepContext(step=step, fresh=info.fresh, sample_ids=ids, sizes=sizes), info.batch_id, info

    @contextmanager
    def _settling_shared_owners(self) -> Generator[None, None, None]:
        """At the first step: which stage uses each parameter that sits directly on a module spanning stages (such as
        ``self.pos = nn.Parameter(...)`` on the LightningModule)? That stage owns it (trains and saves it); the
        others hold an unused copy. Two users are refused. One all-gather of names (JSON), once."""
        if self._owners_settled or not self.partition.shared_params:
            yield
            return
        with self.runner.settling_shared_owners(self.module, self.placement.rank_of_stage, self.placement.pp_group):
            yield
        self._owners_settled = True
        owners = {k: self.partition.state_stage[k] for k in self.partition.shared_params}
        rank_zero_info(f"ClappingStrategy: parameters on modules that span stages, by owning stage: {owners}")

    # ------------------------------------------------------------------ results and logs
    def _step_results(self, outputs: list[Any], sizes: list[int], fingerprint: tuple[int, ...] | None) -> bytes:
        """On the last stage: the step's loss, its logged values and its batch fingerprint, as sent to the others."""
        total = sum(sizes)
        loss = sum(float(_loss(o).detach()) * n for o, n in zip(outputs, sizes)) / total
        self._local_logs = self.relay.combined()
        return pack_results(loss, self.relay.to_wire(self._local_logs), fingerprint)

    def _apply_results(self, blob: bytes, fingerprint: tuple[int, ...] | None) -> Tensor:
        """Log the last stage's values on this rank (every rank, so callback metrics agree) and check the batch."""
        loss, wire, last_fingerprint = unpack_results(blob)
        if fingerprint is not None and last_fingerprint is not None:
            failures.check_same_batch(fingerprint, last_fingerprint, self.placement.stage,
                                      self.module.trainer.global_step)
        device = self.placement.device
        self.relay.replay(wire, self._local_logs if self.executor.is_last else None, device)
        return torch.tensor(math.nan if loss is None else loss, device=device)

    def broadcast_logs(self) -> None:
        """Outside training steps: what the last stage logged reaches every rank with one broadcast."""
        placement = self.placement
        self._local_logs = self.relay.combined() if placement.is_last else None
        wire = self.relay.to_wire(self._local_logs) if self._local_logs is not None else None
        if placement.num_stages > 1:  # in the step results' binary layout: nothing a peer sends is unpickled
            blob = broadcast_results(None if wire is None else pack_results(None, wire, None), placement)
            wire = unpack_results(blob)[1]
        self.relay.replay(wire, self._local_logs, placement.device)

    def _log_step_stats(self, stats: StepStats, batch_size: int, info: Any) -> None:
        extra = {} if info is None else {"clapping/distinct_samples": info.distinct_samples,
                                          "clapping/fresh": float(info.fresh)}
        tied = None if self.ties is None else self.ties.step_bytes(self.module) if self._tie_sum_due else (0, 0)
        values = self.byte_stats.step(stats, extra, tied)  # the previous step's numbers: nothing waits for this step's
        ratio_on_bar = self.options.variant != "uncompressed"
        for name, value in values.items():
            pl.LightningModule.log(self.module, name, float(value), on_step=True, on_epoch=False,
                                   batch_size=batch_size, prog_bar=name == "clapping/ratio" and ratio_on_bar)


def _rng_base() -> int:
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def _mix(*values: int) -> int:
    """A well-spread 31-bit seed from a few integers (the same on every rank)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFF


def _loss(out: Any) -> Tensor:
    return out["loss"] if isinstance(out, dict) else out
