"""Pretrained weights, read per stage from a safetensors checkpoint.

A stage reads only the tensors it holds: it opens only the files that hold them and reads them one at a time
(safetensors maps the file) straight into the tensors it has just materialized, so no process ever holds the whole
model, and a 7B fine-tune needs no more memory on a stage than the stage itself.

A checkpoint is a ``.safetensors`` file, or a folder holding ``model.safetensors`` or a sharded checkpoint with its
``model.safetensors.index.json`` (whose ``weight_map`` names the file of every tensor), as Hugging Face writes them.
Its keys are the names of the module it is loaded into (for the strategy's ``pretrained={"model": path}``, those of
the LightningModule's ``model`` submodule). A Hugging Face model's ``base_model_prefix`` is added or dropped as
``from_pretrained`` does, whichever matches more keys: a ``BertForMaskedLM`` checkpoint (``bert.encoder...``) loads
into a ``BertModel`` (``encoder...``) and a ``BertModel`` checkpoint into a model with a head.

Tensors the checkpoint lacks keep their initialisation and are reported as missing; checkpoint tensors that name
nothing in the module are reported as unexpected; non-persistent buffers (``position_ids``) are never read, as
``from_pretrained`` does not read them. A shape that differs is an error.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class PretrainedError(ValueError):
    """A pretrained checkpoint cannot be found or read; the message says which and why."""


@dataclass
class PretrainedReport:
    """What one stage read from one checkpoint."""

    path: str
    loaded: list[str] = field(default_factory=list)  # names (in the module) of the tensors given the file's values
    read: list[str] = field(default_factory=list)  # the checkpoint keys read, in order
    files: list[str] = field(default_factory=list)  # the files opened
    missing: list[str] = field(default_factory=list)  # tensors of this stage the checkpoint lacks
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys that name no tensor of the module

    def warnings(self, stage: int | None = None) -> list[str]:
        where = "" if stage is None else f"stage {stage}: "
        out = []
        if self.missing:
            out.append(f"{where}{len(self.missing)} tensors are not in the pretrained checkpoint {self.path!r} and "
                       f"keep their initialisation: {_some(self.missing)}")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} tensors of the pretrained checkpoint {self.path!r} name nothing in "
                       f"the model and are not used: {_some(self.unexpected)}")
        return out


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")


def _safe_open(path: Path, device: str):
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - transformers brings it
        raise PretrainedError("pretrained checkpoints are read with the safetensors library: "
                              "pip install safetensors") from err
    return safe_open(str(path), framework="pt", device=device)


def checkpoint_files(path: Any) -> dict[str, Path]:
    """Every tensor key of the checkpoint at ``path`` and the file that holds it (only the index or the file's
    header is read)."""
    given = Path(path)
    file = given
    if given.is_dir():
        if (given / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((given / INDEX_FILE).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise PretrainedError(f"{str(given / INDEX_FILE)!r} is not a safetensors index (a JSON object with "
                                      f"a 'weight_map' from tensor names to file names): {err}") from err
            files = {k: given / f for k, f in weight_map.items()}
            absent = sorted({str(f) for f in files.values() if not f.is_file()})
            if absent:
                raise PretrainedError(f"the index {str(given / INDEX_FILE)!r} names files that are not there: "
                                      f"{absent[:3]}")
            return files
        found = [given / SINGLE_FILE] if (given / SINGLE_FILE).is_file() else sorted(given.glob("*.safetensors"))
        if len(found) != 1:
            raise PretrainedError(
                f"the pretrained folder {str(given)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}"
                + (f" but {len(found)} .safetensors files: name one of them" if found else
                   " (only safetensors checkpoints are read per stage; convert a .bin or .pt checkpoint with "
                   "safetensors.torch.save_file)")
            )
        file = found[0]
    elif not given.is_file():
        raise PretrainedError(f"the pretrained checkpoint {str(given)!r} does not exist")
    if file.suffix != ".safetensors":
        raise PretrainedError(f"{str(file)!r} is not a .safetensors file (only safetensors checkpoints are read per "
                              "stage; convert it with safetensors.torch.save_file)")
    with _safe_open(file, "cpu") as f:
        return {k: file for k in f.keys()}


def key_map(file_keys: Collection[str], module_keys: Collection[str], base_prefix: str = "") -> dict[str, str]:
    """Module key -> checkpoint key: the keys as they are, or with ``base_prefix`` added or dropped (a Hugging Face
    model's ``base_model_prefix``), whichever reading matches the most keys."""
    keys = set(file_keys)
    readings = [{k: k for k in module_keys if k in keys}]
    if base_prefix:
        p = base_prefix + "."
        readings.append({k: p + k for k in module_keys if p + k in keys})
        readings.append({k: k[len(p):] for k in module_keys if k.startswith(p) and k[len(p):] in keys})
    return max(readings, key=len)


def load_pretrained(path: Any, tensors: Mapping[str, Tensor], module_keys: Collection[str],
                    transient: Collection[str] = (), base_prefix: str = "") -> PretrainedReport:
    """Copy the checkpoint's values into ``tensors`` (name in the module -> this stage's tensor), reading only those.

    ``module_keys`` are all the state-dict keys of the module (every stage's: they decide the key reading and which
    checkpoint keys are unexpected); ``transient`` its non-persistent buffers, which are not read."""
    files = checkpoint_files(path)
    mapping = key_map(files, [*module_keys, *transient], base_prefix)
    report = PretrainedReport(str(path))
    used = set(mapping.values())
    report.unexpected = sorted(k for k in files if k not in used)
    skip = set(transient)
    report.missing = sorted(n for n in tensors if n not in mapping and n not in skip)
    todo: dict[tuple[Path, str], list[tuple[str, str]]] = {}
    for name, tensor in tensors.items():
        if name in mapping and name not in skip:
            todo.setdefault((files[mapping[name]], str(tensor.device)), []).append((name, mapping[name]))
    for (file, device), keys in sorted(todo.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        report.files.append(str(file))
        with _safe_open(file, device) as f, torch.no_grad():
            for name, key in keys:
                target = tensors[name]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(target.shape):
                    raise PretrainedError(f"{key!r} in {str(file)!r} has shape {shape}, but the model's {name!r} has "
                                          f"{tuple(target.shape)}: was the model built from another configuration?")
                target.copy_(f.get_tensor(key))
                report.read.append(key)
                report.loaded.append(name)
    return report


__all__ = ["INDEX_FILE", "SINGLE_FILE", "PretrainedError", "PretrainedReport", "checkpoint_files", "key_map",
           "load_pretrained"]
