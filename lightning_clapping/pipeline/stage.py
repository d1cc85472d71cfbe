"""Running the user's own step code as one pipeline stage.

Every rank calls the user's unchanged ``training_step`` (or ``validation_step`` ...) for each micro-batch. What
makes a rank one *stage* is a thin wrapper around the ``forward`` of every unit of the partition:

* units of earlier stages are not run: on the meta device the wrapper works out what they would return and hands
  back tensors of that shape filled with NaN (placeholders that cost no parameters and never reach the result).
  Tensors the module builds itself (``torch.ones(T, T)``, ``torch.arange(T)`` without ``device=``) land on the meta
  device too; code the meta device cannot run is retried with fake tensors (see :meth:`StageRunner._stub`);
* at the stage's first module (its *entry*) the tensors the forward passes in are replaced by the ones received
  from the previous stage;
* at the next stage's first module (the *exit*) the tensors the forward would pass in are captured for sending and
  the step is abandoned with :class:`StageExit`.

So the boundary between stages is the call of a cut module: the tensors given to it cross the wire, extra inputs
such as attention masks included. The user's Python code between modules (reshapes, pooling, loss) runs as written.
A value computed before the cut and used after it without passing through the cut module (a residual in the parent's
loop, an encoder's memory) is found by following the parent's code and sent along (see
:mod:`lightning_clapping.pipeline.crossings`); modules without parameters run wherever they are called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_clapping.comm import safe_objects
from lightning_clapping.pipeline import recompute as checkpointing
from lightning_clapping._compat import tree_flatten, tree_unflatten
from lightning_clapping.pipeline.crossing_plan import CrossingError, Need
from lightning_clapping.pipeline.crossings import Crossings
from lightning_clapping.pipeline.partition import Partition, PartitionError
from lightning_clapping.pipeline.placeholders import placeholder, run_on_fake, run_on_meta, signature


class StageExit(BaseException):
    """Raised inside the user's step once this stage's part of the forward is done.

    A ``BaseException`` so that user code catching ``Exception`` does not swallow it.
    """


class SplitError(RuntimeError):
    """The forward does not follow the partition (order, reuse across stages, leaked placeholders)."""


_IDLE, _BEFORE, _INSIDE = "idle", "before", "inside"

def tensor_leaves(obj: Any) -> list[Tensor]:
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, Tensor)]


class StageRunner:
    """Installs the unit wrappers for ``stage`` and tracks where the current micro-batch's forward is."""

    def __init__(self, module: nn.Module, partition: Partition, stage: int,
                 activation_checkpointing: checkpointing.Policy | None = None) -> None:
        self.module = module
        self.partition = partition
        self.stage = stage
        self.num_stages = partition.num_stages
        self.entry = partition.cut_points[stage - 1] if stage > 0 else None
        self.exit = partition.cut_points[stage] if stage < partition.num_stages - 1 else None
        self.state = _IDLE
        self.captured: tuple | None = None
        self._provider: Callable[[], list[Tensor]] | None = None
        self._stub_cache: dict[tuple, tuple] = {}
        self._saved_forwards: dict[str, Any] = {}
        self._modules = dict(module.named_modules())
        #: this stage's checkpointed submodules (see :mod:`lightning_clapping.pipeline.recompute`)
        self.checkpointed = checkpointing.targets(module, partition, stage, activation_checkpointing)
        self._saved_checkpointed: dict[str, Any] = {}
        #: provenance of the parent's code and the values that cross cuts outside the cut modules' inputs
        self.crossings = Crossings(stage, partition.cut_points) if partition.num_stages > 1 else None

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        """Wrap the units' forwards (and, inside them, the checkpointed submodules': a unit that is checkpointed
        itself gets the stage wrapper around its checkpointed forward, so the recompute runs the plain module)."""
        for name in self.checkpointed:
            self._saved_checkpointed[name] = checkpointing.wrap(self._modules[name])
        for name in (*self.partition.unit_stage, *self.partition.free):
            if name == "":
                continue
            unit = self._modules[name]
            self._saved_forwards[name] = unit.__dict__.get("forward")
            wrap = self._wrap_free if name in self.partition.free else self._wrap
            unit.forward = wrap(name, unit.forward)

    def uninstall(self) -> None:
        for name, saved in self._saved_forwards.items():
            unit = self._modules[name]
            if saved is None:
                unit.__dict__.pop("forward", None)
            else:
                unit.forward = saved
        self._saved_forwards.clear()
        for name, saved in reversed(self._saved_checkpointed.items()):
            checkpointing.unwrap(self._modules[name], saved)
        self._saved_checkpointed.clear()

    def release_foreign_state(self) -> None:
        """Move the parameters and buffers of other stages' units to the meta device (frees their memory).

        ``Module.to`` gives every module its own new parameter, which unties a tensor registered under two names;
        the released names of a tie inside one stage are tied again. A tie across stages stays cut on every stage,
        also on one that holds none of its copies: each copy is a parameter of its own (see
        :class:`~lightning_clapping.pipeline.partition.TiedGroup`), so every stage lists the same parameters, at the
        same optimizer positions, whichever stage it is."""
        for name, stage in self.partition.unit_stage.items():
            if stage != self.stage and name in self.partition.stateful_units:
                self._modules[name].to("meta")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        stage_of = self.partition.state_stage
        for alias, first in self.partition.aliases.items():
            if (params[alias].device.type == "meta" and params[first].device.type == "meta"
                    and stage_of.get(alias) == stage_of.get(first)):
                owner, _, leaf = alias.rpartition(".")
                setattr(self._modules[owner], leaf, params[first])

    def own_units(self) -> list[nn.Module]:
        return [self._modules[n] for n, s in self.partition.unit_stage.items() if s == self.stage]

    # ------------------------------------------------------------------ per micro-batch
    @contextmanager
    def microbatch(self, provider: Callable[[], list[Tensor]] | None, kind: str = "train",
                   discovering: bool = False, checking: bool = False):
        """Run one micro-batch's step; ``provider`` returns the received boundary tensors (stages > 0). ``kind``
        names the step's plan of crossing values (see :meth:`discover`)."""
        self.state = _INSIDE if self.stage == 0 else _BEFORE
        self.captured = None
        self._provider = provider
        self._called: set[str] = set()  # the units called so far in this micro-batch (for refusals)
        if self.crossings is not None:
            self.crossings.begin(kind, discovering, checking)
        try:
            yield self
        finally:
            if self.crossings is not None:
                self.crossings.end()
            reached = self.state != _BEFORE
            self.state = _IDLE
            self._provider = None
        if not reached:
            raise SplitError(
                f"stage {self.stage} never reached its first module {self.entry!r}: the step did not call it. "
                "Cut at a module that the forward calls on every batch."
            )

    @contextmanager
    def settling_shared_owners(self, module: nn.Module, rank_of_stage: Callable[[int], int], group: Any = None):
        """Run a step while recording which of the partition's shared parameters this stage's code uses, then give
        each to the one stage that used it (:meth:`Partition.settle_owner`). Every stage must take part: one
        all-gather of names over ``group`` (JSON, never pickled) (the ranks of one pipeline: ``rank_of_stage`` gives their global
        ranks) after the step."""
        params = dict(module.named_parameters(remove_duplicate=False))
        watched = {id(params[k]): k for k in self.partition.shared_params if k in params}
        with self.recording_uses(watched) as used:
            yield
        gathered: list[Any] = [sorted(used)]
        if self.num_stages > 1:
            gathered = safe_objects.all_gather(sorted(used), group=group)
        index = (lambda s: 0) if self.num_stages == 1 else \
            (lambda s: dist.get_group_rank(group or dist.group.WORLD, rank_of_stage(s)))
        for key in self.partition.shared_params:
            self.partition.settle_owner(key, [s for s in range(self.num_stages) if key in gathered[index(s)]])

    @contextmanager
    def recording_uses(self, watched: dict[int, str]):
        """Record which of ``watched`` (tensor id -> name) this stage's own code uses; yields the set of names.

        Only operations while the stage is running its own part count: before its first module, an earlier stage's
        code runs on placeholders, and nothing after its last module runs here.
        """
        used: set[str] = set()
        runner = self

        class _Uses(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if runner.state == _INSIDE:
                    for x in tree_flatten((args, kwargs))[0]:
                        if isinstance(x, Tensor) and id(x) in watched:
                            used.add(watched[id(x)])
                return func(*args, **kwargs)

        with _Uses():
            yield used

    def captured_tensors(self) -> list[Tensor]:
        """What this stage sends on: the next stage's entry inputs, then the values the plan moves (see
        :mod:`~lightning_clapping.pipeline.crossings`)."""
        if self.captured is None:
            raise SplitError(
                f"stage {self.stage}'s step finished without calling {self.exit!r}, the first module of stage "
                f"{self.stage + 1}; the model cannot be cut there (is that module only called conditionally?)"
            )
        return tensor_leaves(self.captured) + (self.crossings.outgoing() if self.crossings is not None else [])

    def needs_plan(self, kind: str) -> bool:
        return self.crossings is not None and kind not in self.crossings.plans

    def discover(self, kind: str, run: Callable[[], Any]) -> list[Need]:
        """Run one micro-batch's step (``run``) without sending or receiving, to find the values computed before
        this stage's entry that its own code uses (see :mod:`~lightning_clapping.pipeline.crossings`).

        Nothing of the run is kept: its graph is dropped without a backward, and the module's buffers (e.g. running
        statistics fed with placeholders) and torch's random streams are put back afterwards. Stage 0 has nothing
        before it, but runs too: its values are what the later stages' recomputed ones are checked against
        (:mod:`~lightning_clapping.pipeline.agreement`)."""
        if self.crossings is None:
            return []
        buffers = [(b, b.detach().clone()) for b in self.module.buffers() if b.device.type != "meta"]
        cpu_rng = torch.get_rng_state()
        cuda = [(d, torch.cuda.get_rng_state(d)) for d in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            # with gradients enabled, as in the real step (some forwards take another path under no_grad)
            try:
                with self.microbatch(None, kind, discovering=True):
                    try:
                        run()
                    except StageExit:
                        pass
                    needs = list(self.crossings.needs.values())
            except SplitError as err:  # modules called out of order: a random decision is the likelier cause
                if self.crossings.decisions:
                    raise self.crossings.random_decision(*self.crossings.decisions[0], self.entry, None) from err
                raise
            self.crossings.check_conversions(self.entry)
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            torch.set_rng_state(cpu_rng)
            for d, state in cuda:
                torch.cuda.set_rng_state(state, d)
        return needs

    # ------------------------------------------------------------------ the wrapper
    def _wrap(self, name: str, original: Callable) -> Callable:
        unit_stage = self.partition.unit_stage[name]
        stateful = name in self.partition.stateful_units
        runner = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            state = runner.state
            if state == _IDLE:
                args, kwargs = checkpointing.substitution_again(name, args, kwargs)  # a user checkpoint's recompute
                return original(*args, **kwargs)
            first_call = name not in runner._called
            runner._called.add(name)
            crossings = runner.crossings
            if name == runner.exit:
                if state != _INSIDE:
                    raise SplitError(f"{name!r} (first module of stage {runner.stage + 1}) ran before stage "
                                     f"{runner.stage} started; forward calls modules out of registration order")
                if crossings is not None:
                    args, kwargs = crossings.real_values((args, kwargs), f"{name!r}")
                runner.captured = (args, kwargs)
                raise StageExit
            if name == runner.entry:
                if state != _BEFORE:
                    raise SplitError(
                        f"{name!r}, the first module of stage {runner.stage}, was called twice in one step; "
                        "a pipeline stage boundary can be crossed once per micro-batch"
                    )

                def enter() -> Any:
                    a, k = runner._substitute(name, args, kwargs)
                    checkpointing.remember_substitution(name, (args, kwargs), (a, k))
                    runner.state = _INSIDE
                    if crossings is not None:
                        crossings.inside = True
                    return original(*a, **k)

                return crossings.call_unit(name, enter, skipped=False) if crossings is not None else enter()
            if state == _BEFORE:
                if stateful and unit_stage >= runner.stage:
                    raise SplitError(
                        f"{name!r} belongs to stage {unit_stage} but forward calls it before {runner.entry!r}, the "
                        f"first module of stage {runner.stage}: modules are called in a different order than they are "
                        "registered. Pass `split_points` that follow the call order."
                    )
                if crossings is not None:
                    return crossings.call_unit(name, lambda: runner._stub(name, original, args, kwargs), True)
                return runner._stub(name, original, args, kwargs)
            if stateful and unit_stage != runner.stage:
                if first_call and unit_stage < runner.stage:
                    raise runner._registered_before_called(name, unit_stage)
                where = "after the cut into" if unit_stage < runner.stage else "before the end of"
                raise SplitError(
                    f"{name!r} belongs to stage {unit_stage} but is called {where} stage {runner.stage}. Either the "
                    "step runs the model twice (call it once per step and reuse the output: each call would need "
                    "its own trip through the pipeline), or a module is reused at two places of the model or "
                    "called out of order (put all its uses in one stage with `split_points`)."
                )
            if crossings is not None:
                given = (args, kwargs)
                args, kwargs = real = crossings.real_values(given, f"{name!r}")
                checkpointing.remember_substitution(name, given, real)
                return crossings.call_unit(name, lambda: original(*args, **kwargs), False)
            return original(*args, **kwargs)

        return forward

    def _registered_before_called(self, name: str, unit_stage: int) -> SplitError:
        """The refusal of a module with parameters that the model registers before a cut but first calls after it
        (Hugging Face OPT's ``final_layer_norm``, litgpt's ``lm_head``): stages follow registration order, so it
        belongs to an earlier stage than the one that calls it, and no ``split_points`` can change that."""
        parent, _, leaf = name.rpartition(".")
        owner = f"self.{parent}" if parent else "self"
        return SplitError(
            f"{name!r} is registered before the cut at {self.entry!r} but forward first calls it after that cut, on "
            f"stage {self.stage}: stages own modules in the order the model registers them, so it belongs to stage "
            f"{unit_stage}, and no split_points can move it. Register it again where forward calls it, in your "
            f"LightningModule's __init__ after building the model: `{owner}.{leaf} = {owner}._modules.pop({leaf!r})` "
            "(this moves it after its siblings; its parameter names and checkpoints do not change).")

    def _wrap_free(self, name: str, original: Callable) -> Callable:
        """A module without parameters or saved state: it runs where the forward calls it, on every stage (its
        operations are followed like the parent's; see :meth:`Crossings.call_free`)."""
        runner = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            crossings = runner.crossings
            if runner.state == _IDLE or crossings is None:
                return original(*args, **kwargs)
            return crossings.call_free(name, lambda: original(*args, **kwargs),
                                       lambda: runner._stub(name, original, args, kwargs), args, kwargs)

        return forward

    def _substitute(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The entry's inputs replaced by the received tensors; the values the plan sends besides them are handed
        to :class:`Crossings` (while discovering nothing is received and the placeholders stay)."""
        crossings = self.crossings
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        if crossings is not None and crossings.discovering:
            crossings.available([leaves[i] for i in slots])
            return args, kwargs
        assert self._provider is not None
        received = self._provider()
        extra = crossings.received_count() if crossings is not None else 0
        if len(slots) + extra != len(received):
            raise SplitError(
                f"stage {self.stage} received {len(received)} tensors for {name!r} but its call here passes "
                f"{len(slots)}{f' and the plan adds {extra}' if extra else ''}: the stages disagree about the "
                "inputs of the cut module"
            )
        if crossings is not None:
            crossings.alias([leaves[i] for i in slots], received[:len(slots)])
            crossings.accept(received[len(slots):])
        for i, t in zip(slots, received):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _stub(self, name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
        """Placeholders shaped like what the skipped unit ``name`` would return for these inputs.

        The output structure, shapes and dtypes are cached per unit and per input *signature* (tensor shapes and
        dtypes, plain scalar values; see :func:`_signature`). That assumes they depend on nothing else: not on the
        values inside the input tensors, nor on the module's Python state (``self.training``, a step counter). A module
        whose output shape followed its inputs' values would be cached with the shape of its first call; in practice
        such a module is refused instead, since neither the meta device nor fake tensors can read a value. A module
        whose output changes with its Python state is not caught and would be cached wrongly.
        """
        leaves, spec = tree_flatten((args, kwargs))
        key = (name, tuple(signature(x) for x in leaves))
        device = self._device(leaves)
        cached = self._stub_cache.get(key)
        if cached is None:
            try:
                out = run_on_meta(original, leaves, spec)
            except Exception as err:  # noqa: BLE001 - retried with fake tensors, then re-raised with the reason
                try:
                    out = run_on_fake(self._modules[name], original, leaves, spec, device)
                except Exception as fake_err:  # noqa: BLE001
                    raise SplitError(
                        f"stage {self.stage} skips {name!r} (it runs on an earlier stage) and needs the shape of its "
                        f"output, but the module cannot run on the meta device: {err}. Cut the model after this "
                        "module's data-dependent code, or move that code into the first stage. (With fake tensors "
                        f"it fails too: {type(fake_err).__name__}: {fake_err})"
                    ) from err
            out_leaves, out_spec = tree_flatten(out)
            template = [(tuple(x.shape), x.dtype) if isinstance(x, Tensor) else x for x in out_leaves]
            cached = (out_spec, template, [isinstance(x, Tensor) for x in out_leaves])
            self._stub_cache[key] = cached
        out_spec, template, is_tensor = cached
        # NaN marks a leaked value in what a step sends; the pass that finds the crossing values sends nothing, and
        # there the stage's own code runs on these: finite ones in every usual domain (probabilities, logs) keep
        # operations that check their inputs' values (binary_cross_entropy, multinomial) from refusing NaN
        fill = 0.5 if self.crossings is not None and self.crossings.discovering else math.nan
        out = [placeholder(t[0], t[1], device, fill) if flag else t for t, flag in zip(template, is_tensor)]
        return tree_unflatten(out, out_spec)

    def _device(self, leaves: list) -> torch.device | None:
        """Where this stage's tensors live: its inputs' device, else its own parameters' (None: the default)."""
        for x in leaves:
            if isinstance(x, Tensor) and x.device.type != "meta":
                return x.device
        for unit in self.own_units():
            for t in (*unit.parameters(), *unit.buffers()):
                if t.device.type != "meta":
                    return t.device
        return None

def check_finite(tensors: list[Tensor], what: str, first_step: bool) -> None:
    """Refuse to send or use NaN, and say the likely cause.

    Only NaN is refused: it is what the placeholders of skipped modules hold, so on the first step a NaN means a value
    leaked across a cut. ``inf`` and ``-inf`` are ordinary values (an additive attention mask such as
    ``nn.Transformer.generate_square_subsequent_mask`` holds ``-inf``) and pass.
    """
    for i, t in enumerate(tensors):
        if (t.dtype.is_floating_point or t.dtype.is_complex) and t.numel() and bool(torch.isnan(t).any()):
            hint = (
                " On the first step this usually means the model cannot be cut here: a value computed before the "
                "cut (by an earlier stage) is used after it without passing through the cut module's inputs. Pass "
                "that value to the cut module, or choose other `split_points`."
                if first_step
                else " The model or its inputs produced NaN (diverged training?)."
            )
            raise SplitError(f"{what}: tensor {i} of shape {tuple(t.shape)} holds NaN.{hint}")


__all__ = ["CrossingError", "PartitionError", "SplitError", "StageExit", "StageRunner", "check_finite",
           "tensor_leaves"]
