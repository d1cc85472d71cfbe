"""Values that cross a cut without passing through the cut module's inputs.

Real models use, after a cut, tensors computed before it: the residual stream of a parent's loop
(``x = blk(x) + x``), an encoder's memory and a decoder's input embedding, rotary tables computed once and passed to
every layer, masks built from the embeddings. Every stage runs the parent's Python code, so on stage ``s`` such a value
was computed from placeholders (the outputs of earlier stages' modules, which this stage skips).

**How they are found: provenance.** While a micro-batch runs, a :class:`~torch.overrides.TorchFunctionMode` follows
the parent's code (everything outside the stages' modules). A tensor is *tainted* when it derives from a placeholder:
the output of a skipped module, or of an operation on a tainted tensor. Every tensor that the parent's code produces
is named by its *event*: the position of the module call or operation that made it (see
:meth:`Crossings._next_event`), which is the same on every stage because every stage runs the same code. When this stage's own code (after its
first module) uses a tainted tensor, the value it needs is the one of that event, which an earlier stage computes for
real. Operations that read only a tensor's shape, dtype or device (``x.shape``, ``torch.zeros_like(x)``,
``x.new_ones(...)``) do not count as uses and taint nothing.

What depends only on the batch (masks from ``attention_mask``, ``arange`` position ids, rotary tables from position
ids) is never tainted: every stage recomputes it from its own copy of the batch and nothing is sent. **Random numbers
are not batch-only**: each stage's generator is at another place (the stages run different modules, under their own
seeds), so a value drawn in the parent's code (``torch.randn_like`` noise, a ``torch.rand`` mask, ``torch.randperm``, a
distribution's sample, functional dropout, ``gumbel_softmax``) is tainted where it is drawn, with the region of the
stage whose part of the code draws it: that stage draws it for real and sends it to every later stage that uses it,
exactly as it sends a value computed from its modules. Every stage therefore computes with the one draw a single
process makes. A random draw turned into a Python value before a stage's entry (stochastic depth decided in the
parent's loop) cannot be sent and is refused with the op named (:meth:`Crossings.check_conversions`). Modules without
parameters or persistent buffers (rotary embeddings, mask builders, activations) belong to no stage: they run where
they are called, so their output is recomputed locally too when their inputs are.

**How they travel.** On the first step of each kind (training, validation, test, predict) every stage runs its
micro-batch 0 once without sending anything (:meth:`StageRunner.discover`), records what it needs, and the stages
exchange those needs as small integer tensors. The :class:`Plan` then says, for every boundary, which values cross it
besides the cut module's inputs: a value computed on stage ``j`` and used on stage ``s > j`` rides on the forward
messages of boundaries ``j .. s - 1`` (relayed by the stages in between), and its gradient comes back the same way.
It is sent with the boundary's own tensors, through the same codec, and counted in the same byte totals.

**Custom autograd Functions.** ``Function.apply`` is no torch function, so the mode does not see it: while a
micro-batch runs, :func:`~lightning_clapping.pipeline.draws.apply_with_real_values` hands every ``apply`` of this stage's own code the real values of
its tainted arguments (received crossing values, which require grad). Its output then hangs off them in autograd, so
the gradient a Function returns (a gradient reversal's ``-alpha * g``) reaches the stage that made the value, and the
tensors it saves for backward are real ones, as in one process.

A later step whose forward uses a tainted value the plan does not carry, or whose operation at a planned position is
not the one of the first step, is refused with the reason: its forward differs between steps in a way that moves
values across cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name

from lightning_clapping._compat import tree_flatten, tree_unflatten
from lightning_clapping.pipeline.crossing_plan import CrossingError, Need, Plan, op_code
from lightning_clapping.pipeline.crossing_plan import where as event_where
from lightning_clapping.pipeline import coupling
from lightning_clapping.pipeline.draws import apply_with_real_values, draws, is_random


_ATTR = "_clapping_origin"  # (micro-batch serial, event, leaf, region) on a tainted tensor
_RECOMPUTED = "_clapping_recomputed"  # the same, while discovering, on an untainted value made before the entry
_DRAWN = "_clapping_drawn"  # (micro-batch serial, the random operation) while discovering: derived from a random draw

#: operations that read only a tensor's metadata: not a use of its values, and their result is not tainted
_METADATA = frozenset(f"torch.Tensor.{n}" for n in (
    "shape.__get__", "size", "dim", "ndim.__get__", "ndimension", "dtype.__get__", "device.__get__", "numel",
    "nelement", "__len__", "is_floating_point", "is_complex", "element_size", "stride", "is_contiguous",
    "layout.__get__", "is_cuda.__get__", "is_meta.__get__", "get_device", "names.__get__", "is_sparse.__get__",
    "is_quantized.__get__", "itemsize.__get__", "is_nested.__get__", "is_mkldnn.__get__", "is_mps.__get__",
    "is_xpu.__get__", "is_leaf.__get__", "requires_grad.__get__", "grad_fn.__get__", "is_inference",
))
#: operations whose result has the shape, dtype and device of a tensor argument but not its values
_SHAPED_LIKE = frozenset({
    "torch.zeros_like", "torch.ones_like", "torch.empty_like", "torch.full_like", "torch.rand_like",
    "torch.randn_like", "torch.randint_like", "torch.Tensor.new_zeros", "torch.Tensor.new_ones",
    "torch.Tensor.new_empty", "torch.Tensor.new_full",
})
#: operations whose second tensor argument gives only a dtype, device or shape
_FIRST_ONLY = frozenset({"torch.Tensor.to", "torch.Tensor.type_as", "torch.Tensor.expand_as",
                         "torch.Tensor.view_as", "torch.Tensor.reshape_as"})
#: operations that turn a tensor into a Python value, which cannot be followed or sent
_TO_PYTHON = frozenset(f"torch.Tensor.{n}" for n in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__",
                                                      "__complex__", "numpy"))
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})
_names: dict[Any, str] = {}


def op_name(func: Any) -> str:
    name = _names.get(func)
    if name is None:
        name = _names[func] = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
    return name


def _is_inplace(name: str) -> bool:
    last = name.rpartition(".")[2]
    return last in _INPLACE_DUNDERS or (last.endswith("_") and not last.startswith("__"))


def _written(name: str, args: tuple, out: Any) -> Any:
    """What an operation made, as the plan names its outputs: an in-place write made the tensor it wrote (output 0;
    ``x[i] = v`` returns None) and, through a view, the view's base (output 1)."""
    if not (_is_inplace(name) and args and isinstance(args[0], Tensor)):
        return out
    target = args[0]
    return (target, target._base) if target._base is not None else target


def _tensors(obj: Any) -> Iterable[Tensor]:
    """The tensors among a call's arguments, one level into lists, tuples and dicts (as ``torch.cat`` takes them)."""
    for x in obj:
        if isinstance(x, Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, Tensor):
                    yield y
        elif isinstance(x, dict):
            for y in x.values():
                if isinstance(y, Tensor):
                    yield y


class Crossings:
    """Provenance of one stage's micro-batch and the values the plan moves (one per :class:`StageRunner`)."""

    def __init__(self, stage: int, cut_points: tuple[str, ...]) -> None:
        self.stage = stage
        self.cut_index = {name: i for i, name in enumerate(cut_points)}
        self.plans: dict[str, Plan] = {}
        self.plan: Plan | None = None
        self.discovering = False
        self.recording = False  # discovering, or a step the guard checks again (pipeline/agreement)
        self.active = False
        self.inside = False
        self._serial = 0
        self._mode = _Mode(self)
        self._reset()

    def _reset(self) -> None:
        self.modules = 0
        self.offset = 0
        self.region = 0
        self.unit_depth = 0
        self.free_depth = 0
        self.real: dict[tuple[int, int], Tensor] = {}  # values of tainted keys: entry aliases, received ones
        self.made: dict[tuple[int, int], Tensor] = {}  # values this stage makes for later stages
        self.needs: dict[tuple[int, int], Need] = {}  # found while discovering
        self.names: dict[int, str] = {}  # event -> operation, for tainted events (messages)
        #: while discovering: Python values made from random draws, [(operation, draw)] (a random decision)
        self.decisions: list[tuple[str, str]] = []
        #: while discovering: Python values made from tainted tensors before the entry, [operation, maker, user]
        self.conversions: list[list[str | None]] = []
        #: while discovering, for the guard (:mod:`~lightning_clapping.pipeline.agreement`): the values made before
        #: the entry without taint that this stage's code uses, (event, leaf) -> (region, value); and event -> output
        #: of every operation this stage runs inside its part
        self.recomputed: dict[tuple[int, int], tuple[int, Tensor]] = {}
        self.own: dict[int, Any] = {}
        #: while discovering: operations of this stage's own code that may mix a batch's samples (pipeline/coupling)
        self.coupled: list[tuple] = []
        self._make = self.plan.made_on(self.stage) if self.plan is not None else {}

    # ------------------------------------------------------------------ per micro-batch
    def begin(self, kind: str, discovering: bool, checking: bool = False) -> None:
        """Start following a micro-batch; ``checking``: record what the guard compares, as when discovering."""
        self._serial += 1
        self.plan = None if discovering else self.plans.get(kind)
        self.discovering = discovering
        self.recording = discovering or checking
        self._reset()
        self.inside = self.stage == 0
        self.active = True
        self._mode.__enter__()
        self._apply = apply_with_real_values(self)
        self._apply.__enter__()

    def end(self) -> None:
        if self.active:
            self.active = False
            self._apply.__exit__(None, None, None)
            self._mode.__exit__(None, None, None)
            self.real, self.made = {}, {}

    def received_count(self) -> int:
        return len(self.plan.crossing(self.stage - 1)) if self.plan is not None else 0

    # ------------------------------------------------------------------ taint
    def origin_of(self, t: Tensor) -> tuple[int, int, int, int] | None:
        tag = getattr(t, _ATTR, None)
        return tag if tag is not None and tag[0] == self._serial else None

    def _tag(self, out: Any, event: int, tainted_only: bool = False) -> None:
        """Name ``out``'s tensors as the outputs of ``event`` (``tainted_only``: only those already tainted)."""
        leaves = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
        for i, x in enumerate(leaves):
            if isinstance(x, Tensor) and (not tainted_only or self.origin_of(x) is not None):
                setattr(x, _ATTR, (self._serial, event, i, self.region))

    def _mark_recomputed(self, out: Any, event: int) -> None:
        """While discovering: name the untainted tensors of ``out`` as recomputed here from the batch (the guard
        compares the ones this stage's own code uses with the stage that makes them)."""
        leaves = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
        for i, x in enumerate(leaves):
            if isinstance(x, Tensor) and self.origin_of(x) is None:
                setattr(x, _RECOMPUTED, (self._serial, event, i, self.region))

    def _tainted(self, args: tuple, kwargs: dict, name: str) -> bool:
        if name in _METADATA or name in _SHAPED_LIKE:
            return False
        if name in _FIRST_ONLY:
            return bool(args) and isinstance(args[0], Tensor) and self.origin_of(args[0]) is not None
        return any(self.origin_of(t) is not None for t in _tensors((*args, *kwargs.values())))

    def _next_event(self, name: str, module: bool = False) -> int:
        """The position of an operation or module call of the parent's code: the number of module calls so far and
        the operation's rank among those after the last one. Counted from the last module call, a position does not
        move when code before it changes between steps (a mask cached on ``self`` on the first step), and
        operations that read only metadata (``x.requires_grad`` in an ``any(...)`` that stops early) are not
        counted."""
        if module:
            self.modules += 1
            self.offset = 0
        else:
            self.offset += 1
        e = (self.modules << 24) | self.offset
        self.names[e] = name
        return e

    # ------------------------------------------------------------------ this stage's own code
    def real_values(self, obj: Any, where: str) -> Any:
        """``obj`` with every tainted tensor replaced by its real value (received, or aliased at the entry).

        While discovering, the value is recorded as needed and the placeholder kept."""
        leaves, spec = tree_flatten(obj)
        found = False
        for i, x in enumerate(leaves):
            if isinstance(x, Tensor):
                tag = self.origin_of(x)
                if tag is not None:
                    leaves[i], found = self._real(tag, x, where), True
                elif self.recording:
                    made = getattr(x, _RECOMPUTED, None)
                    if made is not None and made[0] == self._serial:
                        self.recomputed[(made[1], made[2])] = (made[3], x)
        return tree_unflatten(leaves, spec) if found else obj

    def _real(self, tag: tuple[int, int, int, int], placeholder: Tensor, where: str) -> Tensor:
        key = (tag[1], tag[2])
        value = self.real.get(key)
        if value is not None:
            return value
        op = self.names.get(tag[1], "an operation")
        if tag[1] < 0:
            raise CrossingError(
                f"stage {self.stage}: {where} uses a tensor computed inside a module without parameters that an "
                "earlier stage ran, and that module did not return it (it was kept elsewhere, e.g. on `self`). Return "
                "it from the module, or cut the model elsewhere.")
        if self.discovering:
            self.needs.setdefault(key, Need(tag[1], tag[2], tag[3], self.stage, op_code(op)))
            return placeholder
        raise CrossingError(
            f"stage {self.stage}: {where} uses the value made by `{op}` at {event_where(tag[1])} of the step, which "
            f"an earlier stage computes, but the first step's forward did not use it here. The model's forward changes "
            "between steps in a way that moves values across cuts (e.g. a branch on the step or on the data), which "
            "a pipeline cannot follow: make the forward the same on every step, or cut the model elsewhere.")

    def alias(self, placeholders: list[Any], received: list[Tensor]) -> None:
        """At this stage's entry: the received tensors stand for the placeholders the parent's code holds."""
        for x, t in zip(placeholders, received):
            tag = self.origin_of(x) if isinstance(x, Tensor) else None
            if tag is not None:
                self.real[(tag[1], tag[2])] = t

    def accept(self, extra: list[Tensor]) -> None:
        """The values the plan sends to this stage besides its entry's inputs."""
        if self.plan is None:
            return
        for key, t in zip(self.plan.crossing(self.stage - 1), extra):
            self.real[key] = t

    def available(self, placeholders: list[Any]) -> None:
        """While discovering: the entry's inputs will be received, so they are not needed separately."""
        for x in placeholders:
            tag = self.origin_of(x) if isinstance(x, Tensor) else None
            if tag is not None:
                self.real[(tag[1], tag[2])] = x

    def outgoing(self) -> list[Tensor]:
        """At this stage's exit: the values the plan sends on, made here or relayed, in message order."""
        if self.plan is None:
            return []
        out = []
        for key in self.plan.crossing(self.stage):
            source = self.made if self.plan.origin(key) == self.stage else self.real
            if key not in source:
                raise CrossingError(
                    f"stage {self.stage} should send the value made at {event_where(key[0])} of the step (output "
                    f"{key[1]}) to a later stage, but this step's forward did not make it: the forward differs from the first "
                    "step's. Make the forward the same on every step, or cut the model elsewhere.")
            out.append(source[key])
        return out

    def _keep(self, event: int, out: Any, name: str) -> None:
        leaves = self._make.get(event)
        if not leaves:
            return
        assert self.plan is not None
        if op_code(name) != self.plan.op((event, leaves[0])):
            raise CrossingError(
                f"stage {self.stage}: {event_where(event)} of the step runs `{name}`, but on the first step the value a "
                "later stage needs was made there by another operation: the forward differs between steps. Make the "
                "forward the same on every step, or cut the model elsewhere.")
        flat = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
        for leaf in leaves:
            if leaf < len(flat) and isinstance(flat[leaf], Tensor):
                self.made[(event, leaf)] = flat[leaf]

    def drawn_from(self, name: str, args: tuple, kwargs: dict) -> str | None:
        """While discovering: the random draw an operation's result derives from (``name`` itself if it draws),
        so that a refusal can name the draw rather than a comparison made of it."""
        if draws(name, args, kwargs):
            return name
        for t in _tensors((*args, *kwargs.values())):
            tag = getattr(t, _DRAWN, None)
            if tag is not None and tag[0] == self._serial:
                return tag[1]
        return None

    def mark_drawn(self, out: Any, drawn: str) -> None:
        for x in ([out] if isinstance(out, Tensor) else tree_flatten(out)[0]):
            if isinstance(x, Tensor):
                setattr(x, _DRAWN, (self._serial, drawn))

    def _convert(self, name: str, args: tuple) -> None:
        if self.discovering and args and isinstance(args[0], Tensor):
            tag = self.origin_of(args[0])
            if tag is not None:
                drawn = getattr(args[0], _DRAWN, None)
                maker = drawn[1] if drawn is not None and drawn[0] == self._serial else \
                    self.names.get(tag[1], "an operation")
                self.conversions.append([name, maker, None])

    def _used_by(self, module: str) -> None:
        for c in self.conversions:
            if c[2] is None:
                c[2] = module

    def check_conversions(self, entry: str | None) -> None:
        """After discovering: refuse a Python value made from an earlier stage's tensor (this stage cannot know it)."""
        if self.conversions:
            op, maker, user = self.conversions[0]
            if maker is not None and is_random(maker):
                raise self.random_decision(op, maker, entry, user)
            raise CrossingError(
                f"stage {self.stage}: `{op}` turns the tensor made by `{maker}`, which an earlier stage computes, into a "
                f"Python value before the cut at {entry!r}; that value cannot be sent, so code after the cut that uses "
                f"it (the next module called is {user!r}) would compute with a wrong one. Keep the value a tensor (it "
                "is then sent to the stages that use it), or cut the model after the code that uses it.")

    def random_decision(self, op: str, maker: str, entry: str | None, user: str | None) -> CrossingError:
        """The refusal of a random decision in the parent's code (``op`` turned the draw ``maker`` into a Python
        value before the cut at ``entry``; ``user``: the next module called)."""
        return CrossingError(
            f"stage {self.stage}: the step draws `{maker}` and turns the draw into a Python value with `{op}` before "
            f"the cut at {entry!r} (a random decision in the parent's code, such as stochastic depth in the loop over "
            "blocks). Every stage runs that code, each with its own generator, so the stages would decide "
            "differently and run different code (a decision is no tensor and cannot be sent). Draw it inside the "
            "module it decides about (a DropPath/StochasticDepth module inside each block runs on the stage that "
            f"owns the block{'' if user is None else f'; the next module called here is {user!r}'}), or keep it a "
            "tensor (multiply by the 0/1 draw instead of `if`): tensors drawn in the step are sent from where they "
            "are drawn.")

    # ------------------------------------------------------------------ module calls (from the stage wrapper)
    def call_unit(self, name: str, run: Callable[[], Any], skipped: bool) -> Any:
        """One call of a stage's module from the parent's code: one event; ``skipped``: it returns placeholders."""
        if self.unit_depth or self.free_depth:
            return run()
        if name in self.cut_index:
            self.region = self.cut_index[name] + 1
        self._used_by(name)
        event = self._next_event(name, module=True)
        self.unit_depth += 1
        try:
            out = run()
        finally:
            self.unit_depth -= 1
        if skipped:
            self._tag(out, event)
        elif self.inside:
            self._keep(event, out, name)
        return out

    def call_free(self, name: str, run: Callable[[], Any], stub: Callable[[], Any], args: tuple,
                  kwargs: dict) -> Any:
        """One call of a module that belongs to no stage. Before this stage's entry, with every tensor input
        tainted, its output is a placeholder too (``stub``); otherwise it runs here and its operations are followed."""
        if self.unit_depth or self.free_depth:
            return run()
        self._used_by(name)
        event = self._next_event(name, module=True)
        if not self.inside:
            tensors = list(_tensors((*args, *kwargs.values())))
            if tensors and all(self.origin_of(t) is not None for t in tensors):
                self.unit_depth += 1
                try:
                    out = stub()
                finally:
                    self.unit_depth -= 1
                self._tag(out, event)
                return out
        self.free_depth += 1
        try:
            out = run()
        finally:
            self.free_depth -= 1
        if self.inside:
            self._keep(event, out, name)
            if self.recording:
                self.own[event] = out
        else:
            self._tag(out, event, tainted_only=True)
            if self.recording:
                self._mark_recomputed(out, event)
        return out


class _Mode(TorchFunctionMode):
    """Follows the parent's operations for :class:`Crossings` (inside the stages' modules it does nothing)."""

    def __init__(self, crossings: Crossings) -> None:
        super().__init__()
        self.c = crossings

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.unit_depth:
            return func(*args, **kwargs)
        name = op_name(func)
        drawn = c.drawn_from(name, args, kwargs) if c.discovering else None
        if drawn is not None and name in _TO_PYTHON:
            c.decisions.append((name, drawn))
        out = self._follow(c, func, name, args, kwargs)
        if drawn is not None:
            c.mark_drawn(out, drawn)
        return out

    @staticmethod
    def _follow(c: Crossings, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        if c.inside:
            if name not in _METADATA and name not in _SHAPED_LIKE:
                if name in _FIRST_ONLY:
                    if args and isinstance(args[0], Tensor) and c.origin_of(args[0]) is not None:
                        args = (c.real_values(args[0], f"`{name}`"), *args[1:])
                else:
                    args, kwargs = c.real_values((args, kwargs), f"`{name}`")
            out = func(*args, **kwargs)
            if not c.free_depth and name not in _METADATA and name not in _TO_PYTHON:  # counted as below
                value = _written(name, args, out)
                event = c._next_event(name)
                c._keep(event, value, name)
                if c.recording:
                    c.own[event] = value
            if c.discovering and (seen := coupling.record(name, args, kwargs, out)) is not None:
                c.coupled.append(seen)
            return out
        # a random draw depends on where this stage's generator is, not on the batch: the stage whose part of the
        # code draws it makes it for real (see the module docstring)
        tainted = c._tainted(args, kwargs, name) or draws(name, args, kwargs)
        out = func(*args, **kwargs)
        if name in _METADATA:
            return out
        if name in _TO_PYTHON:
            if tainted:
                c._convert(name, args)
            return out
        event = c._next_event(name) if not c.free_depth else -1
        if tainted:
            c._tag(out, event)
            if _is_inplace(name) and args and isinstance(args[0], Tensor):
                setattr(args[0], _ATTR, (c._serial, event, 0, c.region))
                if args[0]._base is not None:  # a write through a view changes its base too (output 1)
                    setattr(args[0]._base, _ATTR, (c._serial, event, 1, c.region))
        elif c.recording and event >= 0:
            c._mark_recomputed(out, event)
        return out


__all__ = ["CrossingError", "Crossings", "Need", "Plan", "op_name"]
