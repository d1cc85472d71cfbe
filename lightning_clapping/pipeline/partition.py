"""Cutting a LightningModule into pipeline stages by module name.

A *cut point* is the fully qualified name of a submodule: the call of that module starts a new stage, and what the
forward passes to it (its positional and keyword tensors) crosses the boundary, with the values computed before the
cut that later code uses (see :mod:`lightning_clapping.pipeline.crossings`). Modules holding parameters follow the
order in which they are registered, which for ordinary models is the order in which ``forward`` calls them; the stage
runner checks that at run time and says so when it is not the case. Modules without parameters or persistent buffers
(rotary embeddings, mask builders, activations) belong to no stage: they run wherever the forward calls them.

The module tree is then divided into

* *units*: the largest submodules that lie entirely inside one stage; each unit's parameters and buffers live on the
  rank of its stage only, and
* *spanning* modules: containers (the LightningModule itself, a ``ModuleList``, an encoder whose layers are split)
  whose own Python code runs on every stage and whose children belong to several stages.

Without cut points the partition is chosen automatically: the candidates are the elements of the model's block lists
(``nn.Sequential`` / ``nn.ModuleList``), and the cuts give every stage parameters, minimise the largest stage's
parameter count and then the size of what crosses the boundaries (see :func:`balance`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from lightning_clapping.comm.ties import TiedGroup  # defined below the pipeline (comm/ imports no pipeline/)
from lightning_clapping.pipeline.bottleneck import Bottleneck

_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class PartitionError(ValueError):
    """The model cannot be cut as asked; the message says why and what to change."""


@dataclass(frozen=True)
class Partition:
    """Which stage owns which part of a model. Built by :func:`build_partition`."""

    num_stages: int
    cut_points: tuple[str, ...]
    #: unit name -> stage index, in registration order
    unit_stage: dict[str, int]
    #: unit names that hold parameters or buffers (the others are stateless functions such as activations)
    stateful_units: frozenset[str]
    #: state-dict key -> stage index; keys of spanning modules' own buffers are replicated (stage None)
    state_stage: dict[str, int | None]
    #: parameter count per stage
    stage_params: tuple[int, ...]
    spanning: tuple[str, ...] = field(default=())
    #: parameters registered directly on a module whose forward spans stages (``self.pos = nn.Parameter(...)`` on the
    #: LightningModule): every stage holds them; the one stage that uses them owns them (see :meth:`settle_owner`)
    shared_params: tuple[str, ...] = field(default=())
    #: tensors shared by units of several stages; each of those stages holds a copy (see :class:`TiedGroup`)
    tied: tuple[TiedGroup, ...] = field(default=())
    #: every other name of a parameter registered under several names (tied, across stages or within one) -> its
    #: first name, the one ``named_parameters()`` of the whole model lists
    aliases: dict[str, str] = field(default_factory=dict)
    #: modules without parameters or persistent buffers (rotary embeddings, mask builders, activations) that would
    #: otherwise be units: they belong to no stage and run where the forward calls them, on every stage
    free: tuple[str, ...] = field(default=())

    def settle_owner(self, key: str, users: list[int]) -> None:
        """Give the shared parameter ``key`` to the one stage that uses it (``users``: the stages that did)."""
        if len(users) > 1:
            raise PartitionError(
                f"parameter {key!r} sits directly on a module whose forward runs on several stages, and stages "
                f"{' and '.join(map(str, users))} both use it, so each would train its own copy. Move its uses into "
                "one stage with `split_points`, or move the parameter into a submodule that one stage calls."
            )
        if users:
            self.state_stage[key] = users[0]

    def owned_state_keys(self, stage: int) -> set[str]:
        """State-dict keys whose tensors are materialized on ``stage`` (its own plus the replicated ones)."""
        return {k for k, s in self.state_stage.items() if s is None or s == stage}

    def units_of(self, stage: int) -> list[str]:
        return [u for u, s in self.unit_stage.items() if s == stage]

    def table(self) -> str:
        """A human-readable stage table (printed on rank 0 when training starts)."""
        total = max(1, sum(self.stage_params))
        lines = ["stage | first module                              | params      | share", "-" * 72]
        firsts = ("<start>",) + self.cut_points
        for s in range(self.num_stages):
            units = self.units_of(s)
            desc = firsts[s] if len(units) <= 1 else f"{firsts[s]} (+{len(units) - 1} more)"
            lines.append(f"{s:5d} | {desc:41.41s} | {self.stage_params[s]:11,d} | {self.stage_params[s] / total:5.1%}")
        return "\n".join(lines)


def _modules_in_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(model.named_modules())


def _subtree_end(names: list[str]) -> list[int]:
    """For each module in pre-order, the index of the last module of its subtree."""
    end = list(range(len(names)))
    stack: list[int] = []
    for i, name in enumerate(names):
        while stack and not _is_descendant(name, names[stack[-1]]):
            stack.pop()
        for j in stack:
            end[j] = i
        stack.append(i)
    return end


def _is_descendant(name: str, ancestor: str) -> bool:
    return ancestor == "" or name.startswith(ancestor + ".")


def block_candidates(model: nn.Module) -> list[str]:
    """Names of the modules where an automatic cut may go: the elements of the model's block lists.

    The outermost ``nn.Sequential`` / ``nn.ModuleList`` containers with at least two children contribute their
    children; lists nested inside those children are not expanded. A model without any block list falls back to
    the direct children of the root module.
    """
    candidates: list[str] = []
    covered: list[str] = []
    for name, module in model.named_modules():
        if any(name == c or _is_descendant(name, c) for c in covered):
            continue
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) >= 2 and name != "":
            kids = [f"{name}.{k}" for k, _ in module.named_children()]
            candidates.extend(kids)
            covered.extend(kids)
    if not candidates:
        candidates = [n for n, m in model.named_children() if not _is_metric(m)]
    return candidates


def _is_metric(module: nn.Module) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(module, Metric)


def _param_position_sizes(model: nn.Module, names: list[str]) -> list[int]:
    """Parameter count registered directly on each module (pre-order index)."""
    index = {n: i for i, n in enumerate(names)}
    sizes = [0] * len(names)
    for mod_name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            sizes[index[mod_name]] += p.numel()
    return sizes


def balance(model: nn.Module, num_stages: int, boundary_numel: dict[str, int] | None = None) -> list[str]:
    """Choose ``num_stages - 1`` cut points among :func:`block_candidates`.

    The partitions are ranked lexicographically:

    1. every stage holds parameters. A stage without any does no work, still costs a process and a pipeline slot,
       and its boundary carries the raw input. This is a hard constraint, not a preference: when no partition
       meets it (the parameters sit in fewer runs of blocks than there are stages) :class:`PartitionError` is
       raised rather than a warning, because an automatic choice should never produce a stage the user would not
       have chosen; explicit ``split_points`` are still taken as given. It never costs balance: whenever
       partitions without an empty stage exist, one of them has the smallest largest stage of *all* partitions
       (drop the cut that ends an empty stage, which merges it into its neighbour, and re-add it inside a stage
       holding two parameter-holding blocks: no stage grows);
    2. the largest stage's parameter count is minimal;
    3. the boundaries are small: ``boundary_numel`` maps a candidate name to the number of elements its cut would
       send (the tensors passed to that module); among the partitions left, the one sending the fewest elements in
       total is chosen. ``None`` (unknown) ranks by parameter counts alone; otherwise every candidate must be in
       the mapping.

    Ties left after that are broken deterministically, toward earlier cuts.
    """
    candidates = block_candidates(model)
    if num_stages - 1 > len(candidates):
        raise PartitionError(
            f"cannot cut the model into {num_stages} stages: it has only {len(candidates)} cuttable blocks "
            f"({', '.join(candidates[:12])}{', ...' if len(candidates) > 12 else ''}). Use fewer devices, or pass "
            "`split_points=[...]` naming finer modules."
        )
    if num_stages == 1:
        return []
    if boundary_numel is not None:
        missing = [c for c in candidates if c not in boundary_numel]
        if missing:
            raise PartitionError(f"boundary_numel has no entry for the cuttable blocks {missing}")
    names = [n for n, _ in _modules_in_order(model)]
    index = {n: i for i, n in enumerate(names)}
    sizes = _param_position_sizes(model, names)
    # The model in pre-order is a row of pieces: piece 0 is what precedes the first candidate, piece p >= 1 starts
    # at candidate p - 1 and runs to the next candidate. A stage is a run of pieces; cutting at candidate p - 1
    # makes piece p the first of a stage.
    bounds = [0] + [index[c] for c in candidates] + [len(names)]
    pieces = [sum(sizes[bounds[p]:bounds[p + 1]]) for p in range(len(bounds) - 1)]
    holding = [p for p, size in enumerate(pieces) if size > 0]
    if len(holding) < num_stages:
        firsts = ["<start>" if p == 0 else candidates[p - 1] for p in holding]
        raise PartitionError(
            f"cannot cut the model into {num_stages} stages that all hold parameters: its parameters sit in only "
            f"{len(holding)} runs of blocks (starting at {', '.join(firsts)}), so some stage would hold none and do "
            f"no work but pass its input on. Use at most {len(holding)} devices, or pass `split_points=[...]` "
            "naming finer modules."
        )
    prefix = [0]
    for size in pieces:
        prefix.append(prefix[-1] + size)

    def params(a: int, b: int) -> int:  # parameters of the stage made of pieces a .. b-1
        return prefix[b] - prefix[a]

    inf = float("inf")
    # (1) + (2): the smallest largest stage among partitions without an empty stage
    largest, _ = _best_cuts(len(pieces), num_stages, lambda a, b: params(a, b) or inf, max)

    # (3): among those with no stage above `largest`, the smallest total boundary (0 everywhere when unknown)
    def sent(a: int, b: int) -> float:
        if params(a, b) == 0 or params(a, b) > largest:
            return inf
        return 0 if a == 0 or boundary_numel is None else boundary_numel[candidates[a - 1]]

    _, starts = _best_cuts(len(pieces), num_stages, sent, lambda x, y: x + y)
    return [candidates[a - 1] for a in starts]


def _best_cuts(num_pieces: int, num_stages: int, score: Callable[[int, int], float],
               combine: Callable[[float, float], float]) -> tuple[float, list[int]]:
    """Split pieces ``0 .. num_pieces-1`` into ``num_stages`` non-empty runs minimising ``combine`` of the runs'
    ``score(a, b)`` (run = pieces a .. b-1; ``inf`` forbids a run). ``combine`` must be ``max`` or ``+`` over
    non-negative scores, so that 0 is its identity and the best split of a prefix extends to the best of the whole.
    Returns the optimum and the first piece of every run but the first; ties go to the earliest cuts."""
    inf = float("inf")
    # best[s][b]: optimum for splitting pieces 0 .. b-1 into s runs; start[s][b]: where the last of those runs starts
    best = [[inf] * (num_pieces + 1) for _ in range(num_stages + 1)]
    start = [[-1] * (num_pieces + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for b in range(s, num_pieces + 1):
            for a in range(s - 1, b):
                v = combine(best[s - 1][a], score(a, b))
                if v < best[s][b]:
                    best[s][b], start[s][b] = v, a
    if best[num_stages][num_pieces] == inf:  # pragma: no cover - balance() checks feasibility first
        raise PartitionError(f"no way to cut the model into {num_stages} stages under the constraints")
    starts, b = [], num_pieces
    for s in range(num_stages, 0, -1):
        b = start[s][b]
        starts.append(b)
    return best[num_stages][num_pieces], list(reversed(starts))[1:]


def build_partition(model: nn.Module, num_stages: int, split_points: list[str] | None = None) -> Partition:
    """Validate or choose the cut points and work out which stage owns each unit and each state tensor."""
    if num_stages < 1:
        raise PartitionError(f"the number of stages must be at least 1, got {num_stages}")
    ordered = _modules_in_order(model)
    names = [n for n, _ in ordered]
    modules = dict(ordered)
    if split_points is None:
        cuts = balance(model, num_stages)
    else:
        cuts = list(split_points)
        if len(cuts) != num_stages - 1:
            raise PartitionError(
                f"{len(cuts)} split points make {len(cuts) + 1} stages, but the Trainer has {num_stages} processes "
                f"(devices x num_nodes). Set devices={len(cuts) + 1} or give {num_stages - 1} split points."
            )
    index = {n: i for i, n in enumerate(names)}
    cuts = [f"{c}.up" if isinstance(modules.get(c), Bottleneck) else c for c in cuts]  # cut between its halves
    for c in cuts:
        if c not in index or c == "":
            near = [n for n in block_candidates(model)][:20]
            raise PartitionError(
                f"split point {c!r} is not a submodule of {type(model).__name__}. Cuttable blocks: {', '.join(near)}"
                f"{' ...' if len(near) == 20 else ''}. All module names: `[n for n, _ in model.named_modules()]`."
            )
        if isinstance(modules[c], _NEVER_CALLED):
            kids = [f"{c}.{k}" for k, _ in modules[c].named_children()][:8]
            raise PartitionError(
                f"split point {c!r} is a {type(modules[c]).__name__}, which forward never calls; name one of its "
                f"elements instead, e.g. {', '.join(kids)}"
            )
    positions = [index[c] for c in cuts]
    if positions != sorted(positions) or len(set(positions)) != len(positions):
        raise PartitionError(
            f"split points must be distinct and in the order the model registers (and calls) them; got {cuts}"
        )
    end = _subtree_end(names)
    for a, b in zip(cuts, cuts[1:]):
        if _is_descendant(b, a):
            raise PartitionError(f"split points must not be nested: {b!r} lies inside {a!r}")

    def stage_at(i: int) -> int:
        return sum(1 for p in positions if p <= i)

    spanning = [i for i in range(len(names)) if any(i < p <= end[i] for p in positions)]
    span_set = set(spanning)
    # the modules whose children are units: the spanning ones, and below them the module lists and dicts that lie in
    # one stage. Forward never calls a ModuleList, it calls its elements (`for blk in self.blocks: x = blk(x)`), so a
    # list cannot be a unit: the wrapper on its forward would never run, and its elements would run unwrapped on every
    # stage (on another stage, with their weights on the meta device)
    holders = set(span_set)
    unit_stage: dict[str, int] = {}
    stateful: set[str] = set()
    free: list[str] = []
    cut_set = set(cuts)
    for i, name in enumerate(names):
        if i in span_set:
            continue
        parent = name.rpartition(".")[0] if "." in name else ""
        if name == "" or index.get(parent) in holders:
            if name and isinstance(modules[name], (nn.ModuleList, nn.ModuleDict)):
                holders.add(i)
                continue
            if name and name not in cut_set and _is_free(modules[name]):
                free.append(name)  # called where the forward calls it, not where it is registered
                continue
            unit_stage[name] = stage_at(i)
            m = modules[name]
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                stateful.add(name)

    # state tensors: a unit's own, or a spanning module's direct buffers (replicated everywhere)
    state_stage: dict[str, int | None] = {}
    shared: list[str] = []
    stage_params = [0] * num_stages
    for i in spanning:
        mod_name, module = names[i], modules[names[i]]
        for pname, _ in module.named_parameters(recurse=False):
            # its forward runs on several stages: the owner is the one stage that uses it (found at the first step)
            key = f"{mod_name}.{pname}" if mod_name else pname
            state_stage[key] = None
            shared.append(key)
        for bname, _ in module.named_buffers(recurse=False):
            state_stage[f"{mod_name}.{bname}" if mod_name else bname] = None
    names_of_tensor: dict[int, list[tuple[str, int]]] = {}  # parameter -> its (key, stage)s, registration order
    for unit, stage in unit_stage.items():
        module = modules[unit]
        for pname, p in module.named_parameters(remove_duplicate=False):
            key = f"{unit}.{pname}" if unit else pname
            held = names_of_tensor.setdefault(id(p), [])
            if all(s != stage for _, s in held):  # a tied tensor costs every stage that holds a copy
                stage_params[stage] += p.numel()
            held.append((key, stage))
            state_stage[key] = stage
        for bname, _ in module.named_buffers(remove_duplicate=False):
            state_stage[f"{unit}.{bname}" if unit else bname] = stage
    # keep only keys that state_dict() actually produces (non-persistent buffers are not saved)
    saved = set(model.state_dict().keys())
    state_stage = {k: v for k, v in state_stage.items() if k in saved}
    tied = tuple(TiedGroup(tuple(k for k, _ in held), tuple(s for _, s in held))
                 for held in names_of_tensor.values() if len({s for _, s in held}) > 1)
    return Partition(
        num_stages=num_stages,
        cut_points=tuple(cuts),
        unit_stage=unit_stage,
        stateful_units=frozenset(stateful),
        state_stage=state_stage,
        stage_params=tuple(stage_params),
        spanning=tuple(names[i] for i in spanning),
        shared_params=tuple(k for k in shared if k in saved),
        tied=tied,
        aliases={k: held[0][0] for held in names_of_tensor.values() for k, _ in held[1:]},
        free=tuple(free),
    )


def _is_free(module: nn.Module) -> bool:
    """No parameters and nothing it saves: it can run on every stage (its non-persistent buffers, such as rotary
    tables, are recomputed or materialized everywhere), so it need not belong to the stage that registers it."""
    if _is_metric(module) or any(True for _ in module.parameters()):
        return False
    saved = module.state_dict()
    return not saved


def count_stage_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that are really materialized (not on the meta device)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            total += t.numel() * t.element_size()
    return total


__all__ = ["Partition", "PartitionError", "TiedGroup", "balance", "block_candidates", "build_partition",
           "count_stage_bytes"]
