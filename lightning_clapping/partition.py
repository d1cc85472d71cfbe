"""Cutting a LightningModule into pipeline stages by module name.

A *cut point* is the fully qualified name of a submodule: the call of that module starts a new stage, and what the
forward passes to it (its positional and keyword tensors) is what crosses the boundary. Stages follow the order in
which modules are registered, which for ordinary models is the order in which ``forward`` calls them; the stage
runner checks that at run time and says so when it is not the case.

The module tree is then divided into

* *units*: the largest submodules that lie entirely inside one stage; each unit's parameters and buffers live on the
  rank of its stage only, and
* *spanning* modules: containers (the LightningModule itself, a ``ModuleList``, an encoder whose layers are split)
  whose own Python code runs on every stage and whose children belong to several stages.

Without cut points the partition is chosen automatically: the candidates are the elements of the model's block lists
(``nn.Sequential`` / ``nn.ModuleList``), and the cuts minimise the largest stage's parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

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
        if any(_is_descendant(name, c) for c in covered):
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


def balance(model: nn.Module, num_stages: int) -> list[str]:
    """Choose ``num_stages - 1`` cut points among :func:`block_candidates` minimising the largest stage."""
    names = [n for n, _ in _modules_in_order(model)]
    candidates = block_candidates(model)
    if num_stages - 1 > len(candidates):
        raise PartitionError(
            f"cannot cut the model into {num_stages} stages: it has only {len(candidates)} cuttable blocks "
            f"({', '.join(candidates[:12])}{', ...' if len(candidates) > 12 else ''}). Use fewer devices, or pass "
            "`split_points=[...]` naming finer modules."
        )
    if num_stages == 1:
        return []
    index = {n: i for i, n in enumerate(names)}
    positions = [index[c] for c in candidates]
    sizes = _param_position_sizes(model, names)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def seg(a: int, b: int) -> int:  # params with pre-order index in [a, b)
        return prefix[b] - prefix[a]

    n, k = len(positions), num_stages - 1
    bounds = [0] + positions + [len(names)]  # bounds[i+1] is candidate i's position
    inf = float("inf")
    # best[j][i]: minimal max stage size using j cuts, the last one at candidate i
    best = [[inf] * n for _ in range(k + 1)]
    back = [[-1] * n for _ in range(k + 1)]
    for i in range(n):
        best[1][i] = seg(0, bounds[i + 1])
    for j in range(2, k + 1):
        for i in range(j - 1, n):
            for h in range(j - 2, i):
                v = max(best[j - 1][h], seg(bounds[h + 1], bounds[i + 1]))
                if v < best[j][i]:
                    best[j][i], back[j][i] = v, h
    final = [(max(best[k][i], seg(bounds[i + 1], len(names))), i) for i in range(k - 1, n)]
    _, last = min(final)
    chosen = [last]
    for j in range(k, 1, -1):
        chosen.append(back[j][chosen[-1]])
    return [candidates[i] for i in reversed(chosen)]


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
    unit_stage: dict[str, int] = {}
    stateful: set[str] = set()
    for i, name in enumerate(names):
        if i in span_set:
            continue
        parent = name.rpartition(".")[0] if "." in name else ""
        if name == "" or index.get(parent) in span_set:
            unit_stage[name] = stage_at(i)
            m = modules[name]
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                stateful.add(name)

    # state tensors: a unit's own, or a spanning module's direct buffers (replicated everywhere)
    state_stage: dict[str, int | None] = {}
    owner_of_tensor: dict[int, tuple[str, int]] = {}
    stage_params = [0] * num_stages
    for i in spanning:
        mod_name, module = names[i], modules[names[i]]
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            raise PartitionError(
                f"parameter {full!r} sits directly on {mod_name or type(model).__name__!r}, whose forward runs on "
                f"several stages, so no single stage can own it. Move it into a submodule (for example an "
                f"nn.Embedding or a small nn.Module holding the parameter) or choose cut points outside that module."
            )
        for bname, _ in module.named_buffers(recurse=False):
            state_stage[f"{mod_name}.{bname}" if mod_name else bname] = None
    for unit, stage in unit_stage.items():
        module = modules[unit]
        for pname, p in module.named_parameters(remove_duplicate=False):
            key = f"{unit}.{pname}" if unit else pname
            prev = owner_of_tensor.get(id(p))
            if prev is not None and prev[1] != stage:
                raise PartitionError(
                    f"parameter {key!r} (stage {stage}) is the same tensor as {prev[0]!r} (stage {prev[1]}): tied "
                    "weights cannot be split across stages. Put both modules in one stage with `split_points`."
                )
            if prev is None:
                stage_params[stage] += p.numel()
            owner_of_tensor[id(p)] = (key, stage)
            state_stage[key] = stage
        for bname, _ in module.named_buffers(remove_duplicate=False):
            state_stage[f"{unit}.{bname}" if unit else bname] = stage
    # keep only keys that state_dict() actually produces (non-persistent buffers are not saved)
    saved = set(model.state_dict().keys())
    state_stage = {k: v for k, v in state_stage.items() if k in saved}
    return Partition(
        num_stages=num_stages,
        cut_points=tuple(cuts),
        unit_stage=unit_stage,
        stateful_units=frozenset(stateful),
        state_stage=state_stage,
        stage_params=tuple(stage_params),
        spanning=tuple(names[i] for i in spanning),
    )


def count_stage_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that are really materialized (not on the meta device)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            total += t.numel() * t.element_size()
    return total


__all__ = ["Partition", "PartitionError", "balance", "block_candidates", "build_partition", "count_stage_bytes"]
