"""An opt-in, trainable boundary bottleneck: a low-rank down/up projection pair that a model puts where it is cut.

This is a **model change**, not a codec: ``Bottleneck(features, rank)`` is an ``nn.Module`` with two bias-free
linear maps, ``down`` (``features -> rank``) and ``up`` (``rank -> features``), and ``forward(x) = up(down(x))`` on
the last dimension. Put it in the model where a stage should end. A split point that names a ``Bottleneck`` cuts
between its two halves: ``down`` runs on the earlier stage, ``up`` on the later one, so the wire carries
``rank`` values per position instead of ``features`` (in both directions: the gradient that comes back has the
code's shape too), and any codec then compresses that code.

Because it is part of the model, everything else follows from Lightning as usual: the checkpoint holds ``down`` and
``up`` with the rest of the weights, and the model run in one process (inference, export, a Trainer without this
strategy) runs through the same projection it was trained with. It constrains what crosses the cut to a
``rank``-dimensional subspace that training learns; whether that costs quality is the model's business, and
BENCHMARKS.md measures it on the project's quality tasks.

At initialisation ``down`` has orthonormal rows and ``up`` is its transpose. With ``init="projection"`` (the
default) ``up(down(x))`` starts as an orthogonal projection onto a random ``rank``-dimensional subspace: an input
spread evenly over its ``features`` directions keeps ``rank / features`` of its energy. With ``init="rescaled"`` both
halves are multiplied by ``(features / rank) ** 0.25`` (balanced, so neither half's gradients dominate), which makes
``up(down(x))`` that projection times ``sqrt(features / rank)``: such an input keeps its expected squared norm. Which
one trains better is the model's business (BENCHMARKS.md section 1 measures both: the rescaled start suits an MLP
cut after its ReLUs, the projection suits a transformer's residual stream).

Models that call their blocks in a loop (Hugging Face transformers: ``for layer in self.layer: hidden =
layer(hidden, mask, ...)``) have no place to insert a module between two blocks. ``BottleneckAfter(block, features,
rank)`` wraps the block instead: it calls the block as the model calls it and passes what the block returns through
a ``Bottleneck``, so the model's own loop stays as it is, and the attributes the model reads from its blocks are read
from the wrapped one. The split point then names the bottleneck inside the wrapper (``"...layer.5.bottleneck"``).
Hidden states that transformers records from the block itself (``output_hidden_states=True``, by hooks on the
block's class) are the block's output before the bottleneck.

A random subspace suits a model trained from scratch, not a pretrained one: its later layers expect what the earlier
ones produce, and a random projection removes most of it. ``fit_bottlenecks(model, batches, run)`` starts every
bottleneck from the principal directions of the values it receives instead (the top ``rank`` eigenvectors of their
second-moment matrix, so ``up(down(x))`` is the orthogonal projection that keeps most of their energy), fitting them
in the order the forward reaches them, each with the ones before it in place. It runs the model forward in one
process, without gradients, on the batches given; run it before ``Trainer.fit``, like any other change to the
initial weights.

``Bottleneck(features, rank, residual=True)`` builds each half as a residual encoder / decoder around the same
low-rank identity path (in the manner of residual bottleneck models): ``down(x) = V x + E(x)`` and
``up(c) = U c + D(c)``, where ``V`` and ``U`` are the plain bottleneck's two matrices (``down.weight`` and
``up.weight``, started as above) and ``E``, ``D`` are small learned branches, ``E(x) = W2 gelu(W1 norm(x) + b1)``
(``norm``: a layer norm without weights, so the branch sees the direction of the input whatever its scale) and
``D(c) = W4 gelu(W3 c + b3)``, each ``hidden`` wide (default ``features``). ``W2`` and ``W4`` start at zero, so the
block starts exactly as the plain bottleneck does (the orthogonal projection, or its rescaled or fitted form) and
training then grows a nonlinear code and a nonlinear reconstruction on top of the linear path. The encoder lies
wholly in ``down`` and the decoder wholly in ``up``, so a cut between the halves still sends the ``rank`` values of
the code per position and nothing else; the branches cost about ``2 * hidden * (features + rank)`` parameters per
bottleneck and no bytes. ``fit_bottlenecks`` writes the identity path and starts both branches at zero output again.

A plain bottleneck can code fewer than its ``rank`` values: ``set_code_width(n)`` makes ``down`` compute only its
first ``n`` rows, so the cut carries ``n`` values per position (and the gradient coming back is ``n`` wide too), and
``up`` reads as many of its columns as the code it receives has. The columns of ``up`` past ``n`` are set to zero, so
the full-width forward and the narrowed one compute the same function: a model saved at any width runs the same in
one process at its full rank. Columns that have never been in use get no gradient and stay at zero (an optimizer's
state for them stays at zero too; ``down``'s unused rows get no gradient either, though a weight decay still shrinks
them), so a code that widens later starts its new values at zero contribution and training grows them;
:class:`~lightning_clapping.RankScheduler` widens every bottleneck at the steps it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

INITS = ("projection", "rescaled")

__all__ = ["Bottleneck", "BottleneckAfter", "fit_bottlenecks"]


class LowRankHalf(nn.Module):
    """One half of a residual :class:`Bottleneck`: ``weight`` (the identity path, ``[out_features, in_features]``
    like an ``nn.Linear``'s) plus a branch ``in -> hidden -> out`` whose last layer starts at zero.
    ``normalize``: the branch sees its input through a layer norm without weights (the encoder's case)."""

    def __init__(self, in_features: int, out_features: int, hidden: int, normalize: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        layers: list[nn.Module] = [nn.LayerNorm(in_features, elementwise_affine=False)] if normalize else []
        layers += [nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, out_features)]
        self.branch = nn.Sequential(*layers)
        self.reset_branch()

    def reset_branch(self, fresh: bool = False) -> None:
        """The branch's output layer at zero, so that the half is its identity path alone; with ``fresh``, its input
        layer drawn again as ``nn.Linear`` draws it (otherwise kept: a fitted start then needs no random draw)."""
        if fresh:
            self.branch[-3].reset_parameters()
        last = self.branch[-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight) + self.branch(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class CodeRows(nn.Linear):
    """A plain bottleneck's ``down``: its first ``width`` rows (all of them unless the code was narrowed)."""

    def __init__(self, features: int, rank: int) -> None:
        super().__init__(features, rank, bias=False)
        self.width = rank

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight[: self.width], None if self.bias is None else self.bias[: self.width])


class CodeColumns(nn.Linear):
    """A plain bottleneck's ``up``: as many of its first columns as the code it receives has values."""

    def __init__(self, rank: int, features: int) -> None:
        super().__init__(rank, features, bias=False)

    def forward(self, code: Tensor) -> Tensor:
        n = code.shape[-1]
        if n > self.in_features:
            raise ValueError(f"Bottleneck: the code has {n} values per position, more than the rank "
                             f"{self.in_features} the bottleneck was built with")
        return F.linear(code, self.weight[:, :n], self.bias)


class Bottleneck(nn.Module):
    """``up(down(x))`` with ``down: features -> rank`` and ``up: rank -> features``: both linear without bias, or
    with ``residual=True`` each its linear map plus a learned branch ``hidden`` wide that starts at zero output."""

    def __init__(self, features: int, rank: int, init: str = "projection", residual: bool = False,
                 hidden: int | None = None) -> None:
        super().__init__()
        for name, value in (("features", features), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Bottleneck: {name} must be a positive integer, got {value!r}")
        if rank >= features:
            raise ValueError(
                f"Bottleneck: rank {rank} must be smaller than features {features}; a bottleneck that is not "
                f"narrower than its input saves nothing on the wire (leave the model as it is instead)"
            )
        if init not in INITS:
            raise ValueError(f"Bottleneck: init must be one of {', '.join(map(repr, INITS))}, got {init!r}")
        if not isinstance(residual, bool):
            raise ValueError(f"Bottleneck: residual must be True or False, got {residual!r}")
        if hidden is not None and (not residual or isinstance(hidden, bool) or not isinstance(hidden, int)
                                   or hidden < 1):
            raise ValueError(f"Bottleneck: hidden (the width of the residual branches) must be a positive integer, "
                             f"and only with residual=True; got hidden={hidden!r}, residual={residual!r}")
        self.features, self.rank, self.init, self.residual = features, rank, init, residual
        self.hidden = (features if hidden is None else hidden) if residual else None
        if residual:
            assert self.hidden is not None
            self.down: nn.Module = LowRankHalf(features, rank, self.hidden, normalize=True)
            self.up: nn.Module = LowRankHalf(rank, features, self.hidden, normalize=False)
        else:
            self.down = CodeRows(features, rank)
            self.up = CodeColumns(rank, features)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.orthogonal_(self.down.weight)  # [rank, features] with orthonormal rows
            self.up.weight.copy_(self.down.weight.t())
            if self.init == "rescaled":
                gain = (self.features / self.rank) ** 0.25
                self.down.weight.mul_(gain)
                self.up.weight.mul_(gain)
        if self.residual:
            self.down.reset_branch(fresh=True)
            self.up.reset_branch(fresh=True)
        self.zero_unused_columns()

    @property
    def code_width(self) -> int:
        """How many values per position ``down`` computes and the cut carries: ``rank`` unless narrowed."""
        return self.down.width if isinstance(self.down, CodeRows) else self.rank

    def set_code_width(self, width: int) -> None:
        """Code ``width`` values per position (``1 <= width <= rank``); ``up``'s columns past it are set to zero."""
        if self.residual:
            raise ValueError("Bottleneck: a residual bottleneck's encoder always codes all of its rank; narrow the "
                             "code of a plain one (residual=False)")
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= self.rank:
            raise ValueError(f"Bottleneck({self.features}, {self.rank}): the code width must be an integer from 1 to "
                             f"the rank {self.rank}, got {width!r}")
        self.down.width = width
        self.zero_unused_columns()

    def zero_unused_columns(self) -> None:
        """``up``'s columns past the code width set to zero (none while the code is the full rank)."""
        if self.code_width < self.rank:
            with torch.no_grad():  # on the meta device the write is recorded, and replayed when the stage materializes
                self.up.weight[:, self.code_width:] = 0

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.features:
            raise ValueError(
                f"Bottleneck({self.features}, {self.rank}) got a tensor whose last dimension is {x.shape[-1]}; "
                f"build it with the width of the values it sits between"
            )
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        extra = f", residual=True, hidden={self.hidden}" if self.residual else ""
        extra += f", code_width={self.code_width}" if self.code_width < self.rank else ""
        return f"features={self.features}, rank={self.rank}, init={self.init!r}{extra}"


class BottleneckAfter(nn.Module):
    """``block`` followed by a :class:`Bottleneck` on what it returns (on the first element when it returns a tuple,
    as older Hugging Face blocks do), called with whatever arguments the model passes to the block."""

    def __init__(self, block: nn.Module, features: int, rank: int, init: str = "projection", residual: bool = False,
                 hidden: int | None = None) -> None:
        super().__init__()
        self.block, self.bottleneck = block, Bottleneck(features, rank, init, residual, hidden)

    def __getattr__(self, name: str):
        # what the model reads from its block (e.g. a layer's attention type) is read from the wrapped block
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self._modules.get("block")
            if block is None or name == "block":
                raise
            return getattr(block, name)

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.bottleneck(out[0]), *out[1:])
        return self.bottleneck(out)


def fit_bottlenecks(model: nn.Module, batches: Iterable[Any], run: Callable[[Any], Any] | None = None,
                    positions: Callable[[Any], Tensor] | None = None) -> dict[str, float]:
    """Start every :class:`Bottleneck` in ``model`` from the principal directions of the values that reach it.

    ``run(batch)`` runs the model's forward on one batch (default ``model(batch)``); it is called under
    ``torch.no_grad()`` with every module in eval mode (each one's mode is restored afterwards), once per bottleneck
    and batch, so ``batches`` must be iterable more than once (a list or a DataLoader). Each pass fits the first
    bottleneck the forward reaches among those not yet fitted, so every bottleneck is fitted to what it receives
    with the ones before it already fitted. ``down`` gets the top ``rank`` eigenvectors of the inputs' second-moment
    matrix (computed in float64; each one's sign chosen so that its largest-magnitude entry is positive) and ``up``
    its transpose, whatever ``init`` the bottleneck was built with (its ``init`` attribute is left as it was). The
    result depends only on the values that reach each bottleneck, not on its earlier weights: processes that compute
    bit-identical forwards on the same batches (same hardware, library and thread count) get the same weights. Where
    that is not certain, fit once and load the saved weights everywhere.

    ``positions(batch)``, if given, says which positions count: a bool tensor shaped like the leading dimensions of
    what reaches each bottleneck (for a ``[batch, seq, features]`` input, ``[batch, seq]``). With a padded text batch,
    ``positions=lambda batch: batch["attention_mask"].bool()`` fits the real tokens only, so no direction is spent on
    the padding, which a masked attention never reads. Kept fractions are then those of the counted positions. The
    mask serves every bottleneck, so each must see those leading dimensions; one that does not is refused in the
    first pass, before any bottleneck changes.

    A bottleneck must be called once per forward, and bottlenecks must not share their ``down`` or ``up``: both are
    refused, since the values reaching such a bottleneck would depend on its own weights.

    Returns, by module name, the fraction of its inputs' energy (summed squares) that each bottleneck keeps.
    """
    bottlenecks_of(model, "fit_bottlenecks")
    check_reusable(batches, "fit_bottlenecks")
    return fit_combined(model, batches, model if run is None else run, positions)


def fit_combined(model: nn.Module, batches: Iterable[Any], run: Callable[[Any], Any],
                 positions: Callable[[Any], Tensor] | None,
                 combine: Callable[[GramRecorder], None] | None = None) -> dict[str, float]:
    """:func:`fit_bottlenecks`, with ``combine(recorder)`` called after each pass, before the directions are taken
    (data parallelism: it adds up the processes' sums, so every process takes the same directions)."""
    found = bottlenecks_of(model, "fit_bottlenecks")
    kept: dict[str, float] = {}
    with eval_flags(model):
        while len(kept) < len(found):
            name, bottleneck, gram = _second_moments(found, kept, batches, run, positions, combine)
            top, kept[name] = principal_directions(gram, bottleneck.rank)
            set_directions(bottleneck, top)
    return kept


@contextmanager
def eval_flags(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode inside the block, each one's own flag put back afterwards (a pretrained
    submodule may stay in eval mode inside a training model). Flags are set, not train()/eval() called: some models
    override those (Hugging Face's switch kernels there)."""
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def bottlenecks_of(model: nn.Module, who: str) -> dict[str, Bottleneck]:
    """Every :class:`Bottleneck` of ``model`` by name; refused: none, or two that share a weight."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, Bottleneck)}
    if not found:
        raise ValueError(f"{who}: the model holds no Bottleneck (insert one with Bottleneck or BottleneckAfter first)")
    owners: dict[int, str] = {}
    for name, bottleneck in found.items():
        for half in (bottleneck.down, bottleneck.up):
            other = owners.setdefault(id(half.weight), name)
            if other != name:
                raise ValueError(f"{who}: {other} and {name} share a weight; fitting one would change the other, so "
                                 f"give each cut a Bottleneck of its own")
    return found


def check_reusable(batches: Iterable[Any], who: str) -> None:
    if isinstance(batches, Iterator):
        raise ValueError(f"{who}: batches are run once per bottleneck, so pass something that can be iterated more "
                         f"than once (a list or a DataLoader), not an iterator or generator")


def principal_directions(gram: Tensor, rank: int) -> tuple[Tensor, float]:
    """The top ``rank`` eigenvectors of a second-moment matrix as columns (each one's largest-magnitude entry made
    positive), and the fraction of the energy they keep."""
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = vectors[:, -rank:].flip(1)
    signs = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))
    top = top * torch.where(signs == 0, 1.0, signs)
    total = float(values.sum())
    return top, (float(values[-rank:].sum()) / total if total > 0 else 1.0)


def set_directions(bottleneck: Bottleneck, top: Tensor) -> None:
    """``down`` = ``top``'s transpose, ``up`` = ``top`` (a residual bottleneck's identity path, its branches started
    at zero output again); a half on the meta device (another stage's) is left alone."""
    with torch.no_grad():
        for half, value in ((bottleneck.down, top.t()), (bottleneck.up, top)):
            if not half.weight.is_meta:
                half.weight.copy_(value)
                if isinstance(half, LowRankHalf):
                    half.reset_branch()
    bottleneck.zero_unused_columns()  # a narrowed code: up's unused columns stay at zero


def _second_moments(found: dict[str, Bottleneck], done: dict[str, float], batches: Iterable[Any],
                    run: Callable[[Any], Any], positions: Callable[[Any], Tensor] | None,
                    combine: Callable[[GramRecorder], None] | None = None) -> tuple[str, Bottleneck, Tensor]:
    """One pass over ``batches``: the first bottleneck not in ``done`` that the forward reaches, and the float64
    second-moment matrix ``x^T x`` of everything it received (at the counted ``positions``)."""
    with GramRecorder("fit_bottlenecks", {n: m for n, m in found.items() if n not in done}) as recorder:
        with torch.no_grad():
            for batch in batches:
                recorder.start_forward(None if positions is None else positions(batch))
                run(batch)
    if combine is not None:
        combine(recorder)
    name, gram = recorder.result()
    return name, found[name], gram


class FitRefused(ValueError):
    """What a bottleneck cannot be fitted from: ``code`` 1 never reached, 2 no position counted, 3 NaN or inf."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class GramRecorder:
    """Forward pre-hooks on the ``down`` half of each of ``pending`` (by name): per forward (:meth:`start_forward`
    before each), every one is checked (called once, the mask fits its input), and, with ``record``, the first one
    reached adds its input's float64 second moments ``x^T x`` (at the counted positions) to :attr:`gram`. Only halves
    that hold weights are hooked (on a pipeline stage, those of its own stage). A context manager: the hooks go at its
    end."""

    def __init__(self, who: str, pending: dict[str, Bottleneck], record: bool = True) -> None:
        self.who, self.record, self.first, self.gram, self.rows = who, record, None, None, 0
        self._calls: dict[str, int] = {}
        self._mask: Tensor | None = None
        self._handles = [m.down.register_forward_pre_hook(self._hook(n), with_kwargs=True)
                         for n, m in pending.items() if not m.down.weight.is_meta]
        self._pending = pending

    def __enter__(self) -> GramRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def start_forward(self, mask: Tensor | None) -> None:
        self._calls.clear()
        self._mask = mask

    def _hook(self, name: str):
        def record(module: nn.Linear, args: tuple, kwargs: dict) -> None:
            self._calls[name] = self._calls.get(name, 0) + 1
            if self._calls[name] > 1:
                raise ValueError(f"{self.who}: {name} is called more than once per forward; the values reaching it "
                                 f"then depend on its own weights, so it has no start of its own to fit")
            if self.first is None:
                self.first = name
            x = (args[0] if args else kwargs["input"]).detach()
            # every bottleneck still to fit checks the mask in the first pass, before any weight is written
            mask = None if self._mask is None else positions_for(self.who, name, x, self._mask)
            if self.first != name or not self.record:
                return
            x = (x if mask is None else x[mask]).reshape(-1, module.in_features)
            x = x.to("cpu" if x.device.type == "mps" else x.device, torch.float64)  # MPS has no float64
            if self.gram is None:
                self.gram = torch.zeros(module.in_features, module.in_features, dtype=torch.float64, device=x.device)
            self.gram.addmm_(x.t(), x)
            self.rows += x.shape[0]
        return record

    def result(self) -> tuple[str, Tensor]:
        """The first bottleneck reached and its second moments; refused: none reached, no position counted, NaN."""
        if self.first is None:
            missing = ", ".join(self._pending)
            raise FitRefused(f"{self.who}: the forward never reached {missing} on these batches; check that `run` "
                             f"calls the model's forward and that batches is not empty", 1)
        if self.rows == 0:
            raise FitRefused(f"{self.who}: no position reaching {self.first} counted on these batches "
                             f"(positions(batch) was False everywhere); pass batches with real tokens, or check the "
                             f"mask", 2)
        assert self.gram is not None
        if not bool(torch.isfinite(self.gram).all()):
            raise FitRefused(f"{self.who}: the values reaching {self.first} hold NaN or inf on these batches, so there "
                             f"are no principal directions to start it from; check the model's forward on them (its "
                             f"weights, the data) before fitting", 3)
        return self.first, self.gram


def positions_for(who: str, name: str, x: Tensor, mask: Tensor) -> Tensor:
    """``mask`` checked against the input ``x`` of bottleneck ``name``, on ``x``'s device."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:-1]):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{who}: positions(batch) must be a bool tensor shaped like the leading dimensions "
                         f"of what reaches {name}, {tuple(x.shape[:-1])}, got {got} (for a padded text batch: "
                         f"batch['attention_mask'].bool())")
    return mask.to(x.device)
