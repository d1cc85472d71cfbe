"""Start the bottlenecks from the data where the model is: in one process, or on the pipeline's stages.

:func:`~lightning_clapping.fit_bottlenecks` needs the whole model in one process: it runs the forward there. A model
that only fits on the pipeline's stages is fitted by the stages instead, with the same result: the callback
:class:`FitBottlenecks` (``Trainer(callbacks=[FitBottlenecks(batches)])``) does it at the start of training, through
``ClappingStrategy.fit_bottlenecks`` under this strategy and through ``fit_bottlenecks`` in one process under one
device or DDP.

On the stages, the bottlenecks are fitted in the order the forward reaches them, one pass over ``batches`` each, as in
one process. A pass is a forward-only run of the pipeline on every batch (its messages as evaluation sends them); the
stage that holds the next bottleneck's ``down`` half sums the second moments of what reaches it, takes their
principal directions, and broadcasts them over its pipeline, so the stage that holds ``up`` gets them too. With
replicas, each replica may fit on batches of its own: the holding stages add up their sums over the replicas (a
``features x features`` float64 matrix per bottleneck) and replica 0's result goes to the others, so every replica
starts from the same weights. No rank holds more than its own stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_clapping import _compat, first_pass
from lightning_clapping.comm import failures
from lightning_clapping.log_relay import LogRelay
from lightning_clapping.pipeline import bottleneck as bn

KIND = "fit_bottlenecks"  # the pipeline's plan of the values crossing cuts is kept per kind of forward
WHO = "FitBottlenecks"
_REFUSALS = ("", "never reached", "no position counted", "NaN or inf", "failed")  # FitRefused.code, and 4: any other


class FitBottlenecks(pl.Callback):
    """At the start of training, start every :class:`~lightning_clapping.Bottleneck` from the principal directions of
    what reaches it, as :func:`~lightning_clapping.fit_bottlenecks` does, wherever the model is.

    Args:
        batches: the batches to fit on, run once per bottleneck (a list, or a DataLoader that does not shuffle). Every
            stage of a pipeline must get the same ones (replicas may get batches of their own). Each is prepared as
            the fit loop prepares a training batch (precision plugin, batch transfer hooks, device).
        run: ``run(batch)`` runs the model's forward on one batch (on a pipeline: on every stage, as a training step
            does). Default: the module's ``training_step(batch, 0)``, whose logged values are dropped.
        positions: ``positions(batch)``, a bool mask over the leading dimensions of what reaches each bottleneck (for
            padded text, ``lambda batch: batch["attention_mask"].bool()``); only those positions count.

    It fits once, at the start of training (after Lightning's sanity validation, which therefore runs through the
    bottlenecks' first start): not when training resumes from a checkpoint saved after a step (which holds the
    weights), and not again in a later ``fit`` of the same callback. Torch's random state (the CPU's and the
    device's) is put back afterwards, so training draws what it would have drawn without the fit. After the fit,
    :attr:`kept` holds, by module name, the fraction of its inputs' energy each bottleneck keeps (printed too).

    It runs under ``ClappingStrategy``, and in one process under a single-device or DDP strategy (under DDP each
    process fits on its batches, the processes add up their sums, and every replica starts from the same weights).
    A strategy that shards or wraps the weights (FSDP, DeepSpeed) is refused: there, call
    :func:`~lightning_clapping.fit_bottlenecks` on the model before ``Trainer.fit``.
    """

    def __init__(self, batches: Iterable[Any], run: Callable[[Any], Any] | None = None,
                 positions: Callable[[Any], Tensor] | None = None) -> None:
        bn.check_reusable(batches, WHO)
        self.batches, self.run, self.positions = batches, run, positions
        self.kept: dict[str, float] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        plain = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and "DeepSpeed" not in type(strategy).__name__
        if stage == "fit" and not callable(getattr(strategy, "fit_bottlenecks", None)) and not plain:
            raise ValueError(f"{WHO}: {type(strategy).__name__} shards or wraps the model's weights, where the fitted "
                             f"directions cannot be written; call lightning_clapping.fit_bottlenecks(model, batches) "
                             f"before Trainer.fit instead, or train with ClappingStrategy, DDP or one device")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kept is not None or trainer.global_step > 0:
            rank_zero_info(f"{WHO}: not fitted again (the weights come from the checkpoint or an earlier fit)")
            return
        strategy = trainer.strategy
        run = self.run or (lambda batch: pl_module.training_step(batch, 0))
        device = strategy.root_device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            with trainer.precision_plugin.val_step_context():
                if callable(getattr(strategy, "fit_bottlenecks", None)):
                    self.kept = strategy.fit_bottlenecks(self.batches, run, self.positions)
                else:
                    self.kept = _in_one_process(pl_module, self.batches, run, self.positions,
                                                lambda b: _compat.training_batch(trainer, b),
                                                _data_parallel(strategy))
        rank_zero_info(f"{WHO}: fitted " + ", ".join(f"{n} (keeps {k:.1%} of its inputs' energy)"
                                                     for n, k in self.kept.items()))

    def state_dict(self) -> dict[str, Any]:
        return {"kept": self.kept}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.kept = state_dict.get("kept")


def _in_one_process(module: pl.LightningModule, batches: Iterable[Any], run: Callable[[Any], Any],
                    positions: Callable[[Any], Tensor] | None, prepare: Callable[[Any], Any],
                    device: torch.device | None = None) -> dict[str, float]:
    """:func:`fit_bottlenecks` on ``module``, with what the forward logs dropped and its attributes put back. With
    ``device`` (DDP, several processes; collective over all of them) the processes add up their sums before each
    bottleneck's directions are taken, and rank 0's weights go to the others, so every replica starts the same."""
    relay = LogRelay(module)
    combine = None if device is None else (lambda recorder: _add_up_over_processes(recorder, device))
    with first_pass.quiet(module, relay), relay.capture(1):
        kept = bn.fit_combined(module, _Prepared(batches, prepare), run, positions, combine)
    if device is not None:  # the same sums give the same directions; rank 0's make sure of it, to the bit
        for b in bn.bottlenecks_of(module, WHO).values():
            for weight in (b.down.weight, b.up.weight):
                value = weight.detach().to(device)
                dist.broadcast(value, src=0)
                with torch.no_grad():
                    weight.copy_(value)
    return kept


def _data_parallel(strategy: Any) -> torch.device | None:
    """The device of the DDP processes' collectives when several processes train replicas; else None."""
    if isinstance(strategy, DDPStrategy) and strategy.world_size > 1 and dist.is_available() and dist.is_initialized():
        return strategy.root_device
    return None


def _add_up_over_processes(recorder: bn.GramRecorder, device: torch.device) -> None:
    """After a pass, collective over every DDP process: they agree on the bottleneck reached (a process without
    batches reached none) and add up their second moments and counted positions, as the stages' replicas do."""
    names = list(recorder._pending)
    index = torch.tensor([names.index(recorder.first) if recorder.first is not None else -1], device=device)
    dist.all_reduce(index, op=dist.ReduceOp.MAX)
    if int(index) < 0:
        return  # no process reached one: each refuses alike
    name = names[int(index)]
    features = recorder._pending[name].features
    gram = (recorder.gram.to(device) if recorder.gram is not None
            else torch.zeros(features, features, dtype=torch.float64, device=device))
    rows = torch.tensor([float(recorder.rows)], dtype=torch.float64, device=device)
    dist.all_reduce(gram)
    dist.all_reduce(rows)
    recorder.first, recorder.gram, recorder.rows = name, gram, int(rows.item())


class _Prepared:
    """``batches``, each prepared as a training batch when iterated (iterable as often as ``batches`` is)."""

    def __init__(self, batches: Iterable[Any], prepare: Callable[[Any], Any]) -> None:
        self.batches, self.prepare = batches, prepare

    def __iter__(self):
        return (self.prepare(b) for b in self.batches)


def fit_on_stages(driver: Any, batches: Iterable[Any], run: Callable[[Any], Any],
                  positions: Callable[[Any], Tensor] | None = None) -> dict[str, float]:
    """``ClappingStrategy.fit_bottlenecks``, collective over every rank, between setup and the first training step
    (:class:`FitBottlenecks` calls it): start every bottleneck from the principal directions of what reaches it, as
    :func:`~lightning_clapping.fit_bottlenecks` does in one process. Returns the kept fractions, on every rank."""
    trainer = driver.module.trainer
    bn.check_reusable(batches, WHO)
    return _fit_on_stages(driver, batches, run, positions, lambda b: _compat.training_batch(trainer, b))


def _fit_on_stages(driver: Any, batches: Iterable[Any], run: Callable[[Any], Any],
                   positions: Callable[[Any], Tensor] | None, prepare: Callable[[Any], Any]) -> dict[str, float]:
    module, placement, partition = driver.module, driver.placement, driver.partition
    found = bn.bottlenecks_of(module, WHO)
    names = list(found)
    holder = {n: partition.state_stage[partition.aliases.get(f"{n}.down.weight", f"{n}.down.weight")]
              for n in names}  # the stage that holds ``down``
    kept: dict[str, float] = {}
    with bn.eval_flags(module), torch.no_grad(), first_pass.quiet(module, driver.relay):
        _check_same_batches(batches, placement)
        first = next(iter(batches), None)
        if driver.executor.needs_plan(KIND) and first is not None:  # planning runs the stages on placeholders:
            driver.forward_only(KIND, prepare(first), lambda mb, j: run(mb), check_size=False)  # no recording
        while len(kept) < len(names):
            pending = {n: found[n] for n in names if n not in kept}
            stage = min(holder[n] for n in pending)  # the next bottleneck is the first this stage reaches
            mine = {n: m for n, m in pending.items() if holder[n] == placement.stage}
            with bn.GramRecorder(WHO, mine, record=placement.stage == stage) as recorder:
                for batch in batches:

                    def step(mb: Any, j: int) -> Any:
                        recorder.start_forward(None if positions is None else positions(mb))
                        return run(mb)

                    driver.forward_only(KIND, prepare(batch), step, check_size=False)
            name, top, fraction = _share(recorder, stage, names, found, placement)
            bn.set_directions(found[name], top)
            kept[name] = fraction
    return {n: kept[n] for n in names}  # in module order


def _share(recorder: bn.GramRecorder, stage: int, names: list[str], found: dict[str, bn.Bottleneck],
           placement: Any) -> tuple[str, Tensor, float]:
    """After a pass: the holding stage (its sums added over the replicas) takes the principal directions, and every
    rank of the pipeline gets them, or the same refusal. Every rank calls the same collectives whatever happens."""
    device, topology = placement.device, placement.topology
    holds = placement.stage == stage
    replicas = placement.num_replicas > 1 and placement.dp_group is not None
    header = torch.zeros(2, dtype=torch.int64, device=device)  # [refusal code, index of the bottleneck]
    payload: Tensor | None = None
    error: Exception | None = None
    if holds:
        index = names.index(recorder.first) if recorder.first is not None else -1
        if replicas:  # the replicas agree on the bottleneck, then add up their sums
            agreed = torch.tensor([index], dtype=torch.int64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=placement.dp_group)
            index = int(agreed)
            if index >= 0:
                features = found[names[index]].features
                gram = recorder.gram.to(device) if recorder.gram is not None else torch.zeros(
                    features, features, dtype=torch.float64, device=device)
                rows = torch.tensor([float(recorder.rows)], dtype=torch.float64, device=device)
                dist.all_reduce(gram, group=placement.dp_group)
                dist.all_reduce(rows, group=placement.dp_group)
                recorder.first, recorder.gram, recorder.rows = names[index], gram, int(rows.item())
        if placement.replica == 0 or not replicas:
            try:
                first, gram = recorder.result()
                b = found[first]
                top, fraction = bn.principal_directions(gram.to(device), b.rank)
                payload = torch.cat([top.reshape(-1), torch.tensor([fraction], dtype=torch.float64, device=device)])
                header[1] = names.index(first)
            except Exception as err:  # refused (FitRefused.code) or failed: every rank learns it from the header
                error = err
                header[0] = err.code if isinstance(err, bn.FitRefused) else 4
                header[1] = index
        if replicas:
            dist.broadcast(header, src=topology.rank(0, stage), group=placement.dp_group)
    if placement.num_stages > 1:
        dist.broadcast(header, src=placement.rank_of_stage(stage), group=placement.pp_group)
    code, index = int(header[0]), int(header[1])
    if code:
        if error is not None:
            raise error
        what = names[index] if index >= 0 else "the next bottleneck"
        raise ValueError(f"{WHO}: stage {stage} could not fit {what} ({_REFUSALS[code]}; that stage's error says why)")
    b = found[names[index]]
    if payload is None:
        payload = torch.zeros(b.features * b.rank + 1, dtype=torch.float64, device=device)
    if holds and replicas:  # replica 0's result, to the other replicas' holding stages
        dist.broadcast(payload, src=topology.rank(0, stage), group=placement.dp_group)
    if placement.num_stages > 1:
        dist.broadcast(payload, src=placement.rank_of_stage(stage), group=placement.pp_group)
    return names[index], payload[:-1].reshape(b.features, b.rank), float(payload[-1])


def _check_same_batches(batches: Iterable[Any], placement: Any) -> None:
    """Refuse batches that differ between the stages of a pipeline (every stage runs the same forward on them)."""
    if placement.num_stages == 1:
        return
    digest = torch.tensor([hash(tuple(failures.fingerprint(b) for b in batches)) & 0x7FFFFFFFFFFFFFFF],
                          dtype=torch.int64, device=placement.device)
    every = [torch.zeros_like(digest) for _ in range(placement.num_stages)]
    dist.all_gather(every, digest, group=placement.pp_group)
    if len({int(d) for d in every}) > 1:
        raise ValueError(f"{WHO}: the stages of a pipeline got different batches; pass the same batches on every "
                         f"stage (a list built the same way everywhere, or a DataLoader that does not shuffle)")
