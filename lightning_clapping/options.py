"""The strategy's arguments, validated once into one :class:`ClappingOptions` object.

``ClappingStrategy.__init__`` keeps its explicit signature (LightningCLI and Hydra read it) and hands every argument
to :meth:`ClappingOptions.check`, which raises with a message that says what to change; the strategy's rooms (setting
up the stage, the steps, checkpoints, the message rules) read the options from there. :func:`check_ranks` checks them
against the processes the Trainer starts, once Lightning knows how many.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from lightning_clapping.autotune.choose import DEFAULT_TOLERANCE
from lightning_clapping.autotune.frontier import DEFAULT_QUALITY_TOLERANCE, check_tolerance
from lightning_clapping.checkpoint.state import STATE_DICT_TYPES
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import check_variant
from lightning_clapping.comm.placement import Topology
from lightning_clapping.ft.config import resolve as resolve_fault_tolerance
from lightning_clapping.sync.config import resolve as resolve_replica_sync
from lightning_clapping.launcher import refuse_spawn
from lightning_clapping.pipeline.recompute import check_policy
from lightning_clapping.pipeline.schedule import SCHEDULES

_FEEDBACK_VARIANTS = ("ef21", "clapping-fc", "clapping-fu")


@dataclass(frozen=True)
class AutotuneSettings:
    """What ``autotune=`` asks for beyond on/off: the frontier rule (published settings where the links need them),
    its quality tolerance per unit of the published deficits, and the step rule's tolerance (see
    :mod:`lightning_clapping.autotune.choose`)."""

    frontier: bool = False
    #: deficit allowed per unit: ``"points"`` (accuracy points lost), ``"%"`` (per cent added to the validation loss)
    quality: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_QUALITY_TOLERANCE))
    step_tolerance: float = DEFAULT_TOLERANCE

    #: the keys ``autotune={...}`` takes, and the unit of the quality tolerance each sets
    KEYS = {"frontier": None, "accuracy_points": "points", "loss_percent": "%", "step_tolerance": None}

    @classmethod
    def check(cls, value: Any) -> tuple[bool, AutotuneSettings]:
        """``(on, settings)`` from ``autotune=``: False / None, True, ``"frontier"`` or a dict of :attr:`KEYS`."""
        if value is None or isinstance(value, bool):
            return bool(value), cls()
        if isinstance(value, str) and value.lower() == "frontier":
            return True, cls(frontier=True)
        if not isinstance(value, Mapping) or not set(value) <= set(cls.KEYS):
            raise ValueError(f"autotune is True, False, 'frontier' (also choose among the published settings within "
                             f"the quality tolerance) or a dict with keys {sorted(cls.KEYS)}, e.g. {{'frontier': "
                             f"True, 'accuracy_points': 0.5, 'loss_percent': 1.0}}; got {value!r}")
        step = value.get("step_tolerance", DEFAULT_TOLERANCE)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 <= step < math.inf:
            raise ValueError(f"autotune step_tolerance is a number >= 0 (0.05: within 5 % of the fastest predicted "
                             f"step), got {step!r}")
        quality = {unit: value[k] for k, unit in cls.KEYS.items() if unit and k in value}
        for k, unit in cls.KEYS.items():
            x = value.get(k, 0.0) if unit else 0.0
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
                raise ValueError(f"autotune {k} is the deficit the frontier rule allows, a number >= 0, got {x!r}")
        frontier = value.get("frontier", False)
        if not isinstance(frontier, bool) or (quality and not frontier):
            raise ValueError(f"autotune: accuracy_points and loss_percent are the frontier rule's tolerance: give "
                             f"them with 'frontier': True (a bool), got {value!r}")
        return True, cls(frontier=frontier, quality=check_tolerance(quality), step_tolerance=float(step))


@dataclass
class ClappingOptions:
    """What the user asked for (see :class:`~lightning_clapping.ClappingStrategy` for each argument), normalised:
    codecs are :class:`~lightning_clapping.codecs.Codec` objects (or ``{boundary: Codec or None}``), ``schedule`` is
    the schedule to start with (``"1f1b"`` under ``schedule="auto"``, with ``schedule_auto`` set) and
    ``activation_checkpointing`` the checked policy."""

    split_points: list[str] | None
    stages: int | None
    ddp_comm_hook: Any
    ddp_comm_state: Any
    microbatches: int
    schedule: str
    schedule_auto: bool
    variant: str
    forward_codec: Any
    backward_codec: Any
    fresh_codec: Any
    autotune: bool
    compress_eval: bool
    warm_start: bool
    lazy_messages: float | None
    max_skips: int
    sample_store_dtype: torch.dtype | None
    freeze_rng: bool
    process_group_backend: str | None
    timeout: timedelta
    liveness: timedelta | None
    prepost_receives: bool | None
    log_bytes: bool
    state_dict_type: str
    activation_checkpointing: Any
    tied_codec: Any = None
    #: submodule name ("" for the whole LightningModule) -> safetensors checkpoint read after materializing
    pretrained: dict[str, str] | None = None
    #: replica groups that drop out and rejoin (lightning_clapping.ft); None: off
    fault_tolerance: Any = None
    #: the run-time guard compares the stages' recomputed values again every this many training steps (None: only
    #: at the first step of each kind); see lightning_clapping.pipeline.agreement
    recheck_every: int | None = 100
    #: how each stage's replicas stay together (lightning_clapping.sync.config): EveryStep, LAG or DiLoCo
    replica_sync: Any = None
    autotune_settings: AutotuneSettings = field(default_factory=AutotuneSettings)

    @classmethod
    def check(cls, *, split_points: list[str] | None, stages: int | None, ddp_comm_hook: Any, ddp_comm_state: Any,
              microbatches: int, schedule: str, variant: str, forward_codec: Any, backward_codec: Any,
              fresh_codec: Any, autotune: Any, compress_eval: bool, warm_start: bool, lazy_messages: float | None,
              max_skips: int, sample_store_dtype: torch.dtype | None, freeze_rng: bool,
              process_group_backend: str | None, timeout: timedelta, liveness: timedelta | None,
              prepost_receives: bool | None, log_bytes: bool, state_dict_type: str, start_method: str,
              activation_checkpointing: Any, tied_codec: Any = None, pretrained: Any = None,
              fault_tolerance: Any = None, recheck_every: int | None = 100,
              replica_sync: Any = None) -> ClappingOptions:
        """Validate the constructor's arguments (in the order they have always been checked) into options."""
        refuse_spawn(start_method)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type must be 'full' (one checkpoint file, gathered on rank 0) or 'sharded' (one shard "
                f"per stage, written in parallel), got {state_dict_type!r}"
            )
        policy = check_policy(activation_checkpointing)
        split_points = _check_split_points(split_points, stages)
        if ddp_comm_hook is not None and not callable(ddp_comm_hook):
            raise TypeError(f"ddp_comm_hook must be a DDP communication hook, hook(state, bucket) -> Future, such as "
                            f"default_hooks.bf16_compress_hook; got {ddp_comm_hook!r}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        if not isinstance(schedule, str) or schedule.lower() not in (*SCHEDULES, "auto"):
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} or 'auto'")
        autotune, tune_settings = AutotuneSettings.check(autotune)
        if schedule.lower() == "auto" and not autotune:
            raise ValueError("schedule='auto' lets autotune choose the schedule: pass autotune=True with it (and a "
                             "compressed variant), or name the schedule ('1f1b' or 'gpipe')")
        variant = check_variant(variant)
        forward_codec = _codec_or_map(forward_codec, "forward_codec")
        backward_codec = _codec_or_map(backward_codec, "backward_codec")
        fresh = None if fresh_codec is None else get_codec(fresh_codec)
        if fresh_codec is not None and variant not in _FEEDBACK_VARIANTS:
            raise ValueError(f"fresh_codec applies to the error-feedback variants (ef21, clapping-fc, clapping-fu), "
                             f"not to variant={variant!r}")
        if autotune and variant == "uncompressed":
            raise ValueError("autotune=True chooses codecs for a compressed variant, up to forward_codec and "
                             "backward_codec; pass variant='clapping-fc' (or another compressed variant)")
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
        if recheck_every is not None and (not isinstance(recheck_every, int) or isinstance(recheck_every, bool)
                                          or recheck_every < 1):
            raise ValueError(f"recheck_every must be a positive number of training steps, or None to compare the "
                             f"stages' recomputed values at the first step only; got {recheck_every!r}")
        tied = _check_tied_codec(tied_codec)
        fault_tolerance = resolve_fault_tolerance(fault_tolerance)
        sync = resolve_replica_sync(replica_sync)
        _check_sync_with(sync, fault_tolerance, ddp_comm_hook)
        if fault_tolerance is not None and ddp_comm_hook is not None:
            raise ValueError("fault_tolerance averages gradients over the replica groups through torchft; it takes no "
                             "ddp_comm_hook (drop one of them)")
        auto = schedule.lower() == "auto"
        return cls(
            split_points=split_points, stages=stages, ddp_comm_hook=ddp_comm_hook, ddp_comm_state=ddp_comm_state,
            microbatches=microbatches, schedule="1f1b" if auto else schedule.lower(), schedule_auto=auto,
            variant=variant, forward_codec=forward_codec, backward_codec=backward_codec, fresh_codec=fresh,
            autotune=autotune, autotune_settings=tune_settings, compress_eval=compress_eval, warm_start=warm_start,
            lazy_messages=lazy_messages,
            max_skips=max_skips, sample_store_dtype=sample_store_dtype, freeze_rng=freeze_rng,
            process_group_backend=process_group_backend, timeout=timeout, liveness=liveness,
            prepost_receives=prepost_receives, log_bytes=log_bytes, state_dict_type=state_dict_type,
            activation_checkpointing=policy, tied_codec=tied, pretrained=_check_pretrained(pretrained),
            fault_tolerance=fault_tolerance, recheck_every=recheck_every, replica_sync=sync,
        )

    def num_stages(self, num_ranks: int) -> int:
        """Pipeline stages per replica: set by the split points, or ``stages``, or one stage per process."""
        if self.split_points is not None:
            return len(self.split_points) + 1
        return self.stages if self.stages is not None else num_ranks

    def check_codec_boundaries(self, num_stages: int) -> None:
        """A per-boundary codec map may only name boundaries the model has."""
        for name in ("forward_codec", "backward_codec"):
            codecs = getattr(self, name)
            wrong = sorted(b for b in codecs if b >= num_stages - 1) if isinstance(codecs, dict) else []
            if wrong:
                raise ValueError(
                    f"{name} names boundaries {wrong}, but {num_stages} stages have boundaries 0 .. "
                    f"{num_stages - 2} (boundary m lies between stages m and m + 1)"
                )


def check_ranks(options: ClappingOptions, topology: Topology, num_processes: int, num_nodes: int,
                devices: set[str]) -> None:
    """The processes must hold a whole number of replicas, laid out alike on the nodes (and NCCL needs CUDA)."""
    ranks, stages = num_processes * num_nodes, topology.stages
    given = (f"split_points={options.split_points} cut the model into {stages} stages"
             if options.split_points is not None else f"stages={stages}")
    if ranks % stages:
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(
            f"{given}, but the Trainer starts {ranks} processes (devices={num_processes}, num_nodes="
            f"{num_nodes}), which is not a whole number of pipeline replicas of {stages} stages. "
            f"devices x num_nodes must be stages x replicas: use a number of stages among {fits}, or "
            f"devices={stages} (x num_nodes) for one replica."
        )
    topology.check()
    if options.process_group_backend == "nccl" and devices != {"cuda"}:
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but this Trainer runs on {sorted(devices)}: use "
            "accelerator='gpu' on a machine with CUDA, or process_group_backend='gloo' (the default on CPU)"
        )


def _check_split_points(split_points: Any, stages: Any) -> list[str] | None:
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
    return split_points


def _check_sync_with(sync: Any, fault_tolerance: Any, ddp_comm_hook: Any) -> None:
    """The replica sync modes that fault tolerance and a DDP communication hook can run with."""
    if sync.name != "every-step" and ddp_comm_hook is not None:
        raise ValueError(f"replica_sync={sync.name!r} syncs the replicas itself: it takes no ddp_comm_hook (a hook "
                         "averages every step's gradients; use replica_sync='every-step' with it)")
    if fault_tolerance is None:
        return
    if sync.name == "lag":
        raise ValueError("replica_sync='lag' cannot run with fault_tolerance: every replica reuses a stale sum of all "
                         "replicas' last sent gradients, which a group that drops out or rejoins would leave wrong on "
                         "the others. Use replica_sync=DiLoCo(...) (local updates; a lost group costs one sync) or "
                         "'every-step' with fault_tolerance")
    if sync.name == "diloco" and sync.codec is not None:
        raise ValueError(f"replica_sync=DiLoCo(codec={sync.codec!r}) cannot run with fault_tolerance: compressed "
                         "pseudo-gradients are all-gathered, and torchft's quorum gives an all-reduce only. Use "
                         "DiLoCo(codec=None) with fault_tolerance")
    if sync.name == "diloco" and sync.overlap:
        raise ValueError(f"replica_sync=DiLoCo(overlap={sync.overlap}) cannot run with fault_tolerance: each outer step "
                         "waits for torchft's vote before the next batch. Use DiLoCo(overlap=0) with fault_tolerance")


def _check_tied_codec(value: Any) -> Any:
    """``tied_codec``: None (the tied gradients' sum goes uncompressed) or one codec (any variant: it has its own
    error feedback). A per-boundary dict makes no sense there: that sum crosses the whole pipeline at once."""
    if value is None:
        return None
    if isinstance(value, dict):
        raise TypeError(f"tied_codec compresses the sum of tied gradients, which crosses the whole pipeline, not one "
                        f"boundary: give one codec (e.g. 'q8' or 'bf16') or None, got {value!r}")
    try:
        return get_codec(value)
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"tied_codec={value!r} is not a codec: {err}. Give a Codec object, a registry string "
                         "(lightning_clapping.available_codecs(), e.g. 'q8', 'bf16', 'topk:0.1') or None") from err


def _check_pretrained(value: Any) -> dict[str, str] | None:
    """A checkpoint path (str or os.PathLike) for the whole LightningModule, or {submodule name: path}."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = {"": value}
    if not isinstance(value, dict) or not value or not all(
            isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in value.items()):
        raise TypeError(
            f"pretrained must be the path of a safetensors checkpoint (a .safetensors file, or a folder with "
            f"model.safetensors or model.safetensors.index.json) or a dict from submodule name to such a path, e.g. "
            f"{{'model': '/checkpoints/llama-7b'}}; got {value!r}"
        )
    return {k: os.fspath(v) for k, v in value.items()}


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


class _Option:
    """A strategy attribute that reads and sets ``strategy.options.<its name>``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"``options.{name}`` (see the strategy's docstring)."

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.options, self.name, value)


class OptionAttributes:
    """Options that read (and set) as attributes of the strategy too, as they did before :class:`ClappingOptions`
    (a mixin of the strategy, which holds ``options``)."""

    options: ClappingOptions
    split_points = _Option()
    microbatches = _Option()
    schedule_auto = _Option()
    variant = _Option()
    forward_codec = _Option()
    backward_codec = _Option()
    fresh_codec = _Option()
    autotune = _Option()
    compress_eval = _Option()
    warm_start = _Option()
    lazy_messages = _Option()
    max_skips = _Option()
    sample_store_dtype = _Option()
    freeze_rng = _Option()
    log_bytes = _Option()
    state_dict_type = _Option()
    activation_checkpointing = _Option()
