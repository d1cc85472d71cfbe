"""``ClappingStrategy``: the Lightning side of the pipeline.

One process per stage of each data-parallel replica of the pipeline (:mod:`lightning_clapping.comm.replicas`). Every
process runs the user's script and keeps only its own stage's tensors: a model built
eagerly is cut after it was built (the other stages move to the meta device); one built in ``configure_model()`` or
under ``trainer.init_module(empty_init=True)`` is built on the meta device and each rank materializes only its
stage (:mod:`lightning_clapping.pipeline.materialize`). Each training step splits the batch into
micro-batches, runs the schedule (forwards and backwards of all micro-batches, messages between neighbours), and
hands Lightning a finished set of gradients: Lightning's own ``zero_grad`` and ``backward`` are turned into no-ops
that still fire the user's hooks, and the optimizer step, schedulers, gradient clipping (by the norm of the *whole*
model) and accumulation run as usual.

With several replicas, each stage's gradients are averaged over its replicas before the optimizer step.
The last stage of replica 0 runs on global rank 0, so loggers and the progress bar, which act on rank 0, see the metrics
first-hand; the other ranks get the same values through :mod:`lightning_clapping.log_relay`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_clapping import _compat
from lightning_clapping.checkpoint import state as ckpt
from lightning_clapping import precision
from lightning_clapping.autotune import tune as autotune
from lightning_clapping.pipeline import recompute as checkpointing
from lightning_clapping.comm import failures
from lightning_clapping.comm import liveness
from lightning_clapping.data import LazySamplingDataModule
from lightning_clapping.codecs import get_codec
from lightning_clapping.data import find_lazy_loader
from lightning_clapping.pipeline.executor import PipelineExecutor, StepStats
from lightning_clapping.codecs.feedback import MessageRule, StepContext, check_variant
from lightning_clapping.log_relay import LogRelay
from lightning_clapping.pipeline.materialize import materialize
from lightning_clapping.pipeline.microbatch import merge_outputs, split_batch
from lightning_clapping.pipeline.partition import Partition, build_partition, count_stage_bytes
from lightning_clapping.comm.placement import Placement, Topology, build_mesh
from lightning_clapping.comm.replicas import GradientAverager
from lightning_clapping.pipeline.schedule import SCHEDULES, get_schedule
from lightning_clapping.pipeline.stage import StageRunner
from lightning_clapping.comm.step_results import ByteStats, pack_results, unpack_results

log = logging.getLogger(__name__)

_SPAWN_REFUSED = (
    "ClappingStrategy launches one process per stage by re-running your script (start_method='popen', as "
    "`python train.py`, torchrun or SLURM do). {how} is refused: a spawned or forked run copies back only rank 0's "
    "weights when it ends, so a model cut into stages would silently come back with most of its weights untrained."
)


class ClappingStrategy(ParallelStrategy):
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
        ddp_comm_hook, ddp_comm_state: compress the replicas' gradient averaging with one of PyTorch's DDP
            communication hooks (``hook(state, bucket) -> Future``, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`` or ``powerSGD_hook``
            with a ``PowerSGDState``), worth it when the replicas sit behind slow links too. A ``None`` state (or a
            state whose ``process_group`` is ``None``) reduces over each stage's replicas. Ignored with one replica.
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
        autotune: after the second training step, measure each boundary's link (one-way delay, bandwidth of each
            direction, with timed probe messages between neighbours), the stages' compute time and the codecs' work
            on the real messages, and give every boundary and direction the least lossy setting, from uncompressed
            up to the codec given above, that keeps the step the timing model predicts for the schedule (compute,
            transfers, delays) within 5 % of the fastest (see :mod:`lightning_clapping.autotune.tune`). Rank 0 decides,
            every rank follows; the choice is printed, logged (``autotune/...``), kept for the rest of the run and saved in checkpoints.
            Needs a compressed ``variant``.
        compress_eval: also compress validation/test/predict activations (directly, with ``forward_codec``).
        warm_start: send the first message of each slot (and after a shape change) in full precision.
        lazy_messages: skip a reuse-step message while the last difference sent on its slot was smaller than this
            fraction of the buffer's norm (``None``: off); at most ``max_skips`` skips in a row.
        sample_store_dtype: dtype of AQ-SGD's per-sample buffers (it keeps them in fp16).
        freeze_rng: seed each micro-batch's forward from the batch's identity, so dropout masks repeat while a
            batch is reused (lazy sampling) and differ between batches.
        log_bytes: log per step the bytes each boundary sent per direction (``clapping/b{m}_fwd_bytes``,
            ``clapping/b{m}_bwd_bytes``, ``clapping/bytes``), the compression ratio against fp32
            (``clapping/ratio``, also on the progress bar), the relative norm of the compressed differences
            (``clapping/fwd_rel_diff``, ``clapping/bwd_rel_diff``) and the error-feedback memory
            (``clapping/feedback_bytes``).
        state_dict_type: ``"full"`` (default): checkpoints are one ordinary Lightning file, gathered on rank 0 (which
            then needs memory for the whole model), and after each run the launching process's module holds the
            whole trained model. ``"sharded"``: every stage writes its own tensors, in parallel, into a
            ``torch.distributed.checkpoint`` folder in Lightning's FSDP layout (no rank ever holds more than its
            stage); the module in the launching process keeps only its own stage after a run, and the trained model
            is in the checkpoint (``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER`` makes one
            file of it).
        start_method: only ``"popen"``; spawn and fork are refused with the reason.
        activation_checkpointing: recompute activations in backward instead of keeping them, per stage: ``True`` for
            the model's blocks, or a set of module classes (see :mod:`lightning_clapping.pipeline.recompute`); the
            recompute sees the same dropout masks. ``None`` (default): off.
    """

    strategy_name = "clapping"

    def __init__(
        self,
        split_points: list[str] | None = None,
        stages: int | None = None,
        ddp_comm_hook: Any = None,
        ddp_comm_state: Any = None,
        microbatches: int = 4,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        variant: str = "uncompressed",
        forward_codec: Any = "q4",
        backward_codec: Any = "q8",
        fresh_codec: Any = None,
        autotune: bool = False,
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
        start_method: Literal["popen"] = "popen",
        activation_checkpointing: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method != "popen":
            raise ValueError(_SPAWN_REFUSED.format(how=f"start_method={start_method!r}"))
        if state_dict_type not in ckpt.STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type must be 'full' (one checkpoint file, gathered on rank 0) or 'sharded' (one shard "
                f"per stage, written in parallel), got {state_dict_type!r}"
            )
        self.state_dict_type = state_dict_type
        self.activation_checkpointing = checkpointing.check_policy(activation_checkpointing)
        self._sharded_loaded = False
        if split_points is not None:
            if isinstance(split_points, str) or not all(isinstance(s, str) for s in split_points):
                raise TypeError(f"split_points must be a list of module names, got {split_points!r}")
            split_points = list(split_points)
            if not split_points:
                raise ValueError("split_points=[] makes one stage; give the names of the modules that start stages "
                                 "1, 2, ... or None to balance the model automatically")
        if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
            raise ValueError(f"stages must be a positive integer (pipeline stages per replica) or None, got {stages!r}")
        if stages is not None and split_points is not None and len(split_points) + 1 != stages:
            raise ValueError(
                f"stages={stages} disagrees with split_points={split_points}, which cut the model into "
                f"{len(split_points) + 1} stages: give split_points with {stages - 1} names, or drop stages= (the "
                "split points set the number of stages)"
            )
        self._stages_arg = stages
        if ddp_comm_hook is not None and not callable(ddp_comm_hook):
            raise TypeError(f"ddp_comm_hook must be a DDP communication hook, hook(state, bucket) -> Future, such as "
                            f"default_hooks.bf16_compress_hook; got {ddp_comm_hook!r}")
        self._comm_hook, self._comm_state = ddp_comm_hook, ddp_comm_state
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        if not isinstance(schedule, str) or schedule.lower() not in (*SCHEDULES, "auto"):
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} or 'auto'")
        if schedule.lower() == "auto" and not autotune:
            raise ValueError("schedule='auto' lets autotune choose the schedule: pass autotune=True with it (and a "
                             "compressed variant), or name the schedule ('1f1b' or 'gpipe')")
        self.variant = check_variant(variant)
        self.forward_codec = _codec_or_map(forward_codec, "forward_codec")
        self.backward_codec = _codec_or_map(backward_codec, "backward_codec")
        self.fresh_codec = None if fresh_codec is None else get_codec(fresh_codec)
        if fresh_codec is not None and self.variant not in ("ef21", "clapping-fc", "clapping-fu"):
            raise ValueError(f"fresh_codec applies to the error-feedback variants (ef21, clapping-fc, clapping-fu), "
                             f"not to variant={self.variant!r}")
        if autotune and self.variant == "uncompressed":
            raise ValueError("autotune=True chooses codecs for a compressed variant, up to forward_codec and "
                             "backward_codec; pass variant='clapping-fc' (or another compressed variant)")
        self.autotune = bool(autotune)
        self._autotuned: dict[int, Any] | None = None  # boundary -> autotune.Choice, once decided
        if lazy_messages is not None and not (isinstance(lazy_messages, (int, float)) and not isinstance(
                lazy_messages, bool) and 0 < lazy_messages < math.inf):
            raise ValueError(f"lazy_messages must be a positive finite threshold (e.g. 0.03) or None, got "
                             f"{lazy_messages!r}")
        if not isinstance(max_skips, int) or isinstance(max_skips, bool) or max_skips < 0:
            raise ValueError(f"max_skips must be a non-negative integer (skipped messages in a row), got {max_skips!r}")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive datetime.timedelta, e.g. timedelta(minutes=10), got "
                             f"{timeout!r}")
        if liveness is not None and (not isinstance(liveness, timedelta) or liveness.total_seconds() < 0.4):
            raise ValueError(f"liveness must be a datetime.timedelta of at least 0.4 s (e.g. timedelta(seconds=30)) or "
                             f"None to turn the watchdog off, got {liveness!r}")
        self._liveness = liveness
        self._watchdog: Any = None
        self.compress_eval = compress_eval
        self.warm_start = warm_start
        self.lazy_messages = lazy_messages
        self.max_skips = max_skips
        self.sample_store_dtype = sample_store_dtype
        self.freeze_rng = freeze_rng
        self._lazy_loader: Any = None
        self._lazy_checked = False
        self._last_feedback: dict[str, Any] = {}
        self.split_points = split_points
        self.microbatches = microbatches
        self.schedule_auto = schedule.lower() == "auto"
        self.schedule = "1f1b" if self.schedule_auto else schedule.lower()
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._prepost = prepost_receives
        self.log_bytes = log_bytes
        self._num_nodes = 1
        self.partition: Partition | None = None
        self.runner: StageRunner | None = None
        self.executor: PipelineExecutor | None = None
        self._relay: LogRelay | None = None
        self._full_state: dict[str, Tensor] | None = None
        self._patched: list[tuple[Any, str, bool, Any]] = []
        self._mesh: Any = None
        self._pp_group: Any = None  # this replica's stages
        self._dp_group: Any = None  # this stage's replicas
        self._averager: GradientAverager | None = None
        self._checked_batch = False
        self._byte_stats: ByteStats | None = None
        self._local_logs: list[Any] | None = None
        self._owners_settled = False
        self._train_steps = 0

    # ------------------------------------------------------------------ topology
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

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
        if self.split_points is not None:
            return len(self.split_points) + 1
        return self._stages_arg if self._stages_arg is not None else self.num_ranks

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return max(1, self.num_ranks // self.num_stages)

    @property
    def topology(self) -> Topology:
        return Topology(self.num_stages, self.num_replicas, max(1, self.num_processes))

    @property
    def world_size(self) -> int:
        """Data-parallel replicas of the pipeline. This is ``trainer.world_size``, what code that divides a global
        batch size by the number of model replicas reads, as under DDP (every stage of a replica sees the same whole
        batch). The number of processes is :attr:`num_ranks`. Lightning's per-step broadcast of its SIGTERM flag
        (and the one from its signal handler: a collective that a stage blocked in a pipeline transfer never joins)
        is turned off in :meth:`setup`: a preempted run's processes each get the signal from the launcher or the
        scheduler and stop."""
        return self.num_replicas

    @property
    def byte_totals(self) -> dict[str, float]:
        """Sums over the training steps so far, on every rank: ``bytes`` sent between stages (headers and step results
        included), ``raw_bytes`` (the same messages uncompressed, fp32), ``control_bytes`` (the step results),
        ``skipped_messages``, ``fresh_steps`` and ``steps``. Exact up to the last finished step: reading them waits
        for that step's numbers (which the logged values only show a step later)."""
        if self._byte_stats is None:
            return {}
        self._byte_stats.finish()
        return dict(self._byte_stats.totals)

    @property
    def stage(self) -> int:
        """This rank's stage. The last stage of replica 0 runs on global rank 0 (see the module docstring)."""
        return self.stage_of_rank(self.global_rank)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.topology.replica_of(self.global_rank)

    def rank_of_stage(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's replica."""
        return self.topology.rank(self.replica, stage)

    def stage_of_rank(self, rank: int) -> int:
        return self.topology.stage_of(rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a replica sees the same batch; replicas shard the data as DDP's ranks do (with one replica,
        # setup() stops Lightning from injecting a sampler at all: the data must come in the user's own order)
        return {"num_replicas": self.num_replicas, "rank": self.replica}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_ranks)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes:
            self._check_ranks()

    def _check_ranks(self) -> None:
        """The processes must hold a whole number of replicas, laid out alike on the nodes."""
        ranks, stages = self.num_ranks, self.num_stages
        given = (f"split_points={self.split_points} cut the model into {stages} stages" if self.split_points is not None
                 else f"stages={stages}")
        if ranks % stages:
            fits = [d for d in range(1, ranks + 1) if ranks % d == 0]
            raise ValueError(
                f"{given}, but the Trainer starts {ranks} processes (devices={self.num_processes}, num_nodes="
                f"{self.num_nodes}), which is not a whole number of pipeline replicas of {stages} stages. "
                f"devices x num_nodes must be stages x replicas: use a number of stages among {fits}, or "
                f"devices={stages} (x num_nodes) for one replica."
            )
        self.topology.check()
        devices = {d.type for d in self.parallel_devices or ()}
        if self._process_group_backend == "nccl" and devices != {"cuda"}:
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA devices, but this Trainer runs on {sorted(devices)}: use "
                "accelerator='gpu' on a machine with CUDA, or process_group_backend='gloo' (the default on CPU)"
            )

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _ClappingLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        _compat.reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _compat.default_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        _compat.init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        if self.num_ranks > 1:
            self._mesh = build_mesh(self.topology, self.root_device.type)
            self._pp_group, self._dp_group = self._mesh.get_group("pp"), self._mesh.get_group("dp")
        if self._liveness is not None and self.num_ranks > 1:
            bound = self._liveness.total_seconds()
            # under torchrun the store lives in the elastic agent, not in rank 0's process
            elastic = type(self.cluster_environment).__name__ == "TorchElasticEnvironment"
            self._watchdog = liveness.Watchdog(
                _compat.default_store(), self.global_rank, self.num_ranks, stage_of_rank=self.stage_of_rank,
                interval=min(1.0, bound / 8), bound=bound, store_rank=None if elastic else 0,
            ).start()

    # ------------------------------------------------------------------ building big models
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; each rank materializes its stage."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Layers created in ``configure_model()`` land on the meta device; each rank materializes its stage."""
        with torch.device("meta"):
            yield

    # ------------------------------------------------------------------ checks done before any work
    def check_model(self, model: pl.LightningModule, partition: bool = True) -> Partition | None:
        """Everything that can be checked before processes start: raises with a message that says what to change.

        ``partition=False`` skips cutting the model (its layers may not exist yet: ``configure_model()`` runs later).
        """
        if not model.automatic_optimization:
            raise ValueError(
                "ClappingStrategy supports automatic optimization only: the pipeline runs forward and backward of all "
                "micro-batches inside one training step. Remove `self.automatic_optimization = False` and return the "
                "loss from training_step."
            )
        precision.check_plugin(self.precision_plugin, self.variant)
        return build_partition(model, self.num_stages, self.split_points) if partition else None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.partition = self.check_model(module)
        assert self.partition is not None
        self._check_same_cuts()
        if trainer.state.fn == TrainerFn.FITTING:
            rank_zero_info(f"ClappingStrategy: {self.num_stages} stages, schedule {self.schedule}, "
                           f"{self.microbatches} micro-batches\n{self.partition.table()}\n{self.topology.describe()}")
        self._warn_batchnorm(module)
        self._warn_empty_stages()
        self._check_codec_boundaries()
        self.runner = StageRunner(module, self.partition, self.stage, self.activation_checkpointing)
        self.runner.release_foreign_state()
        self._materialize_own_stage(module)
        self.runner.install()
        self._patch(module, "optimizer_zero_grad", None)
        for hook in _EPOCH_END_HOOKS:
            self._patch(module, hook, self._on_last_stage(getattr(module, hook)))
        if self.num_replicas == 1:
            if self._comm_hook is not None:
                rank_zero_warn("ddp_comm_hook is ignored: with one pipeline replica there are no gradients to average")
            # one pipeline replica: the data must come in the user's own order, so Lightning injects no sampler
            self._patch(_compat.accelerator_connector(trainer), "use_distributed_sampler", False)
        else:
            self._shard_lazy_data(trainer)
            self._averager = GradientAverager(self._dp_group, self.num_replicas, comm_hook=self._comm_hook,
                                              comm_state=self._comm_state)
        if self.num_ranks > 1:
            for obj, name, value in _compat.sigterm_without_collectives(trainer):
                self._patch(obj, name, value)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self._patch(self.precision_plugin, "clip_grad_by_norm", self._clip_grad_by_norm)
        self._relay = LogRelay(module)
        self._isolate_metrics(module)
        prepost = self._prepost if self._prepost is not None else self._process_group_backend == "gloo"
        self.executor = PipelineExecutor(
            self.runner,
            self.rank_of_stage,
            self.root_device,
            self.make_rule,
            schedule=self.schedule,
            prepost=prepost,
            timeout=self._timeout,
            step_results=True,
        )
        self._byte_stats = ByteStats(self.num_stages, self.rank_of_stage, self.lazy_messages is not None,
                                     group=self._pp_group)
        self._owners_settled = False
        self._checked_batch = False
        self._lazy_checked = False
        self._lazy_loader = None
        log.debug("stage %d holds %d parameter bytes", self.stage, count_stage_bytes(module))

    def _check_same_cuts(self) -> None:
        """Collective, once per run: every process must have cut the model at the same modules (a node started with
        other split points, whose boundary tensors happen to have the same shapes, would train silently wrong)."""
        if self.num_ranks == 1:
            return
        assert self.partition is not None
        cuts: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(cuts, list(self.partition.cut_points))
        other = next((r for r, c in enumerate(cuts) if c != cuts[0]), None)
        if other is not None:
            raise ValueError(
                f"the processes cut the model differently: rank 0 at {cuts[0]}, rank {other} at {cuts[other]}. "
                "Start every process (every node) with the same code and the same split_points / stages."
            )

    def _on_last_stage(self, user_hook: Any) -> Any:
        """An epoch-end hook runs on the last stage only, where the step outputs it reads exist (the earlier stages
        never reach the code after their cut); what it logs is relayed to every rank, like the steps' logs."""

        def hook() -> None:
            assert self._relay is not None
            self._relay.clear()
            if self.stage == self.num_stages - 1:
                with self._relay.capture(1):
                    user_hook()
            self._broadcast_logs()

        return hook

    def _warn_empty_stages(self) -> None:
        assert self.partition is not None
        empty = [s for s, n in enumerate(self.partition.stage_params) if n == 0]
        if empty and not self.partition.shared_params:
            firsts = ("<start>",) + self.partition.cut_points
            rank_zero_warn(
                f"ClappingStrategy: stage(s) {', '.join(f'{s} (from {firsts[s]!r})' for s in empty)} hold no "
                "parameters: such a process only passes activations on, and adds a link and its delay to every step. "
                f"Choose split_points that give every stage some layers, or split_points=None to balance "
                f"{self.num_stages} stages by parameter count."
            )

    def _warn_batchnorm(self, module: pl.LightningModule) -> None:
        norms = [n for n, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if norms and self.microbatches > 1 and module.trainer.state.fn == TrainerFn.FITTING:
            rank_zero_warn(
                f"{len(norms)} BatchNorm layers ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) see one "
                f"micro-batch at a time: with microbatches={self.microbatches} their batch statistics (and running "
                "averages) come from micro-batches of the batch, not the whole batch, so training differs from one "
                "device. Use microbatches=1, GroupNorm/LayerNorm, or accept per-micro-batch statistics."
            )

    def _materialize_own_stage(self, module: pl.LightningModule) -> None:
        """Allocate and initialise the meta-built modules of this rank's stage, and the replicated buffers."""
        assert self.partition is not None
        units = self.partition.units_of(self.stage)
        spanning = set(self.partition.spanning)  # their own tensors can only be replicated buffers

        def own(name: str) -> bool:
            return name in spanning or any(u == "" or name == u or name.startswith(u + ".") for u in units)

        if materialize([(n, m) for n, m in module.named_modules() if own(n)], self.root_device):
            log.debug("stage %d materialized from the meta device", self.stage)

    def _isolate_metrics(self, module: pl.LightningModule) -> None:
        """torchmetrics syncs ``compute()`` over the default (whole-world) group, but only the last stage has metric
        state and calls it: give every Metric the group of the ranks that run the same stage (its replicas)."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover
            return
        if self._dp_group is None:
            return
        for m in module.modules():
            if isinstance(m, Metric):
                self._patch(m, "process_group", self._dp_group)

    def _shard_lazy_data(self, trainer: pl.Trainer) -> None:
        """A :class:`LazySamplingDataModule` (which Lightning gives no sampler) shards its data over the replicas."""
        dm = trainer.datamodule
        if not isinstance(dm, LazySamplingDataModule):
            return
        if dm.num_replicas not in (1, self.num_replicas):
            raise ValueError(
                f"LazySamplingDataModule(num_replicas={dm.num_replicas}) but ClappingStrategy runs "
                f"{self.num_replicas} data-parallel replicas: leave num_replicas at its default (the strategy sets it "
                f"and the replica rank) or pass num_replicas={self.num_replicas}"
            )
        if dm.loader is not None and (dm.loader.num_replicas, dm.loader.replica_rank) != (self.num_replicas,
                                                                                          self.replica):
            raise ValueError("the LazySamplingDataModule's loader was built before the strategy could shard it over "
                             "the replicas; do not call train_dataloader() before trainer.fit()")
        self._patch(dm, "num_replicas", self.num_replicas)
        self._patch(dm, "replica_rank", self.replica)

    def make_rule(self, boundary: int, direction: str, training: bool) -> MessageRule:
        """The encoder/decoder of one boundary and direction (both ends build the same one)."""
        codec = self.forward_codec if direction == "fwd" else self.backward_codec
        if isinstance(codec, dict):
            codec = codec.get(boundary)
        if training and self._autotuned is not None and boundary in self._autotuned:
            variant, codec = self._autotuned[boundary].rule(direction)
            if variant == "uncompressed":
                codec = "identity"
        elif codec is None:  # a boundary the user left uncompressed
            variant, codec = "uncompressed", "identity"
        elif not training:
            variant = "direct" if self.compress_eval else "uncompressed"
        else:
            variant = self.variant
        return MessageRule(variant, codec, boundary, direction, warm_start=self.warm_start,
                           store_dtype=self.sample_store_dtype, lazy_threshold=self.lazy_messages,
                           max_skips=self.max_skips, fresh_codec=self.fresh_codec)

    def _check_codec_boundaries(self) -> None:
        for name in ("forward_codec", "backward_codec"):
            codecs = getattr(self, name)
            wrong = sorted(b for b in codecs if b >= self.num_stages - 1) if isinstance(codecs, dict) else []
            if wrong:
                raise ValueError(
                    f"{name} names boundaries {wrong}, but {self.num_stages} stages have boundaries 0 .. "
                    f"{self.num_stages - 2} (boundary m lies between stages m and m + 1)"
                )

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute for the duration of the run; teardown puts the previous value back."""
        had, previous = name in obj.__dict__, obj.__dict__.get(name)
        setattr(obj, name, value)
        self._patched.append((obj, name, had, previous))

    def model_to_device(self) -> None:
        assert self.runner is not None
        for unit in self.runner.own_units():
            unit.to(self.root_device)
        module = self.lightning_module
        for name in self.partition.spanning if self.partition else ():
            sub = module.get_submodule(name)
            for bname, buf in list(sub.named_buffers(recurse=False)):
                sub._buffers[bname] = buf.to(self.root_device)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    # ------------------------------------------------------------------ steps
    def _split(self, batch: Any) -> tuple[list[Any], list[int]]:
        microbatches, sizes = split_batch(batch, self.microbatches)
        if not self._checked_batch:
            self._checked_batch = True
            if sum(sizes) < self.microbatches:
                raise ValueError(
                    f"microbatches={self.microbatches} is larger than the batch ({sum(sizes)} samples): each "
                    f"micro-batch needs at least one sample. Use microbatches <= {sum(sizes)} or a larger batch size."
                )
        return microbatches, sizes

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        assert self.executor is not None and self._relay is not None
        module, trainer = self.lightning_module, self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in self.optimizers:
                type(module).optimizer_zero_grad(module, trainer.current_epoch, batch_idx, optimizer)
        microbatches, sizes = self._split(batch)
        total = sum(sizes)
        weights = precision.scale_loss_weights(self.precision_plugin, [n / total / accumulate for n in sizes],
                                               self.root_device, self.optimizers)
        ctx, batch_id, info = self._step_context(trainer, batch_idx, sizes)
        relay = self._relay
        relay.clear()

        def step(mb: Any, j: int) -> Any:
            with relay.capture(sizes[j]):
                return module.training_step(mb, batch_idx, *args, **kwargs)

        seed = (lambda j: _mix(self._rng_base, batch_id, self.stage, j)) if self.freeze_rng else None
        fingerprint = failures.fingerprint(batch) if ctx.fresh and self.num_stages > 1 else None
        results = (lambda outs: self._step_results(outs, sizes, fingerprint)) if self.executor.is_last else None
        with failures.reported(self.stage, self.global_rank, self.num_ranks), \
                self.precision_plugin.train_step_context(), self._finding_shared_owners():
            outputs, stats = self.executor.train_step(microbatches, step, weights, ctx, seed, results)
        if self._averager is not None and not _compat.should_accumulate(trainer):
            # this stage's last backward is done: average over the replicas while the pipeline drains
            self._averager.start(self._stage_params())
        # the last stage's results came back with the last gradient message (on one stage, nothing was sent)
        blob = self.executor.results if self.num_stages > 1 else self._step_results(outputs, sizes, None)
        loss_t = self._apply_results(blob, fingerprint)
        if self.log_bytes:
            self._log_step_stats(stats, total, info)
        self._train_steps += 1
        if self.autotune and self._autotuned is None and self._train_steps == 2 and self.num_stages > 1:
            self._run_autotune(stats.compute_s / len(microbatches), len(microbatches))
        if self.executor.is_last and isinstance(outputs[-1], dict):
            return {**merge_outputs(outputs, sizes), "loss": loss_t}
        return loss_t

    @contextmanager
    def _finding_shared_owners(self) -> Generator[None, None, None]:
        """At the first step: which stage uses each parameter that sits directly on a module spanning stages (such as
        ``self.pos = nn.Parameter(...)`` on the LightningModule)? That stage owns it (trains and saves it); the
        others hold an unused copy. Two users are refused. One ``all_gather_object``, once."""
        assert self.partition is not None and self.runner is not None
        if self._owners_settled or not self.partition.shared_params:
            yield
            return
        with self.runner.settling_shared_owners(self.lightning_module, self.rank_of_stage, self._pp_group):
            yield
        self._owners_settled = True
        owners = {k: self.partition.state_stage[k] for k in self.partition.shared_params}
        rank_zero_info(f"ClappingStrategy: parameters on modules that span stages, by owning stage: {owners}")

    def _run_autotune(self, compute_s: float, num_microbatches: int) -> None:
        """Probe the links, decide on rank 0, rebuild the training rules on every rank (between two steps)."""
        assert self.executor is not None
        tops = {d: None if isinstance(c, dict) else c.name  # a per-boundary map: the default ladder
                for d, c in (("fwd", self.forward_codec), ("bwd", self.backward_codec))}
        choices, every = autotune.tune_pipeline(self.stage, self.num_stages, self.rank_of_stage,
                                                self.executor.sent_specs, compute_s, self.variant, tops,
                                                timeout=self._timeout, group=self._pp_group,
                                                src=self.rank_of_stage(self.num_stages - 1),
                                                schedules=self._schedule_candidates(),
                                                num_microbatches=num_microbatches)
        if self.num_replicas > 1:  # every replica probed its own links; all follow replica 0's choice
            wire = self.broadcast([c.to_wire() for c in choices.values()], src=0)
            choices = {w[0]: autotune.Choice.from_wire(w) for w in wire}
        self._adopt(choices)
        rank_zero_info("ClappingStrategy autotune (kept for the rest of the run):\n"
                       + autotune.describe(choices, every))
        for name, value in autotune.log_values(choices, every).items():
            pl.LightningModule.log(self.lightning_module, name, value, on_step=True, on_epoch=False)

    def _schedule_candidates(self) -> tuple[str, ...]:
        """The schedules autotune prices: the running one first (kept unless another is clearly faster)."""
        return (self.schedule, *(s for s in SCHEDULES if s != self.schedule)) if self.schedule_auto else (
            self.schedule,)

    def _adopt(self, choices: dict[int, Any]) -> None:
        """Use autotune's choice from the next step on: its codecs, and with ``schedule="auto"`` its schedule."""
        self._autotuned = choices
        assert self.executor is not None
        self.executor.rebuild_rules(training_only=True)
        chosen = next(iter(choices.values())).schedule if choices else ""
        if self.schedule_auto and chosen and chosen != self.schedule:
            self.schedule = chosen
            self.executor.schedule_fn = get_schedule(chosen)

    def _step_context(self, trainer: pl.Trainer, batch_idx: int, sizes: list[int]) -> tuple[StepContext, int, Any]:
        """What every stage knows about this step: its number, whether the batch is fresh, its sample ids."""
        if not self._lazy_checked:
            self._lazy_checked = True
            self._lazy_loader = find_lazy_loader(trainer)
            if self._lazy_loader is None and self.variant in ("clapping-fc", "clapping-fu"):
                rank_zero_info(
                    f"ClappingStrategy: variant={self.variant!r} without LazySamplingDataModule: every batch is "
                    "fresh, so the error feedback works across unrelated batches (the ef21 baseline)."
                )
        step = trainer.global_step * trainer.accumulate_grad_batches + batch_idx % trainer.accumulate_grad_batches
        if self._lazy_loader is None:
            return StepContext(step=step, fresh=True, sample_ids=None, sizes=sizes), step, None
        info = self._lazy_loader.batch_info(batch_idx)
        ids = list(info.sample_ids.to(self.root_device).split(sizes)) if info.sample_ids is not None else None
        return StepContext(step=step, fresh=info.fresh, sample_ids=ids, sizes=sizes), info.batch_id, info

    @property
    def _rng_base(self) -> int:
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _step_results(self, outputs: list[Any], sizes: list[int], fingerprint: tuple[float, ...] | None) -> bytes:
        """On the last stage: the step's loss, its logged values and its batch fingerprint, as sent to the others."""
        assert self._relay is not None
        total = sum(sizes)
        loss = sum(float(_loss(o).detach()) * n for o, n in zip(outputs, sizes)) / total
        self._local_logs = self._relay.combined()
        return pack_results(loss, self._relay.to_wire(self._local_logs), fingerprint)

    def _apply_results(self, blob: bytes, fingerprint: tuple[float, ...] | None) -> Tensor:
        """Log the last stage's values on this rank (every rank, so callback metrics agree) and check the batch."""
        assert self._relay is not None
        loss, wire, last_fingerprint = unpack_results(blob)
        if fingerprint is not None and last_fingerprint is not None:
            failures.check_same_batch(fingerprint, last_fingerprint, self.stage,
                                      self.lightning_module.trainer.global_step)
        self._relay.replay(wire, self._local_logs if self.executor.is_last else None, self.root_device)
        return torch.tensor(math.nan if loss is None else loss, device=self.root_device)

    def _broadcast_logs(self) -> None:
        """Outside training steps: what the last stage logged reaches every rank with one broadcast."""
        assert self._relay is not None
        self._local_logs = self._relay.combined() if self.stage == self.num_stages - 1 else None
        box = [self._relay.to_wire(self._local_logs) if self._local_logs is not None else None]
        if self.num_stages > 1:
            dist.broadcast_object_list(box, src=self.rank_of_stage(self.num_stages - 1), group=self._pp_group)
        self._relay.replay(box[0], self._local_logs, self.root_device)

    def _log_step_stats(self, stats: StepStats, batch_size: int, info: Any) -> None:
        assert self._byte_stats is not None
        extra = {} if info is None else {"clapping/distinct_samples": info.distinct_samples,
                                          "clapping/fresh": float(info.fresh)}
        values = self._byte_stats.step(stats, extra)  # the previous step's numbers: nothing waits for this step's
        module = self.lightning_module
        for name, value in values.items():
            pl.LightningModule.log(module, name, float(value), on_step=True, on_epoch=False, batch_size=batch_size,
                                   prog_bar=name == "clapping/ratio" and self.variant != "uncompressed")

    def _eval(self, hook: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.executor is not None and self._relay is not None
        module = self.lightning_module
        microbatches, sizes = self._split(batch)
        relay = self._relay
        relay.clear()
        fn = getattr(module, hook)

        def step(mb: Any, j: int) -> Any:
            with relay.capture(sizes[j]):
                return fn(mb, *args, **kwargs)

        with failures.reported(self.stage, self.global_rank, self.num_ranks), self._finding_shared_owners():
            outputs = self.executor.eval_step(microbatches, step, StepContext(sizes=sizes))
        merged = merge_outputs(outputs, sizes) if self.executor.is_last else None
        if hook != "predict_step":
            self._broadcast_logs()  # evaluation sends nothing backward for its results to ride on
        elif self.num_stages > 1:
            # every rank returns the predictions, as under DDP: scripts that use them run on every rank
            box = [_compat.tree_map_tensors(lambda t: t.cpu(), merged)]
            dist.broadcast_object_list(box, src=self.rank_of_stage(self.num_stages - 1), group=self._pp_group)
            merged = box[0] if self.executor.is_last else _compat.tree_map_tensors(lambda t: t.to(self.root_device),
                                                                                    box[0])
        return merged

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval("predict_step", *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Gradients were computed by the pipeline inside ``training_step``; only the hooks run here (and, with
        replicas, the wait for the gradients' average, before clipping and the optimizer step see them)."""
        if self._averager is not None:
            self._averager.finish()
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the norm of the whole model's gradient, combined over all stages."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.root_device)
        squared = local.detach().double().pow(2).to(self.root_device)
        if self.num_stages > 1:  # the replicas hold the same averaged gradients: their pipeline's norm is enough
            dist.all_reduce(squared, group=self._pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, squared.sqrt().to(local.dtype))

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if _compat.distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``sync_dist=True`` reduces over data-parallel replicas, never over stages: every stage already holds its
        replica's last-stage values (relayed), so the ranks of one stage reduce with each other (a ``"sum"`` is not
        multiplied by the number of stages). With one replica the value is returned as it is, without a
        collective."""
        if self.num_replicas == 1 or not isinstance(tensor, Tensor):
            return tensor
        return _compat.sync_if_available(tensor, group if group is not None else self._dp_group, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gathers over the replicas (the ranks of this rank's stage), as DDP gathers over its ranks; with one
        replica the tensor is returned as it is (a single device adds no dimension either)."""
        if self.num_replicas == 1 and group is None:
            return tensor
        return _compat.all_gather_if_available(tensor, group=group if group is not None else self._dp_group,
                                               sync_grads=sync_grads)

    def _stage_params(self) -> list[torch.nn.Parameter]:
        """This stage's parameters that hold a gradient, in the same order on every replica."""
        seen: set[int] = set()
        out = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The last stage (rank 0) holds the authoritative metrics, so its decision is everyone's."""
        if not _compat.distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # ------------------------------------------------------------------ checkpoints
    # Lightning calls lightning_module_state_dict() and optimizer_state() on every rank, then save_checkpoint() on
    # every rank. "full": the first two gather replica 0's tensors to rank 0 (collectives within its pipeline),
    # which writes the file. "sharded": they return this stage's own part, keyed by name, and every stage of
    # replica 0 writes it (torch.distributed.checkpoint). The replicas hold the same weights and optimizer states;
    # only their error-feedback buffers differ, and every replica saves its own.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.partition is not None
        if self.replica != 0:
            return {}
        mine = self.partition.owned_state_keys(self.stage)
        local = {k: v for k, v in self.lightning_module.state_dict().items() if k in mine}
        if self.state_dict_type == "sharded":
            return local
        parts = ckpt.gather_to_zero(local, self.root_device, group=self._pp_group)
        return ckpt.merge_model_states(parts, list(self.partition.state_stage)) if parts is not None else {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.replica != 0:
            return {}
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        local = ckpt.local_optimizer_state(optimizer, optimizer.state_dict())
        if self.state_dict_type == "sharded":
            return ckpt.state_by_name(local, ckpt.param_names(self.lightning_module, optimizer))
        parts = ckpt.gather_to_zero(local, self.root_device, group=self._pp_group)
        return ckpt.merge_optimizer_states(parts) if parts is not None else {}

    @property
    def _feedback_key(self) -> str:
        """Where this rank's error-feedback buffers live in a checkpoint (replica 0 keeps the one-replica names)."""
        return f"stage{self.stage}" if self.replica == 0 else f"replica{self.replica}_stage{self.stage}"

    def _feedback_state(self) -> dict[str, Any]:
        state = self.executor.feedback_state() if self.executor is not None else self._last_feedback
        return {self._feedback_key: state}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Adds every stage's error-feedback buffers, so a compressed run resumes exactly."""
        checkpoint["clapping"] = {"cut_points": list(self.partition.cut_points) if self.partition else [],
                                  "num_stages": self.num_stages,
                                  "autotune": [c.to_wire() for c in self._autotuned.values()] if self._autotuned
                                  else None}
        if self.state_dict_type == "full":
            parts = ckpt.gather_to_zero(self._feedback_state(), self.root_device)
            if parts is not None:
                checkpoint["clapping_feedback"] = {k: v for part in parts for k, v in part.items()}
            with self._plain_forwards():
                if self.global_rank == 0:
                    ckpt.whole_hparams_modules(checkpoint, self.lightning_module)
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        if self.global_rank == 0 and path.is_file():
            path.unlink()
        tensors = {"model": checkpoint.pop("state_dict"), "clapping_feedback": self._feedback_state()}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        if self.replica != 0:  # the other replicas add only their own error-feedback buffers
            tensors = {"clapping_feedback": tensors["clapping_feedback"]}
        held = [k for k, v in (checkpoint.get("hyper_parameters") or {}).items() if isinstance(v, torch.nn.Module)]
        if held:
            rank_zero_warn(
                f"the saved hyperparameters hold modules ({', '.join(held)}); a sharded checkpoint stores them without "
                "their weights (no rank holds the whole model), so load_from_checkpoint of the consolidated file "
                f"cannot rebuild the model from them. Use `self.save_hyperparameters(ignore={held!r})` and build "
                "those modules in the LightningModule, or state_dict_type='full'."
            )
        with self._plain_forwards():
            ckpt.save_sharded(path, tensors, checkpoint if self.global_rank == 0 else None)

    @contextmanager
    def _plain_forwards(self) -> Generator[None, None, None]:
        """Without the stage wrappers: saved hyperparameters may hold the model's own modules (``net: nn.Module``),
        which must pickle as in one process."""
        if self.runner is None:
            yield
            return
        self.runner.uninstall()
        try:
            yield
        finally:
            self.runner.install()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        else:
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder: every rank reads only its own tensors by name; returns the rest (``meta.pt``)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self._sharded_loaded = ckpt.is_sharded_checkpoint(path)
        if not self._sharded_loaded:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.partition is not None
        meta = torch.load(path / ckpt.META_FILE, map_location="cpu", weights_only=bool(weights_only))
        module = self.lightning_module
        saved = ckpt.saved_model_keys(path)
        if module.strict_loading:
            ckpt.check_model_keys(saved, list(self.partition.state_stage), path)
        mine = self.partition.owned_state_keys(self.stage)
        ckpt.load_sharded_model(path, {k: v for k, v in module.state_dict().items() if k in mine and k in saved})
        prefixes = [f"clapping_feedback.{self._feedback_key}"]
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        names = [ckpt.param_names(module, o) for o in optimizers]
        if module.trainer.state.fn == TrainerFn.FITTING:
            for i, (opt, opt_names) in enumerate(zip(optimizers, names)):
                prefixes.append(f"optimizer_{i}.param_groups")
                prefixes += [f"optimizer_{i}.state.{opt_names[j]}" for j in sorted(ckpt.owned_indices(opt))]
        loaded = ckpt.load_sharded_entries(path, prefixes)
        for i, (opt, opt_names) in enumerate(zip(optimizers, names)):
            if f"optimizer_{i}" in loaded:
                opt.load_state_dict(ckpt.state_by_position(loaded[f"optimizer_{i}"], opt_names))
                _compat.optimizers_to_device([opt], self.root_device)
        self._restore_feedback({**meta, "clapping_feedback": loaded.get("clapping_feedback", {})})
        return meta

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._sharded_loaded  # a sharded checkpoint's optimizer state was read in load_checkpoint()

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._sharded_loaded:
            return  # read in load_checkpoint()
        assert self.partition is not None
        mine = self.partition.owned_state_keys(self.stage)
        full = checkpoint["state_dict"]
        missing = [k for k in mine if k not in full]
        if strict and missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} entries of stage {self.stage}, e.g. {missing[:5]}")
        self.lightning_module.load_state_dict({k: v for k, v in full.items() if k in mine}, strict=False)
        self._restore_feedback(checkpoint)

    def _restore_feedback(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("clapping")
        if not saved or self.executor is None or self.partition is None:
            return
        if list(saved.get("cut_points", [])) != list(self.partition.cut_points):
            if checkpoint.get("clapping_feedback"):
                rank_zero_warn(
                    f"the checkpoint was cut at {saved.get('cut_points')} and this run at "
                    f"{list(self.partition.cut_points)}: its error-feedback buffers belong to other boundaries, so "
                    "they are not used and restart empty (the first messages go in full precision)."
                )
            return
        if self.autotune and saved.get("autotune"):  # the saved run's choice, so that its buffers fit the rules
            self._adopt({w[0]: autotune.Choice.from_wire(w) for w in saved["autotune"]})
        for name, state in checkpoint.get("clapping_feedback", {}).get(self._feedback_key, {}).items():
            rule = self.executor.rules.get(name)
            if rule is not None:
                rule.load_state(state, self.root_device)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._sharded_loaded:
            return  # read in load_checkpoint()
        module = self.lightning_module
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            state = ckpt.state_by_position(state, ckpt.param_names(module, optimizer))
            optimizer.load_state_dict(ckpt.local_optimizer_state(optimizer, state))
            _compat.optimizers_to_device([optimizer], self.root_device)

    # ------------------------------------------------------------------ end of a run
    def _gather_full_weights(self) -> None:
        """Collective: collect the whole model on rank 0, which loads it back into the user's module at teardown.

        Runs at the normal end of every top-level run (fit, validate, test, predict) with ``state_dict_type="full"``,
        so the module object in the launching process ends up complete. Sharded runs skip it: no rank may hold
        more than its stage, and the trained model is in the sharded checkpoint.
        """
        if self.state_dict_type == "sharded":
            return
        state = self.lightning_module_state_dict()
        self._full_state = state if self.global_rank == 0 else None

    def on_train_end(self) -> None:
        if self._byte_stats is not None:
            self._byte_stats.finish()  # the last step's numbers, into the totals (also after teardown)
        self._gather_full_weights()

    def on_validation_end(self) -> None:
        if self.lightning_module.trainer.state.fn == TrainerFn.VALIDATING:
            self._gather_full_weights()

    def on_test_end(self) -> None:
        self._gather_full_weights()

    def on_predict_end(self) -> None:
        self._gather_full_weights()

    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # marks this rank done: ranks that finish later do not declare it hung
            self._watchdog = None
        module = self.lightning_module
        if self.runner is not None:
            self.runner.uninstall()
        for obj, name, had, previous in reversed(self._patched):
            if had:
                setattr(obj, name, previous)
            else:
                obj.__dict__.pop(name, None)
        self._patched.clear()
        if module is not None and self._full_state is not None:
            module.load_state_dict(self._full_state, assign=True)
            self._full_state = None
        if module is not None:
            for t in list(module.parameters()) + list(module.buffers()):
                if t.device.type not in ("meta", "cpu"):
                    t.data = t.data.cpu()
        if self.executor is not None:
            self._last_feedback = self.executor.feedback_state()  # for a checkpoint saved after fit returns
        self.runner = None
        self.executor = None
        assert self.accelerator is not None
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "clapping", cls, description="Pipeline-parallel training with compressed inter-stage messages"
        )


_EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


def _codec_or_map(value: Any, name: str) -> Any:
    """A codec, or {boundary index: codec or None} (None: that boundary is sent uncompressed)."""
    if not isinstance(value, dict):
        return get_codec(value)
    out = {}
    for boundary, codec in value.items():
        if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0:
            raise ValueError(f"{name}: keys are boundary indices (0 is the link between stages 0 and 1), got "
                             f"{boundary!r}")
        out[boundary] = None if codec is None else get_codec(codec)
    return out


def _mix(*values: int) -> int:
    """A well-spread 31-bit seed from a few integers (the same on every rank)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFF


def _loss(out: Any) -> Tensor:
    return out["loss"] if isinstance(out, dict) else out


class _ClappingLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's script launcher, with the model checked before any process starts."""

    def __init__(self, strategy: ClappingStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        if model is None and trainer is not None:
            model = trainer.lightning_module
        if model is not None:
            # a model that builds its layers in configure_model() is cut once they exist, in setup() on every rank
            self._strategy.check_model(model, partition=not is_overridden("configure_model", model))
        return super().launch(function, *args, trainer=trainer, **kwargs)
