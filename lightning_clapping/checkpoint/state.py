"""Saving and loading a partitioned model: one full file, or one shard per stage.

Each rank holds only its own stage's tensors. Two layouts, as ``FSDPStrategy`` has them:

* ``"full"``: the tensors are gathered to global rank 0 (tensor by tensor over point-to-point messages; only a
  small description of their names and shapes is pickled), which writes one ordinary Lightning checkpoint. Its
  ``state_dict`` uses the model's own parameter names and loads with ``MyModule.load_from_checkpoint(path)`` in a
  single process without this package. Rank 0 needs memory for the whole model while it saves.
* ``"sharded"``: every rank writes its own tensors, in parallel, with ``torch.distributed.checkpoint`` into a
  folder laid out like Lightning's FSDP sharded checkpoints: the model under ``"model"``, optimizers under
  ``"optimizer_0"``, ``"optimizer_1"``, ... keyed by parameter name, the error-feedback buffers under
  ``"clapping_feedback"``, and ``meta.pt`` with the rest (loops, callbacks, schedulers, the lazy sampler). Lightning's
  ``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER`` turns it into one full file. On loading,
  each rank reads only its own tensors, by name, so a checkpoint resumes on any number of stages.

Every rank builds its optimizer over *all* of the module's parameters (other stages' parameters sit on the meta
device and never get a gradient, so optimizers skip them). Optimizer state is therefore indexed by the same global
parameter positions on every rank; ``"full"`` files keep those positions (as a single-process run writes them),
sharded folders use parameter names.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_clapping.comm import safe_objects
from lightning_clapping._compat import EmptyStateDictLoadPlanner, dcp_load_state_dict, tree_flatten, tree_unflatten

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
STATE_DICT_TYPES = ("full", "sharded")


def is_sharded_checkpoint(path: Any) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file()


# ---------------------------------------------------------------------------------------------------------- gather
def gather_to_zero(local: Any, device: torch.device, group: Any = None) -> list[Any] | None:
    """Every rank's ``local`` object on the lowest rank of ``group`` (default: all ranks) in rank order, tensors on
    the CPU; ``None`` on the other ranks.

    The structure (names, shapes, dtypes, plain values) travels as JSON (:mod:`~lightning_clapping.comm.safe_objects`,
    never pickled); each tensor travels as itself.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [_to_cpu(local)]
    blobs, tensors = safe_objects.all_gather_outlines(local, group, device)
    ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
    rank, dst = dist.get_rank(), ranks[0]
    if rank != dst:
        works = [dist.isend(t.detach().to(device).contiguous(), dst=dst, group=group, tag=i)
                 for i, t in enumerate(tensors)]
        for w in works:
            w.wait()
        return None
    parts: list[Any] = [_to_cpu(local)]
    for src in ranks[1:]:
        outline, specs = safe_objects.outline(blobs[dist.get_group_rank(group or dist.group.WORLD, src)])
        received = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
        works = [dist.irecv(buf, src=src, group=group, tag=i) for i, buf in enumerate(received)]
        for w in works:
            w.wait()
        parts.append(safe_objects.fill(outline, [x.cpu() for x in received]))
    return parts


def _to_cpu(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([x.detach().cpu() if isinstance(x, Tensor) else x for x in leaves], spec)


def merge_model_states(parts: list[dict[str, Tensor]], order: list[str],
                       tied: list[tuple[str, ...]] | None = None) -> dict[str, Tensor]:
    """The stages' parts as one state dict in ``order`` (the model's own). ``tied``: groups of keys of one tensor
    held by several stages (identical copies); each group's keys then name one tensor, saved once, as one process
    saves a tied tensor."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"no stage holds {len(missing)} state entries, e.g. {missing[:5]}")
    for keys in tied or ():
        present = [k for k in keys if k in merged]
        for k in present[1:]:
            merged[k] = merged[present[0]]
    return {k: merged[k] for k in order}


# ------------------------------------------------------------------------------------------------ optimizer state
def param_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The qualified name of each of the optimizer's parameters, in its ``state_dict`` positions."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not part of the LightningModule")
            names.append(name_of[id(p)])
    return names


def owned_indices(optimizer: Optimizer) -> set[int]:
    """Positions (as in ``optimizer.state_dict()``) of the parameters materialized on this rank."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i for i, p in enumerate(params) if not p.is_meta}


def local_optimizer_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (by position) restricted to the parameters this rank holds."""
    keep = owned_indices(optimizer)
    local = dict(state_dict)
    local["state"] = {k: v for k, v in state_dict.get("state", {}).items() if int(k) in keep}
    return local


def merge_optimizer_states(parts: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The stages' optimizer states, each keyed by parameter name (:func:`state_by_name`; a stage holds the state of
    its own parameters), as one state dict by position in ``names`` (this rank's optimizer's parameter names), with
    the first part's param groups. Merged by name: the stages need not list the parameters at the same positions (a
    stage that holds no copy of a tied tensor may list it once, the stages holding copies list every copy)."""
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part.get("state", {}))
    merged = state_by_position({**parts[0], "state": state}, names)
    return {**merged, "state": dict(sorted(merged["state"].items()))}


def state_by_name(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by position, re-keyed by parameter name (the sharded layout)."""
    return {
        "state": {names[int(i)]: v for i, v in state_dict.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


def state_by_position(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`state_by_name`; a state dict already keyed by position is returned as it is."""
    groups = state_dict.get("param_groups", [])
    if not any(isinstance(p, str) for g in groups for p in g["params"]):
        return state_dict
    index = {n: i for i, n in enumerate(names)}
    unknown = [p for g in groups for p in g["params"] if p not in index]
    if unknown:
        raise KeyError(f"the checkpoint's optimizer holds parameters the model does not have, e.g. {unknown[:3]}")
    return {
        "state": {index[n]: v for n, v in state_dict.get("state", {}).items() if n in index},
        "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in groups],
    }


def state_for_layout(state_dict: dict[str, Any], optimizer: Optimizer, names: list[str],
                     alias: dict[str, str]) -> dict[str, Any]:
    """A state dict keyed by parameter name (a sharded checkpoint's) laid out for ``optimizer`` (``names``: its
    parameters' names, by position), whatever cut wrote it. The copies of a tied tensor are one parameter
    (``alias``: each other name -> its first name): a stage that holds two copies gets the state of either for both,
    one process that holds the tensor once gets it once. Group settings come from the checkpoint, group by group."""
    groups = state_dict.get("param_groups", [])
    if not any(isinstance(p, str) for g in groups for p in g["params"]):
        return state_dict
    own = optimizer.param_groups
    if len(groups) != len(own):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one {len(own)}")
    mine = {alias.get(n, n) for n in names}
    unknown = [p for g in groups for p in g["params"] if alias.get(p, p) not in mine]
    if unknown:
        raise KeyError(f"the checkpoint's optimizer holds parameters the model does not have, e.g. {unknown[:3]}")
    saved = {alias.get(n, n): v for n, v in state_dict.get("state", {}).items()}
    held = owned_indices(optimizer)  # a released copy (meta) keeps no state
    out_groups, state, pos = [], {}, 0
    for g_saved, g in zip(groups, own):
        positions = list(range(pos, pos + len(g["params"])))
        pos += len(g["params"])
        out_groups.append({**{k: v for k, v in g_saved.items() if k != "params"}, "params": positions})
        for i in positions:
            if i in held and alias.get(names[i], names[i]) in saved:
                state[i] = saved[alias.get(names[i], names[i])]
    return {"state": state, "param_groups": out_groups}


def one_process_positions(state_dict: dict[str, Any], names: list[str], alias: dict[str, str]) -> dict[str, Any]:
    """A stage optimizer's state dict (by position) in the layout one process has: without the positions of the
    parameters named in ``alias`` (the other names of a tied tensor: a stage may list its copies apart, one process
    lists the tensor once, under its first name). The copies' states are equal, so nothing is lost."""
    keep = [i for i, n in enumerate(names) if n not in alias]
    if len(keep) == len(names):
        return state_dict
    new = {old: j for j, old in enumerate(keep)}
    return {**state_dict,
            "state": {new[int(i)]: v for i, v in state_dict.get("state", {}).items() if int(i) in new},
            "param_groups": [{**g, "params": [new[int(i)] for i in g["params"] if int(i) in new]}
                             for g in state_dict["param_groups"]]}


def stage_positions(state_dict: dict[str, Any], names: list[str], alias: dict[str, str],
                    optimizer: Optimizer) -> dict[str, Any]:
    """The inverse of :func:`one_process_positions` for this stage's ``optimizer`` (``names``: its parameters' names):
    a state dict in the one-process layout gets a position for every copy, with the state of the name one process
    keeps. A state dict that has this stage's layout already is returned as it is."""
    kept = [n for n in names if n not in alias]
    count = sum(len(g["params"]) for g in state_dict.get("param_groups", []))
    if len(kept) == len(names) or count != len(kept):
        return state_dict
    source = {n: j for j, n in enumerate(kept)}
    saved = state_dict.get("state", {})
    state = {}
    for i, n in enumerate(names):
        j = source[alias.get(n, n)]
        if j in saved:
            state[i] = saved[j]
    groups, first = [], 0
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
        groups.append({**saved_group, "params": list(range(first, first + len(group["params"])))})
        first += len(group["params"])
    return {**state_dict, "state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------------ sharded folders
def save_sharded(path: Path, tensors: dict[str, Any], meta: dict[str, Any] | None, device: torch.device) -> None:
    """Collective: every rank writes its ``tensors`` (nested dicts); ``meta`` (global rank 0's) goes to ``meta.pt``.

    Everything is written into a hidden sibling folder first (``.<name>.saving``), which rank 0 renames into place
    once every rank has written (``dcp.save`` returns on rank 0 only then) and ``meta.pt`` is in it. So whatever was
    at ``path`` (a full checkpoint file, an older sharded folder) stays intact until the new folder is complete; an
    interrupted save leaves only the sibling, which the next save removes."""
    staging = claim_path(path, sharded=True, device=device)
    staging.mkdir(parents=True, exist_ok=True)
    dcp.save(tensors, checkpoint_id=staging)
    if meta is not None:
        torch.save(meta, staging / META_FILE)
        _put_in_place(staging, path)


def claim_path(path: Path, sharded: bool, device: torch.device) -> Path:
    """Collective over every rank, before a checkpoint is written at ``path``; returns the folder to write a
    sharded one into (see :func:`save_sharded`).

    Global rank 0 looks at what is there and prepares it; the others learn its verdict from one broadcast, which
    also orders rank 0's removals before anyone writes. A file, a link or a checkpoint folder (``meta.pt`` or
    ``torch.distributed.checkpoint`` metadata in it) is replaced: a full save removes a sharded folder (the file
    is then written as Lightning writes it), a sharded save renames it away only once the new one is complete. A
    folder holding anything else is refused on every rank, before any tensor is written."""
    staging = _sibling(path, "saving")
    refused = 0
    if not dist.is_initialized() or dist.get_rank() == 0:
        is_dir = path.is_dir() and not path.is_symlink()
        refused = int(is_dir and not is_sharded_checkpoint(path) and not (path / ".metadata").is_file()
                      and any(path.iterdir()))
        if not refused:
            _remove(staging)
            _remove(_sibling(path, "replaced"))
            if is_dir and not sharded:
                _remove(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = torch.tensor([refused], dtype=torch.int64, device=device)
        dist.broadcast(verdict, src=0)
        refused = int(verdict.item())
    if refused:
        raise FileExistsError(
            f"cannot save a checkpoint at {str(path)!r}: a folder that is not a checkpoint is there (a checkpoint "
            "file or a sharded checkpoint folder would be replaced). Remove it, or save to another path."
        )
    return staging


def _sibling(path: Path, what: str) -> Path:
    """The hidden sibling of ``path`` a save uses (its name never matches ``last*.ckpt``, which resuming looks for)."""
    return path.with_name(f".{path.name}.{what}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _put_in_place(new: Path, path: Path) -> None:
    """Rename ``new`` to ``path``; what was there is renamed away first and deleted after (a folder cannot be
    renamed onto a file or onto a folder that is not empty)."""
    aside = _sibling(path, "replaced")
    if os.path.lexists(path):
        _remove(aside)
        os.replace(path, aside)
    os.replace(new, path)
    _remove(aside)


def saved_model_keys(path: Path) -> set[str]:
    """The parameter and buffer names a sharded checkpoint holds (read from its metadata, no tensor loaded)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {p[1] for p in (metadata.planner_data or {}).values() if len(p) == 2 and p[0] == "model"}


def load_sharded_model(path: Path, own: dict[str, Tensor]) -> None:
    """Collective: read this rank's tensors (``own``: name -> the module's tensor) in place."""
    dcp.load({"model": own}, checkpoint_id=path)


def load_sharded_entries(path: Path, prefixes: list[str]) -> dict[str, Any]:
    """Read the entries under the given dotted prefixes (e.g. ``optimizer_0.state.net.0.weight``), on this rank
    alone. (The public ``dcp.load`` fills only keys its argument already has; these entries need no template.)"""
    out: dict[str, Any] = {}
    dcp_load_state_dict(out, storage_reader=dcp.FileSystemReader(str(path)),
                        planner=EmptyStateDictLoadPlanner(keys=set(prefixes)), no_dist=True)
    return out


def retie(module: nn.Module, alias: dict[str, str]) -> None:
    """Tie again what the stages held as separate copies: every name in ``alias`` (name -> the first name of its
    tensor) gets the parameter of its first name, as in the model before it was cut. For a module that received the
    whole model's state (``load_state_dict(..., assign=True)`` gives each name a parameter of its own)."""
    for key, first in alias.items():
        owner, _, name = key.rpartition(".")
        setattr(module.get_submodule(owner), name, module.get_parameter(first))


def whole_hparams_modules(checkpoint: dict[str, Any], module: nn.Module, alias: dict[str, str] | None = None) -> None:
    """Saved hyperparameters that hold one of the model's modules (``__init__(self, net: nn.Module)`` with
    ``save_hyperparameters()``) get a copy of it holding the gathered weights, as a single process saves them:
    ``load_from_checkpoint`` rebuilds the model from them. (The live module keeps only this rank's stage.)
    ``alias``: the tied names (see :func:`retie`), tied again in the copy."""
    hparams = checkpoint.get("hyper_parameters")
    state = checkpoint.get("state_dict")
    if not isinstance(hparams, dict) or not state:
        return
    names = {id(m): n for n, m in module.named_modules()}
    for key, value in list(hparams.items()):
        if isinstance(value, nn.Module) and id(value) in names:
            prefix = f"{names[id(value)]}." if names[id(value)] else ""
            whole = copy.deepcopy(value)
            whole.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                                  strict=False, assign=True)
            retie(whole, {k[len(prefix):]: v[len(prefix):] for k, v in (alias or {}).items()
                          if k.startswith(prefix) and v.startswith(prefix)})
            hparams[key] = whole


def check_model_keys(saved: set[str], expected: list[str], where: Path) -> None:
    missing = [k for k in expected if k not in saved]
    unexpected = sorted(saved - set(expected))
    if missing or unexpected:
        raise KeyError(
            f"the sharded checkpoint {str(where)!r} does not match the model: missing {len(missing)} keys "
            f"(first: {missing[:3]}), unexpected {len(unexpected)} keys (first: {unexpected[:3]}). Was it saved from "
            "another model, or did parameter names change? Set `self.strict_loading = False` in the LightningModule "
            "to load the entries that match."
        )


__all__ = [
    "META_FILE",
    "STATE_DICT_TYPES",
    "check_model_keys",
    "claim_path",
    "gather_to_zero",
    "is_sharded_checkpoint",
    "load_sharded_entries",
    "load_sharded_model",
    "local_optimizer_state",
    "merge_model_states",
    "merge_optimizer_states",
    "one_process_positions",
    "retie",
    "owned_indices",
    "param_names",
    "save_sharded",
    "saved_model_keys",
    "stage_positions",
    "state_by_name",
    "state_by_position",
    "state_for_layout",
    "whole_hparams_modules",
]
