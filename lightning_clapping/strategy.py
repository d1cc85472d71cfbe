"""``ClappingStrategy``: the Lightning side of the pipeline.

One process per stage of each data-parallel replica of the pipeline (:mod:`lightning_clapping.comm.replicas`). Every
process runs the user's script and keeps only its own stage's tensors: a model built eagerly is cut after it was built
(the other stages move to the meta device); one built in ``configure_model()`` or under
``trainer.init_module(empty_init=True)`` is built on the meta device and each rank materializes only its stage
(:mod:`lightning_clapping.pipeline.materialize`). Each training step splits the batch into micro-batches, runs the
schedule (forwards and backwards of all micro-batches, messages between neighbours), and hands Lightning a finished set
of gradients: Lightning's own ``zero_grad`` and ``backward`` are turned into no-ops that still fire the user's hooks,
and the optimizer step, schedulers, gradient clipping (by the norm of the *whole* model) and accumulation run as usual.

With several replicas, each stage's gradients are averaged over its replicas before the optimizer step. The last stage
of replica 0 runs on global rank 0, so loggers and the progress bar, which act on rank 0, see the metrics first-hand;
the other ranks get the same values through :mod:`lightning_clapping.log_relay`.

The class is Lightning's hooks, each handing its work to a room: :mod:`.options`, :mod:`.launcher`,
:mod:`.stage_setup`, :mod:`.step_driver`, :mod:`.tuning` (message rules, autotune), :mod:`.collectives`,
:mod:`.checkpoint_hooks`; where this rank runs is one :class:`~lightning_clapping.comm.placement.Placement`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_clapping import _compat, bottleneck_fitting, checkpoint_hooks, launcher, shuffle, stage_setup
from lightning_clapping.checkpoint import state as ckpt
from lightning_clapping.checkpoint_hooks import StageCheckpoints
from lightning_clapping.codecs.feedback import MessageRule
from lightning_clapping.collectives import ReplicaCollectives
from lightning_clapping.comm.placement import Placement, Topology, build_mesh
from lightning_clapping.comm.step_results import ByteStats
from lightning_clapping.options import ClappingOptions, OptionAttributes, check_ranks
from lightning_clapping.pipeline.executor import PipelineExecutor
from lightning_clapping.pipeline.materialize import building_on_meta
from lightning_clapping.pipeline.partition import Partition, count_stage_bytes
from lightning_clapping.pipeline.stage import StageRunner
from lightning_clapping.stage_setup import Patches
from lightning_clapping.step_driver import StepDriver
from lightning_clapping.tuning import Tuning

log = logging.getLogger(__name__)


class ClappingStrategy(OptionAttributes, shuffle.SharedShuffle, ReplicaCollectives, ParallelStrategy):
    """Pipeline-parallel training: the model is cut into stages, one per process, and optionally replicated for
    data parallelism (``devices * num_nodes = stages * replicas``).

    Args:
        split_points: names of the submodules that start stages 1, 2, ... (``len(split_points) + 1`` stages, which
            must divide ``devices * num_nodes``: the quotient is the number of data-parallel replicas). ``None``
            balances the model's blocks by parameter count over ``stages`` stages and prints the stage table.
        stages: the number of pipeline stages when ``split_points`` is ``None`` (default: one stage per process, a
            single replica). ``devices * num_nodes / stages`` replicas each train on their own share of the data
            (Lightning's ``DistributedSampler``, or the lazy sampler's own sharding), and every stage's gradients
            are averaged over its replicas before the optimizer step, as under DDP.
        ddp_comm_hook, ddp_comm_state: a PyTorch DDP communication hook (``hook(state, bucket) -> Future``, e.g.
            ``bf16_compress_hook`` or ``powerSGD_hook`` with its state) for the every-step gradient average over the
            replicas; a ``None`` state (or ``process_group``) reduces over each stage's replicas.
        microbatches: micro-batches per batch. A batch smaller than this (the last one of an epoch) is split into
            as many micro-batches as it has samples.
        schedule: ``"1f1b"`` (default: activation memory bounded by the pipeline depth), ``"gpipe"`` (all
            micro-batches in flight: one fill and drain per step, faster on links with delay, more activation memory)
            or ``"auto"`` (with ``autotune=True``: 1F1B until autotune, which then keeps 1F1B unless its timing
            model predicts GPipe's step more than 5 % shorter).
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA by default.
        timeout: how long a stage waits for a message or collective before failing (so a dead stage does not leave
            the others hanging forever).
        liveness: how long a stage may send no heartbeat before the others declare it hung (stopped, swapping,
            deadlocked holding the GIL), kill it (same host) or drop their connections to it, and end the run with
            its name in rank 0's error (see :mod:`lightning_clapping.comm.liveness`); ``None`` turns the watchdog off.
            It does not cover a main thread stuck while its process runs: ``timeout`` bounds that.
        prepost_receives: post each step's receives before they are needed (default: on for gloo, off for NCCL,
            whose point-to-point calls ignore message tags).
        variant: how messages are compressed: ``"uncompressed"`` (default), ``"direct"``, ``"ef21"``, ``"aqsgd"``,
            ``"clapping-fc"`` or ``"clapping-fu"`` (see :mod:`lightning_clapping.codecs.feedback`). The Clapping variants
            are meant to run with :class:`~lightning_clapping.LazySamplingDataModule`.
        forward_codec, backward_codec: a :class:`~lightning_clapping.codecs.Codec` or a registry string
            (``"q4"``, ``"q8"``, ``"topk:0.1"``, ``"bf16"``, ...) for activations and gradients; ignored when
            ``variant="uncompressed"``. Or a dict from boundary index (boundary ``m`` lies between stages ``m`` and
            ``m + 1``) to codec, to compress some links only: boundaries missing from it, or mapped to ``None``, are
            sent uncompressed (e.g. ``{1: "q4"}`` compresses only the link between stages 1 and 2).
        fresh_codec: codec of the messages of fresh steps (a new batch) for ``"clapping-fc"``, ``"clapping-fu"`` and
            ``"ef21"``: Clapping-FU sends a fresh step with it instead of in full precision, Clapping-FC and EF21
            compress a fresh step's difference with it instead of the direction's codec. ``None`` (default): as
            without it.
        autotune: ``True``: after the second step, measure every link (delay, bandwidth each way), the compute and
            the codecs' work, and give each boundary and direction the least lossy setting from uncompressed down to
            its codec above (never beyond; a boundary a codec map leaves uncompressed stays so) whose predicted step
            (fresh steps priced) is within 5 % of the fastest. ``"frontier"``: on links too slow for that, also the
            published settings of this variant and p within 1 accuracy point / 2 % loss (a dict: ``frontier``,
            ``accuracy_points``, ``loss_percent``, ``step_tolerance``): :mod:`lightning_clapping.autotune.choose`.
            Rank 0 decides, all follow; the choice is printed, logged (``autotune/...``), checkpointed; compressed only.
        compress_eval: no effect yet: only tensors that require grad are compressed, and none do in evaluation.
        warm_start: send the first message of each slot (and after a shape change) in full precision.
        lazy_messages: skip a reuse-step message while the last difference sent on its slot was smaller than this
            fraction of the buffer's norm (``None``: off); at most ``max_skips`` skips in a row.
        sample_store_dtype: dtype of AQ-SGD's per-sample buffers (it keeps them in fp16).
        freeze_rng: seed each micro-batch's forward from the batch's identity, so dropout masks repeat while a
            batch is reused (lazy sampling) and differ between batches.
        recheck_every: the stages compare the values they recompute instead of receiving again every this many
            training steps (default 100; ``None``: at the first step of each kind only). See README.
        log_bytes: log per step the bytes each boundary sent per direction (``clapping/b{m}_fwd_bytes``,
            ``clapping/b{m}_bwd_bytes``, ``clapping/bytes``), the compression ratio against fp32 (``clapping/ratio``,
            also on the progress bar), the relative norm of the compressed differences (``clapping/fwd_rel_diff``,
            ``clapping/bwd_rel_diff``) and the error-feedback memory (``clapping/feedback_bytes``).
        state_dict_type: ``"full"`` (default): checkpoints are one ordinary Lightning file, gathered on rank 0 (which
            then needs memory for the whole model), and after each run the launching process's module holds the whole
            trained model. ``"sharded"``: every stage writes its own tensors, in parallel, into a
            ``torch.distributed.checkpoint`` folder in Lightning's FSDP layout (no rank ever holds more than its stage);
            the module in the launching process keeps only its own stage after a run, and the trained model is in the
            checkpoint (``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER`` makes one file of it).
        start_method: only ``"popen"``; spawn and fork are refused with the reason.
        activation_checkpointing: recompute activations in backward instead of keeping them, per stage: ``True`` for
            the model's blocks, or a set of module classes (see :mod:`lightning_clapping.pipeline.recompute`); the
            recompute sees the same dropout masks. ``None`` (default): off.
        tied_codec: codec of the sum of a tied tensor's gradients across stages (``"q8"``; error feedback), ``None``:
            fp32. See README "How a model is cut".
        pretrained: a safetensors checkpoint each stage reads its own tensors from once it has materialized them from
            the meta device, or ``{"model": path}`` for a submodule's (``self.model``) keys; see README "Big models".
        fault_tolerance: ``"torchft"`` or a :class:`~lightning_clapping.FaultTolerance`: each replica is a job of
            its own that drops out when it loses a process, and rejoins (docs/fault_tolerance.md). Default: off.
        replica_sync: how each stage's replicas stay together: ``"every-step"`` (default: gradients averaged before
            every optimizer step), ``"lag"`` / :class:`~lightning_clapping.LAG` (lazily aggregated gradients) or
            ``"diloco"`` / :class:`~lightning_clapping.DiLoCo` (local steps, an outer step every ``inner_steps``).
            See README "Data parallel over slow links".
    """

    strategy_name = "clapping"

    def __init__(
        self,
        split_points: list[str] | None = None,
        stages: int | None = None,
        ddp_comm_hook: Any = None,
        ddp_comm_state: Any = None,
        microbatches: int = 4,
        schedule: Literal["1f1b", "gpipe", "auto"] = "1f1b",
        variant: str = "uncompressed",
        forward_codec: Any = "q4",
        backward_codec: Any = "q8",
        fresh_codec: Any = None,
        autotune: bool | Literal["frontier"] | dict[str, Any] = False,
        compress_eval: bool = False,
        warm_start: bool = True,
        lazy_messages: float | None = None,
        max_skips: int = 2,
        sample_store_dtype: torch.dtype | None = torch.float16,
        freeze_rng: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        liveness: timedelta | None = timedelta(seconds=30),
        prepost_receives: bool | None = None,
        log_bytes: bool = True,
        state_dict_type: Literal["full", "sharded"] = "full",
        start_method: Literal["popen"] = "popen", fault_tolerance: Any = None,
        activation_checkpointing: Any = None, tied_codec: Any = None, pretrained: Any = None,
        recheck_every: int | None = 100, replica_sync: Any = "every-step",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = ClappingOptions.check(
            split_points=split_points, stages=stages, ddp_comm_hook=ddp_comm_hook, ddp_comm_state=ddp_comm_state,
            microbatches=microbatches, schedule=schedule, variant=variant, forward_codec=forward_codec,
            backward_codec=backward_codec, fresh_codec=fresh_codec, autotune=autotune, compress_eval=compress_eval,
            warm_start=warm_start, lazy_messages=lazy_messages, max_skips=max_skips,
            sample_store_dtype=sample_store_dtype, freeze_rng=freeze_rng, process_group_backend=process_group_backend,
            timeout=timeout, liveness=liveness, prepost_receives=prepost_receives, log_bytes=log_bytes,
            state_dict_type=state_dict_type, start_method=start_method, fault_tolerance=fault_tolerance,
            activation_checkpointing=activation_checkpointing, tied_codec=tied_codec, pretrained=pretrained,
            recheck_every=recheck_every, replica_sync=replica_sync,
        )
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._tuning = Tuning(self.options)  # the message rules, and autotune's choice: kept across runs
        self._checkpoints = StageCheckpoints(self.options)
        self._patches = Patches()  # what the run changed on the module and the trainer, undone at teardown
        self._placement: Placement | None = None  # built in setup_environment
        self._watchdog: Any = None
        self.partition: Partition | None = None
        self.runner: StageRunner | None = None
        self.executor: PipelineExecutor | None = None
        self._steps: StepDriver | None = None
        self._byte_stats: ByteStats | None = None  # its totals stay readable after teardown
        self._full_state: dict[str, Tensor] | None = None  # rank 0's whole model, loaded back at teardown

    @property
    def schedule(self) -> str:
        """The schedule that runs (autotune may switch it under ``schedule="auto"``)."""
        return self._tuning.schedule

    @property
    def autotuned(self) -> dict[int, Any] | None:
        """Autotune's choice, ``{boundary: autotune.Choice}`` (``None`` before it decided, or without autotune)."""
        return self._tuning.choices

    def fit_bottlenecks(self, batches: Any, run: Any, positions: Any = None) -> dict[str, float]:
        """Collective (:class:`~lightning_clapping.FitBottlenecks` calls it): see :mod:`.bottleneck_fitting`."""
        return bottleneck_fitting.fit_on_stages(self._driver, batches, run, positions)

    def set_codecs(self, forward_codec: Any, backward_codec: Any) -> None:
        """Training codecs from the next step on; every rank calls it between the same two steps (CodecScheduler)."""
        self._tuning.set_codecs(forward_codec, backward_codec, self.executor)

    # ------------------------------------------------------------------ topology
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]  # type: ignore[index]  # set by the connector before use

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_ranks(self) -> int:
        """All the processes of the run: ``num_stages * num_replicas``."""
        return self.num_nodes * self.num_processes

    @property
    def num_stages(self) -> int:
        """Pipeline stages per replica, one process each."""
        return self.options.num_stages(self.num_ranks)

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return max(1, self.num_ranks // self.num_stages)

    @property
    def placement(self) -> Placement:
        """This rank's stage, replica, device and process groups, built once in :meth:`setup_environment`. Before
        that (while Lightning sets up the ranks), the same arithmetic from the Trainer's devices, without groups."""
        if self._placement is not None:
            return self._placement
        device = self.root_device if self.num_processes else torch.device("cpu")
        return Placement(self.topology, self.global_rank, device)

    @property
    def topology(self) -> Topology:
        """Stages x replicas on the nodes: the placement's, or before it exists the Trainer's devices' arithmetic."""
        if self._placement is not None:
            return self._placement.topology
        return Topology(self.num_stages, self.num_replicas, max(1, self.num_processes))

    @property
    def world_size(self) -> int:
        """Data-parallel replicas (``trainer.world_size``, what code dividing a global batch by the model replicas
        reads, as under DDP); the processes are :attr:`num_ranks`. Lightning's per-step SIGTERM broadcast is off
        (see :meth:`setup`): a preempted run's processes each get the signal from the launcher or the scheduler."""
        return self.num_replicas

    @property
    def byte_totals(self) -> dict[str, float]:
        """Sums over the training steps so far, on every rank: ``bytes`` (everything sent: messages, results, tied
        sums, replica sync), ``raw_bytes`` (the same uncompressed, fp32), ``control_bytes``, ``tied_bytes``,
        ``replica_bytes``, ``crossing_raw_bytes``, ``skipped_messages``, ``fresh_steps``, ``steps`` (README)."""
        if self._byte_stats is None:
            return {}
        self._byte_stats.finish()
        return dict(self._byte_stats.totals)

    @property
    def stage(self) -> int:
        """This rank's stage. The last stage of replica 0 runs on global rank 0 (see the module docstring)."""
        return self.placement.stage

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.placement.replica

    def rank_of_stage(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's replica."""
        return self.placement.rank_of_stage(stage)

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_ranks)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes:  # the processes must hold a whole number of replicas, laid out alike on the nodes
            check_ranks(self.options, self.topology, self.num_processes, self.num_nodes,
                        {d.type for d in self.parallel_devices or ()})

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = launcher.ClappingLauncher(self.check_model, self.cluster_environment, self.num_processes,
                                          self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        _compat.reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _compat.default_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        launcher.connect(self.cluster_environment, self._process_group_backend, self.options.timeout)
        topology, groups = self.topology, (None, None)
        if self.num_ranks > 1:
            mesh = build_mesh(topology, self.root_device.type)
            groups = mesh.get_group("pp"), mesh.get_group("dp")
        self._placement = Placement(topology, self.global_rank, self.root_device, *groups)
        if self.options.liveness is not None and self.num_ranks > 1:
            self._watchdog = launcher.start_watchdog(self._placement, self.options.liveness)

    # ------------------------------------------------------------------ building big models
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; each rank materializes its stage."""
        with building_on_meta() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def model_sharded_context(self) -> Any:
        """Layers created in ``configure_model()`` land on the meta device; each rank materializes its stage."""
        return building_on_meta()

    # ------------------------------------------------------------------ setup
    def check_model(self, model: pl.LightningModule, partition: bool = True) -> Partition | None:
        """Everything that can be checked before processes start: raises with a message that says what to change.

        ``partition=False`` skips cutting the model (its layers may not exist yet: ``configure_model()`` runs later).
        """
        return stage_setup.check_model(model, self.precision_plugin, self.options, self.num_stages, partition)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, placement, patches = self.lightning_module, self.placement, self._patches
        self.partition, self.runner = stage_setup.build_stage(trainer, module, self.options, placement,
                                                              self.precision_plugin, self.schedule, patches)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            stage_setup.check_tied_param_groups(self.optimizers, module, self.partition, placement)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        stage_setup.isolate_metrics(module, placement.dp_group, patches)
        prepost = self.options.prepost_receives
        self.executor = PipelineExecutor(self.runner, placement, self.make_rule, schedule=self.schedule,
                                         timeout=self.options.timeout, step_results=True,
                                         prepost=self._process_group_backend == "gloo" if prepost is None else prepost,
                                         rng_handoff=not self.options.freeze_rng,
                                         recheck_every=self.options.recheck_every)
        self._byte_stats = ByteStats(placement, self.options.lazy_messages is not None)
        self._steps = StepDriver(module, self.options, placement, self.partition, self.runner, self.executor,
                                 self.precision_plugin, self._byte_stats, self._tuning)
        self._steps.patch_hooks(patches)
        log.debug("stage %d holds %d parameter bytes", self.stage, count_stage_bytes(module))

    def model_to_device(self) -> None:
        assert self.runner is not None
        stage_setup.move_to_device(self.lightning_module, self.runner, self.partition, self.root_device)

    def make_rule(self, boundary: int, direction: str, training: bool) -> MessageRule:
        """The encoder/decoder of one boundary and direction (both ends build the same one)."""
        return self._tuning.make_rule(boundary, direction, training)

    def restore_checkpoint_after_setup(self) -> bool:
        return True

    # ------------------------------------------------------------------ steps
    @property
    def _driver(self) -> StepDriver:
        assert self._steps is not None, "steps run between setup() and teardown()"
        return self._steps

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._driver.train(self.optimizers, batch, batch_idx, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._driver.evaluate("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._driver.evaluate("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._driver.evaluate("predict_step", *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Gradients were computed by the pipeline inside ``training_step``; only the hooks run here (and, with
        replicas, the wait for the gradients' average, before clipping and the optimizer step see them)."""
        if self._steps is not None:
            self._steps.finish_average()
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        step = super().optimizer_step  # the replica sync may vote on the update, and acts after it
        return self._driver.optimizer_step(lambda c: step(optimizer, c, model, **kwargs), closure)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._driver.before_batch()

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)  # shared shuffling, then the replica sync (a group joins)
        return self._steps.process_dataloader(loader) if self._steps is not None else loader

    # ------------------------------------------------------------------ checkpoints (see checkpoint_hooks)
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.partition is not None
        return self._checkpoints.model_state(self.lightning_module, self.partition, self.placement)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self.lightning_module, optimizer, self.placement)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Adds every stage's error-feedback buffers, so a compressed run resumes exactly."""
        rooms, placement, module = self._checkpoints, self.placement, self.lightning_module
        rooms.add_run_record(checkpoint, self.partition, self.num_stages, self._tuning)
        feedback = rooms.feedback_state(self.executor, placement, self._steps)
        if self.options.state_dict_type == "full":
            with checkpoint_hooks.plain_forwards(self.runner), stage_setup.whole_buffers(module, placement):
                rooms.complete_full(checkpoint, feedback, placement, module, filepath)
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        with checkpoint_hooks.plain_forwards(self.runner):
            rooms.save_sharded(checkpoint, path, feedback, placement)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        else:
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder: every rank reads only its own tensors by name; returns the rest (``meta.pt``)."""
        weights_only = _compat.restore_weights_only(self.lightning_module, weights_only)
        path = Path(self.broadcast(str(checkpoint_path)))
        self._checkpoints.sharded_loaded = ckpt.is_sharded_checkpoint(path)
        if not self._checkpoints.sharded_loaded:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.partition is not None
        module = self.lightning_module
        meta, feedback = self._checkpoints.load_sharded(path, module, self.partition, self.placement, self.optimizers,
                                                        module.trainer.state.fn == TrainerFn.FITTING, weights_only)
        self._restore_feedback({**meta, "clapping_feedback": feedback})
        return meta

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._checkpoints.sharded_loaded  # a sharded checkpoint's optimizer state was read at load

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._checkpoints.sharded_loaded:
            return  # read in load_checkpoint()
        assert self.partition is not None
        self._checkpoints.load_model(checkpoint, self.lightning_module, self.partition, self.stage, strict)
        self._restore_feedback(checkpoint)

    def _restore_feedback(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_hooks.restore_feedback(checkpoint, self.partition, self.executor, self.placement, self._tuning,
                                          self._steps)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._checkpoints.sharded_loaded:
            return  # read in load_checkpoint()
        self._checkpoints.load_optimizers(checkpoint, self.lightning_module, self.optimizers, self.root_device)

    # ------------------------------------------------------------------ end of a run
    def _gather_full_weights(self) -> None:
        """Collective, at the end of every ``"full"`` run: the whole model and non-persistent buffers to rank 0, for the
        launching process's module at teardown (a sharded run's trained model is in its sharded checkpoint)."""
        if self.options.state_dict_type == "sharded":
            return
        state = self.lightning_module_state_dict()
        state.update(stage_setup.foreign_buffers(self.lightning_module, self.placement))
        self._full_state = state if self.global_rank == 0 else None

    def on_train_end(self) -> None:
        if self._steps is not None:
            self._steps.end_of_fit()
        if self._byte_stats is not None:
            self._byte_stats.finish()  # the last step's numbers, into the totals (also after teardown)
        self._gather_full_weights()

    def on_validation_end(self) -> None:
        if self.lightning_module.trainer.state.fn == TrainerFn.VALIDATING:
            self._gather_full_weights()

    on_test_end = on_predict_end = _gather_full_weights

    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # marks this rank done: ranks that finish later do not declare it hung
            self._watchdog = None
        stage_setup.release_stage(self.lightning_module, self.runner, self._patches, self._full_state, self.optimizers)
        self._full_state = None
        if self.executor is not None:  # for a checkpoint saved after fit returns
            self._checkpoints.last_feedback = checkpoint_hooks.rank_buffers(self.executor, self._steps)
        if self._steps is not None:
            self._steps.close()
        self.runner = self.executor = self._steps = None
        assert self.accelerator is not None
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("clapping", cls,
                                   description="Pipeline-parallel training with compressed inter-stage messages")
