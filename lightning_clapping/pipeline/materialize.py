"""Turning a model built on the meta device into real tensors, one stage at a time.

Big models are built without memory: layers created in ``LightningModule.configure_model()`` or under
``trainer.init_module(empty_init=True)`` land on the meta device (shapes only). Each rank then allocates only the
tensors of its own stage and gives each one the value the model's own code gives it:

1. **The recorded construction.** Under :func:`building_on_meta` (what the strategy's ``model_sharded_context()`` and
   ``tensor_init_context(empty_init=True)`` are) every torch call that creates or writes a meta tensor is recorded:
   each layer's ``reset_parameters()`` in its constructor, a parent's ``self.apply(self._init_weights)``, a loop that
   rescales some weights afterwards, ``nn.Parameter(torch.ones(d))``, buffers computed from constants (position
   ids, causal masks, rotary tables). A stage replays, on its own device, only the calls its tensors depend on.
2. **Modules built on the meta device without a record** (by ``torch.device("meta")`` directly, or moved there) run
   their own ``reset_parameters()`` (torch's layers), ``_reset_parameters()`` (``nn.MultiheadAttention``) or
   ``init_weights()`` (torchtitan-style), children before parents.
3. **Hugging Face models** skip their initialisation on the meta device (``post_init`` sees it); every module inside
   a ``PreTrainedModel`` gets that model's ``_init_weights(module)`` afterwards, as ``post_init`` gives it in one
   process (so buffers such as BERT's ``position_ids`` and Llama's rotary ``inv_freq`` are set too).
4. **Pretrained weights** (``pretrained=``, :mod:`lightning_clapping.checkpoint.pretrained`) replace the values of
   the tensors the checkpoint holds, read for this stage's tensors only.

Reproducibility: every call that writes a tensor of the model runs under a seed derived from the global seed
(``seed_everything``), the tensor's qualified name and the number of calls that wrote it before, and every module's
own or ``_init_weights`` initialisation starts from a seed of its name. A tensor's value therefore does not depend on
which other tensors a stage holds: 1, 2 or 4 stages start from the same model, and :func:`materialize_module` builds
that model in one process. (A plain single-device run that builds the model eagerly draws from one sequential stream
instead, so its weights differ: build on the meta device and call :func:`materialize_module` to start a single-device
run from the pipeline's weights.) torch's global random state is the same afterwards as before.

Every materialized floating-point tensor is filled with NaN first, so a tensor that nothing initialised is caught
and named instead of training on uninitialised memory.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Collection, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_clapping._compat import StorageWeakRef, tree_flatten, tree_unflatten
from lightning_clapping.checkpoint import pretrained as pretrained_io


class MaterializeError(RuntimeError):
    """A meta-built module cannot be materialized; the message names the module and what to add."""


def global_seed() -> int:
    """The seed ``seed_everything`` set (``PL_GLOBAL_SEED``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def module_seed(seed: int, name: str) -> int:
    """A seed for one named piece of initialisation: the same on every rank and for every partition."""
    return (zlib.crc32(name.encode()) * 0x9E3779B1 + seed * 0x85EBCA77) % (2**63 - 1)


# ------------------------------------------------------------------------------------ the record of a meta build
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})
_EMPTY_FACTORIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _written(func: Any, args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor a torch call writes in place (``x.normal_()``, ``nn.init.zeros_(x)``, ``x[0] = 1``, ``out=x``)."""
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        first = args[0] if args else next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        return first if isinstance(first, Tensor) else None
    return None


def _key(t: Tensor) -> Any:
    """The identity of a tensor's storage (views, ``.data`` and tied parameters share it)."""
    return StorageWeakRef(t.untyped_storage())


@dataclass(frozen=True)
class _Ref:
    """A meta tensor as the record keeps it: its storage (held, so that its identity is never reused) and where the
    tensor sits in it."""

    storage: Any
    key: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> _Ref:
        storage = t.untyped_storage()
        return cls(storage, StorageWeakRef(storage), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


@dataclass
class _Call:
    func: Any
    leaves: list  # the call's arguments flattened, meta tensors as _Ref
    spec: Any
    outs: list  # its result flattened: a _Ref per meta tensor, else None
    written: Any  # the storage it writes in place, or None
    dtype: torch.dtype  # the default dtype when it ran
    session: int
    reads: frozenset = field(init=False)
    writes: frozenset = field(init=False)

    def __post_init__(self) -> None:
        self.reads = frozenset(x.key for x in self.leaves if isinstance(x, _Ref))
        self.writes = frozenset([r.key for r in self.outs if r is not None] + ([self.written] if self.written else []))


class _Record:
    """Every recorded call of this process's meta builds, in order (a few hundred bytes each: no tensor data)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.session_start: list[int] = []
        self.active = False


_RECORD = _Record()


def _note(func: Any, args: tuple, kwargs: dict, out: Any, written: Tensor | None, session: int) -> None:
    written = written if written is not None and written.is_meta else None
    out_leaves = tree_flatten(out)[0]
    metas = [isinstance(x, Tensor) and x.is_meta for x in out_leaves]
    if written is not None or any(metas):
        leaves, spec = tree_flatten((args, kwargs))
        _RECORD.calls.append(_Call(
            func, [_Ref.of(x) if isinstance(x, Tensor) and x.is_meta else x for x in leaves], spec,
            [_Ref.of(x) if m else None for x, m in zip(out_leaves, metas)],
            _key(written) if written is not None else None, torch.get_default_dtype(), session))


class _Recorder(TorchFunctionMode):
    def __init__(self, session: int) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        _note(func, args, kwargs, out, _written(func, args, kwargs), self.session)
        return out


#: torch.nn.init functions that return at once on a meta tensor without a torch call the recorder could see
_SILENT_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


def _recording(fn: Any, session: int) -> Any:
    def init_fn(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if isinstance(tensor, Tensor) and tensor.is_meta:
            _note(fn, (tensor, *args), kwargs, tensor, tensor, session)
            return tensor
        return fn(tensor, *args, **kwargs)

    return init_fn


@contextmanager
def building_on_meta():
    """Build on the meta device (no memory) and record what the construction does, so that each stage later gives its
    tensors the values the model's own code gives them (see the module docstring). Nested uses record once."""
    if _RECORD.active:
        with torch.device("meta"):
            yield
        return
    session = len(_RECORD.session_start)
    _RECORD.session_start.append(len(_RECORD.calls))
    _RECORD.active = True
    originals = {name: getattr(nn.init, name) for name in _SILENT_ON_META}
    try:
        for name, fn in originals.items():
            setattr(nn.init, name, _recording(fn, session))
        with torch.device("meta"), _Recorder(session):
            yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)
        _RECORD.active = False


# --------------------------------------------------------------------------------------------- replaying a record
def _bytes_over(t: Tensor) -> Tensor:
    """A flat uint8 tensor over the whole storage of ``t``."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _view(real: dict, ref: _Ref) -> Tensor:
    return real[ref.key].view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)


def _is_meta_device(x: Any) -> bool:
    return (isinstance(x, torch.device) and x.type == "meta") or x == "meta"


def _plan(targets: set, calls: list[_Call]) -> tuple[list[int], set]:
    """The calls the ``targets`` storages depend on, in order, and the targets they rebuild: a target is rebuilt
    if a call creates it and everything its calls read was created within the record (not before the build)."""
    needed, chosen = set(targets), []
    for i in range(len(calls) - 1, -1, -1):
        if calls[i].writes & needed:
            chosen.append(i)
            needed |= calls[i].reads
    chosen.reverse()
    created: set = set()
    broken: set = set()
    for i in chosen:
        call = calls[i]
        if any(k not in created or k in broken for k in call.reads):
            broken |= call.writes
        created |= call.writes
    return [i for i in chosen if not calls[i].writes & broken], {k for k in targets if k in created and k not in broken}


def _call_seeds(calls: list[_Call], names: dict, seed: int) -> list[int]:
    """A seed per recorded call, the same on every stage: a call that writes a model tensor in place from the
    tensor's name and the number of in-place writes before it (the count :class:`_Seeded` continues, so a layer
    gets the same values whether its ``reset_parameters()`` is replayed or run), one that creates model tensors
    (``torch.randn``) from the first one's name, a temporary from its place in its build."""
    count: dict[str, int] = {}
    seeds = []
    for i, call in enumerate(calls):
        if call.written is not None and call.written in names:
            name = names[call.written]
            k = count.get(name, 0)
            count[name] = k + 1
            key = f"{name}#{k}"
        else:
            created = next((names[r.key] for r in call.outs if r is not None and r.key in names), None)
            key = f"{created}@new" if created else f"~{call.session}:{i - _RECORD.session_start[call.session]}"
        seeds.append(module_seed(seed, key))
    return seeds


def _replay(order: list[int], calls: list[_Call], seeds: list[int], dense: dict, device: torch.device) -> dict:
    """Run the planned calls on ``device``. ``dense`` maps a target's storage to its allocated tensor when that tensor
    is the whole storage (it is filled in place); returns every storage rebuilt, as flat bytes."""
    real = {k: _bytes_over(t) for k, t in dense.items()}
    for i in order:
        call = calls[i]
        fresh = [r for r in call.outs if r is not None and r.key not in call.reads]
        if getattr(call.func, "__name__", "") in _EMPTY_FACTORIES and fresh and all(r.key in dense for r in fresh):
            continue  # allocated already (and NaN-filled, so that a tensor nothing writes is caught)
        leaves = [_view(real, x) if isinstance(x, _Ref) else (device if _is_meta_device(x) else x) for x in call.leaves]
        args, kwargs = tree_unflatten(leaves, call.spec)
        torch.manual_seed(seeds[i])
        previous = torch.get_default_dtype()
        torch.set_default_dtype(call.dtype)
        try:
            out = call.func(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised with what was being replayed
            raise MaterializeError(
                f"replaying {getattr(call.func, '__qualname__', call.func)}, which the model's construction called on "
                f"the meta device, failed on {device}: {type(err).__name__}: {err}. Build that module eagerly, or give "
                "it a reset_parameters() and build it under torch.device('meta') (then that method initialises it)."
            ) from err
        finally:
            torch.set_default_dtype(previous)
        for ref, x in zip(call.outs, tree_flatten(out)[0]):
            if ref is None or not isinstance(x, Tensor) or ref.key in call.reads:
                continue
            if ref.key in real:
                _view(real, ref).copy_(x)
            elif (tuple(x.shape), tuple(x.stride()), x.storage_offset()) == (ref.size, ref.stride, ref.offset) and \
                    x.untyped_storage().nbytes() == ref.storage.nbytes():
                real[ref.key] = _bytes_over(x)
            else:  # laid out otherwise than on the meta device: copied into the meta layout
                real[ref.key] = torch.empty(ref.storage.nbytes(), dtype=torch.uint8, device=device)
                _view(real, ref).copy_(x)
    return real


class _Seeded(TorchFunctionMode):
    """While modules initialise themselves on a stage: every call that writes a tensor being materialized first
    seeds the generator from that tensor's name and count; tensors that were real before are left alone."""

    def __init__(self, names: dict, protected: set, counts: dict, seed: int) -> None:
        super().__init__()
        self.names, self.protected, self.counts, self.seed = names, protected, counts, seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if target is not None and not target.is_meta:
            key = _key(target)
            if key in self.protected:
                return target
            name = self.names.get(key)
            if name is not None:
                k = self.counts.get(name, 0)
                self.counts[name] = k + 1
                torch.manual_seed(module_seed(self.seed, f"{name}#{k}"))
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ materializing
def _direct_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))


def _initialiser(module: nn.Module):
    for hook in ("reset_parameters", "_reset_parameters", "init_weights"):
        fn = getattr(module, hook, None)
        if callable(fn) and not (hook == "init_weights" and _is_hf(module)):  # Hugging Face's: the whole model's
            return fn
    return None


def _is_hf(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and \
        any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _hf_owner(name: str, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The innermost Hugging Face ``PreTrainedModel`` that holds module ``name`` (or is it)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        m = modules.get(".".join(parts[:i]))
        if m is not None and _is_hf(m):
            return m
    return None


def _allocate(t: Tensor, device: torch.device) -> Tensor:
    new = torch.empty_like(t, device=device)
    with torch.no_grad():
        new.fill_(float("nan") if new.is_floating_point() or new.is_complex() else 0)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    new.__dict__.update(t.__dict__)  # attributes the model set on it (e.g. "no weight decay" flags)
    return new


@dataclass
class Materialized:
    """What :func:`materialize` did: how many modules it materialized, and what each ``pretrained`` source loaded."""

    modules: int = 0
    pretrained: list[pretrained_io.PretrainedReport] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.modules > 0


def materialize(modules: Iterable[tuple[str, nn.Module]], device: torch.device | str, seed: int | None = None,
                root: nn.Module | None = None, pretrained: dict[str, Any] | None = None,
                optional: Collection[str] = ()) -> Materialized:
    """Allocate and initialise the meta tensors of the given ``(qualified name, module)`` pairs (see the module
    docstring); real tensors are left as they are. ``root`` is the model the names are relative to (default: the
    pair named ``""``): it names tensors tied across modules and finds Hugging Face owners. ``pretrained`` maps a
    submodule name (``""``: the root) to a safetensors checkpoint whose tensors replace the initial values. Modules
    named in ``optional`` are left on the meta device unless a record, an initialiser or an owner gives them values."""
    seed, device = global_seed() if seed is None else seed, torch.device(device)
    pairs = list(modules)
    root = root if root is not None else dict(pairs).get("")
    tree = dict(root.named_modules()) if root is not None else dict(pairs)
    named = [(f"{n}.{k}" if n else k, t) for n, m in tree.items() for k, t in _direct_tensors(m)]
    canonical: dict[int, str] = {}
    for name, t in named:
        canonical.setdefault(id(t), name)
    calls = _RECORD.calls
    todo = [(n, m) for n, m in pairs if any(t.is_meta for _, t in _direct_tensors(m))]
    if optional:  # materialized only if something gives them values
        order, rebuilt = _plan({_key(t) for n, m in todo if n in optional for _, t in _direct_tensors(m)}, calls)
        todo = [(n, m) for n, m in todo if n not in optional or _initialiser(m) is not None or
                _hf_owner(n, tree) is not None or all(_key(t) in rebuilt for _, t in _direct_tensors(m) if t.is_meta)]
    if not todo:
        return Materialized()
    metas = {id(t): t for _, m in todo for _, t in _direct_tensors(m) if t.is_meta}
    owned = {n: [(k, id(t)) for k, t in _direct_tensors(m) if id(t) in metas] for n, m in todo}
    meta_names = {_key(t): canonical[id(t)] for _, t in named if t.is_meta}
    protected = {_key(t) for _, t in named if not t.is_meta and t.numel()}
    new = {i: _allocate(t, device) for i, t in metas.items()}  # tied tensors stay tied: one allocation each
    for name, m in todo:
        for k, i in owned[name]:
            (m._parameters if k in m._parameters else m._buffers)[k] = new[i]
    order, rebuilt = _plan({_key(t) for t in metas.values()}, calls)
    replayed = {i for i, t in metas.items() if _key(t) in rebuilt}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        if order:
            dense = {_key(metas[i]): new[i] for i in replayed if _whole_storage(metas[i])}
            with torch.device(device):
                real = _replay(order, calls, _call_seeds(calls, meta_names, seed), dense, device)
            for i in replayed:
                if _key(metas[i]) not in dense:
                    new[i].copy_(_view(real, _Ref.of(metas[i])))
        written: dict[Any, int] = {}
        for call in calls:
            if call.written is not None:
                written[call.written] = written.get(call.written, 0) + 1
        names = {_key(t): canonical[i] for i, t in new.items() if t.numel()}
        counts = {canonical[i]: written.get(_key(t), 0) for i, t in metas.items()}
        ran: dict[str, list[str]] = {n: ["its construction (recorded)"] if any(i in replayed for _, i in owned[n])
                                     else [] for n, _ in todo}
        with _Seeded(names, protected, counts, seed):
            for name, m in reversed(todo):  # children first: named_modules() is pre-order
                fn = _initialiser(m)
                if fn is not None and any(i not in replayed for _, i in owned[name]):
                    torch.manual_seed(module_seed(seed, f"{name}:init"))
                    fn()
                    ran[name].append(f"{type(m).__name__}.{fn.__name__}()")
            holding = {".".join(n.split(".")[:j]) for n, _ in todo for j in range(len(n.split(".")) + 1)} | {""}
            for name, m in reversed([(n, m) for n, m in pairs if n in holding]):
                owner = _hf_owner(name, tree)
                if owner is not None:
                    torch.manual_seed(module_seed(seed, f"{name}:_init_weights"))
                    owner._init_weights(m)
                    if name in ran:
                        ran[name].append(f"{type(owner).__name__}._init_weights")
        loaded, reports = _load_pretrained(pretrained or {}, tree, {canonical[i]: t for i, t in new.items()})
    _check(todo, owned, new, ran, {canonical[i] for i in new if canonical[i] in loaded}, canonical)
    return Materialized(len(todo), reports)


def _whole_storage(t: Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _load_pretrained(sources: dict[str, Any], tree: dict[str, nn.Module],
                     targets: dict[str, Tensor]) -> tuple[set[str], list[pretrained_io.PretrainedReport]]:
    """Read each source's tensors for the ``targets`` (canonical name -> materialized tensor) under its submodule."""
    loaded: set[str] = set()
    reports = []
    for prefix, path in sources.items():
        sub = tree.get(prefix)
        if sub is None:
            raise MaterializeError(f"pretrained: the model has no submodule {prefix!r} to load {str(path)!r} into; "
                                   "name a submodule of the LightningModule (e.g. 'model'), or '' for the whole")
        head = f"{prefix}." if prefix else ""
        persistent = set(sub.state_dict(keep_vars=True))
        transient = {n for n, _ in sub.named_buffers()} - persistent
        mine = {name[len(head):]: t for name, t in targets.items() if name.startswith(head)}
        report = pretrained_io.load_pretrained(path, mine, persistent, transient,
                                               getattr(sub, "base_model_prefix", "") or "")
        loaded |= {head + k for k in report.loaded}
        reports.append(report)
    return loaded, reports


def _check(todo: list, owned: dict, new: dict, ran: dict, loaded: set, canonical: dict) -> None:
    """Every materialized tensor must have been given a value: name the first one that was not, and what ran."""
    for name, m in todo:
        full = {i: f"{name}.{k}" if name else k for k, i in owned[name]}
        if not ran[name] and not all(canonical[i] in loaded for i in full):
            what = ", ".join(k for k, _ in owned[name])
            raise MaterializeError(
                f"module {name or '<root>'!r} ({type(m).__name__}) was built on the meta device and holds {what}, but "
                "nothing initialises them once its stage is materialized: it has no reset_parameters(), its "
                "construction was not recorded (build it in configure_model() or under "
                "trainer.init_module(empty_init=True), or with lightning_clapping.building_on_meta()), and no "
                f"pretrained checkpoint holds them. Add `def reset_parameters(self): ...` to {type(m).__name__} "
                "that initialises these tensors (it may call nn.init functions), or build this module eagerly."
            )
        for i, full_name in full.items():
            t = new[i]
            if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()) and canonical[i] not in loaded:
                raise MaterializeError(
                    f"{full_name!r} is still uninitialised after {' and '.join(ran[name]) or 'nothing'} ran on the "
                    "materialized stage: its module's initialisation must set every parameter and buffer. "
                    "Initialise it there (buffers computed from constants too, e.g. rotary tables)."
                )


def materialize_module(model: nn.Module, device: torch.device | str = "cpu", seed: int | None = None,
                       pretrained: Any = None) -> nn.Module:
    """Materialize a whole meta-built model in one process exactly as the pipeline's stages do (the same weights).

    ``pretrained``: a safetensors checkpoint for the whole model, or ``{submodule name: checkpoint}``, read as the
    strategy's ``pretrained=`` reads it; keys it lacks or does not use are warned about."""
    sources = pretrained if isinstance(pretrained, dict) else ({} if pretrained is None else {"": pretrained})
    done = materialize(model.named_modules(), device, seed, root=model, pretrained=sources)
    for report in done.pretrained:
        for warning in report.warnings():
            warnings.warn(warning, stacklevel=2)
    return model


__all__ = ["MaterializeError", "Materialized", "building_on_meta", "global_seed", "materialize", "materialize_module",
           "module_seed"]
