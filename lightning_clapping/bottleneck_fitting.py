"""Start the bottlenecks from the data where the model is: in one process, or on the pipeline's stages.

:func:`~lightning_clapping.fit_bottlenecks` needs the whole model in one process: it runs the forward there. A model
that only fits on the pipeline's stages is fitted by the stages instead, with the same result: the callback
:class:`FitBottlenecks` (``Trainer(callbacks=[FitBottlenecks(batches)])``) does it at the start of training, through
``ClappingStrategy.fit_bottlenecks`` under this strategy and through ``fit_bottlenecks`` in one process under any
other.

On the stages, the bottlenecks are fitted in the order the forward reaches them, one pass over ``batches`` each, as in
one process. A pass is a forward-only run of the pipeline on every batch (the messages evaluation sends); the stage
that holds the next bottleneck's ``down`` half sums the second moments of what reaches it, takes their principal
directions, and broadcasts them over its pipeline, so the stage that holds ``up`` gets them too. With replicas, each
stage's sums are added over its replicas first and the replicas of that stage then share replica 0's result, so every
replica starts from the same weights. No rank holds more than its own stage; the only extra messages are, per
bottleneck, its ``features x rank`` directions and a few integers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_clapping import first_pass
from lightning_clapping.comm import failures
from lightning_clapping.log_relay import LogRelay
from lightning_clapping.pipeline import bottleneck as bn

KIND = "fit_bottlenecks"  # the pipeline's plan of the values crossing cuts is kept per kind of forward
WHO = "FitBottlenecks"
_REFUSALS = ("", "never reached", "no position counted", "NaN or inf")


class FitBottlenecks(pl.Callback):
    """At the start of training, start every :class:`~lightning_clapping.Bottleneck` from the principal directions of
    what reaches it, as :func:`~lightning_clapping.fit_bottlenecks` does, wherever the model is.

    Args:
        batches: the batches to fit on, the same on every process (a list, or a DataLoader that does not shuffle):
            they are run once per bottleneck. Each is moved to the device as Lightning moves a training batch.
        run: ``run(batch)`` runs the model's forward on one batch (on a pipeline: on every stage, as a training step
            does). Default: the module's ``training_step(batch, 0)``, whose logged values are dropped.
        positions: ``positions(batch)``, a bool mask over the leading dimensions of what reaches each bottleneck (for
            padded text, ``lambda batch: batch["attention_mask"].bool()``); only those positions count.

    It fits once: not when training resumes from a checkpoint (which holds the fitted weights, and this callback's
    state), and not again in a later ``fit`` of the same Trainer. Torch's random state is put back afterwards, so
    training draws what it would have drawn without the fit. After the fit, :attr:`kept` holds, by module name, the
    fraction of its inputs' energy each bottleneck keeps (printed too).
    """

    def __init__(self, batches: Iterable[Any], run: Callable[[Any], Any] | None = None,
                 positions: Callable[[Any], Tensor] | None = None) -> None:
        bn.check_reusable(batches, WHO)
        self.batches, self.run, self.positions = batches, run, positions
        self.kept: dict[str, float] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kept is not None or trainer.ckpt_path is not None:
            rank_zero_info(f"{WHO}: not fitted again (the weights come from the checkpoint or an earlier fit)")
            return
        strategy = trainer.strategy
        run = self.run or (lambda batch: pl_module.training_step(batch, 0))
        device = pl_module.device
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            with trainer.precision_plugin.val_step_context():
                if isinstance(strategy, OnStages):
                    self.kept = strategy.fit_bottlenecks(self.batches, run, self.positions)
                else:
                    self.kept = _in_one_process(pl_module, self.batches, run, self.positions, strategy.batch_to_device)
        rank_zero_info(f"{WHO}: fitted " + ", ".join(f"{n} (keeps {k:.1%} of its inputs' energy)"
                                                     for n, k in self.kept.items()))

    def state_dict(self) -> dict[str, Any]:
        return {"kept": self.kept}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.kept = state_dict.get("kept")


def _in_one_process(module: pl.LightningModule, batches: Iterable[Any], run: Callable[[Any], Any],
                    positions: Callable[[Any], Tensor] | None, to_device: Callable[[Any], Any]) -> dict[str, float]:
    """:func:`fit_bottlenecks` on ``module``, with what the forward logs dropped and its attributes put back."""
    relay = LogRelay(module)
    with first_pass.quiet(module, relay), relay.capture(1):
        return bn.fit_bottlenecks(module, _Moved(batches, to_device), run, positions)


class _Moved:
    """``batches``, each moved to the device when iterated (iterable as often as ``batches`` is)."""

    def __init__(self, batches: Iterable[Any], to_device: Callable[[Any], Any]) -> None:
        self.batches, self.to_device = batches, to_device

    def __iter__(self):
        return (self.to_device(b) for b in self.batches)


class OnStages:
    """``ClappingStrategy.fit_bottlenecks``: the stages fit the bottlenecks together (a mixin of the strategy)."""

    def fit_bottlenecks(self, batches: Iterable[Any], run: Callable[[Any], Any],
                        positions: Callable[[Any], Tensor] | None = None) -> dict[str, float]:
        """Collective over every rank, between setup and the first training step (:class:`FitBottlenecks` calls it):
        start every bottleneck from the principal directions of what reaches it, as
        :func:`~lightning_clapping.fit_bottlenecks` does in one process. Returns the kept fractions, on every rank."""
        driver = self._driver  # type: ignore[attr-defined]
        bn.check_reusable(batches, WHO)
        return _fit_on_stages(driver, batches, run, positions, self.batch_to_device)  # type: ignore[attr-defined]


def _fit_on_stages(driver: Any, batches: Iterable[Any], run: Callable[[Any], Any],
                   positions: Callable[[Any], Tensor] | None, to_device: Callable[[Any], Any]) -> dict[str, float]:
    module, placement, partition = driver.module, driver.placement, driver.partition
    found = bn.bottlenecks_of(module, WHO)
    names = list(found)
    holder = {n: partition.state_stage[partition.aliases.get(f"{n}.down.weight", f"{n}.down.weight")]
              for n in names}  # the stage that holds ``down``
    kept: dict[str, float] = {}
    modes = [(m, m.training) for m in module.modules()]
    for m, _ in modes:  # as fit_bottlenecks: flags set, not train()/eval() called
        m.training = False
    try:
        with torch.no_grad(), first_pass.quiet(module, driver.relay):
            _check_same_batches(batches, placement)
            while len(kept) < len(names):
                pending = {n: found[n] for n in names if n not in kept}
                stage = min(holder[n] for n in pending)  # the next bottleneck is the first this stage reaches
                mine = {n: m for n, m in pending.items() if holder[n] == placement.stage}
                with bn.GramRecorder(WHO, mine, record=placement.stage == stage) as recorder:
                    for batch in batches:
                        batch = to_device(batch)

                        def step(mb: Any, j: int) -> Any:
                            recorder.start_forward(None if positions is None else positions(mb))
                            return run(mb)

                        driver.forward_only(KIND, batch, step)
                name, top, fraction = _share(recorder, stage, names, found, placement)
                bn.set_directions(found[name], top)
                kept[name] = fraction
    finally:
        for m, mode in modes:
            m.training = mode
    return {n: kept[n] for n in names if n in kept}


def _share(recorder: bn.GramRecorder, stage: int, names: list[str], found: dict[str, bn.Bottleneck],
           placement: Any) -> tuple[str, Tensor, float]:
    """After a pass: the holding stage (its sums added over the replicas) takes the principal directions, and every
    rank of the pipeline gets them, or the same refusal."""
    device = placement.device
    header = torch.zeros(2, dtype=torch.int64, device=device)  # [refusal, index of the bottleneck]
    mine = placement.stage == stage
    gram = None
    if mine:
        gram = recorder.gram
        first = recorder.first
        if placement.num_replicas > 1 and placement.dp_group is not None:  # every replica's batches count
            rows = torch.tensor([float(recorder.rows)], dtype=torch.float64, device=device)
            features = found[first].features if first is not None else 0
            gram = gram.to(device) if gram is not None else torch.zeros(features, features, dtype=torch.float64,
                                                                      device=device)
            dist.all_reduce(gram, group=placement.dp_group)
            dist.all_reduce(rows, group=placement.dp_group)
            recorder.gram, recorder.rows = gram, int(rows.item())
        try:
            first, gram = recorder.result()
            header[1] = names.index(first)
        except ValueError as err:
            refusal = next(i for i, r in enumerate(_REFUSALS) if i and r in str(err))
            header[0] = refusal
            header[1] = names.index(recorder.first) if recorder.first is not None else -1
    src = placement.rank_of_stage(stage)
    if placement.num_stages > 1:
        dist.broadcast(header, src=src, group=placement.pp_group)
    refusal, index = int(header[0]), int(header[1])
    if refusal:
        if mine:
            recorder.result()  # raises the holding stage's own message
        what = names[index] if index >= 0 else "the next bottleneck"
        raise ValueError(f"{WHO}: stage {stage} could not fit {what} ({_REFUSALS[refusal]}; that stage's error says "
                         f"why)")
    name = names[index]
    b = found[name]
    payload = torch.zeros(b.features * b.rank + 1, dtype=torch.float64, device=device)
    if mine and (placement.replica == 0 or placement.num_replicas == 1):
        top, fraction = bn.principal_directions(gram.to(device), b.rank)
        payload[:-1] = top.reshape(-1)
        payload[-1] = fraction
    if mine and placement.num_replicas > 1 and placement.dp_group is not None:  # replica 0's, to the others
        dist.broadcast(payload, src=placement.topology.rank(0, stage), group=placement.dp_group)
    if placement.num_stages > 1:
        dist.broadcast(payload, src=src, group=placement.pp_group)
    return name, payload[:-1].reshape(b.features, b.rank), float(payload[-1])


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
                         f"process (a list built the same way everywhere, or a DataLoader that does not shuffle)")
