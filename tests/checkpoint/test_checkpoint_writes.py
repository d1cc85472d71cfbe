"""Checkpoint writes and reads that cannot go wrong: a sharded checkpoint and a full one replace each other at one
path with no race between the ranks, an interrupted save leaves the previous checkpoint as it was, and a sharded
checkpoint's ``meta.pt`` is read with torch's safe default (``weights_only=None``)."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from conftest import launch_forked
from lightning_clapping.checkpoint import state as ckpt
from lightning_clapping.checkpoint_hooks import StageCheckpoints

CPU = torch.device("cpu")


class Opaque:
    """Not on torch's allowlist of what a weights-only load may build."""


def _meta_with_an_opaque_object(folder):
    folder.mkdir()
    torch.save({"callbacks": {"Custom": {"thing": Opaque()}}, "global_step": 3}, folder / ckpt.META_FILE)


def test_a_sharded_meta_holding_an_object_off_the_allowlist_is_refused_by_default(tmp_path, monkeypatch):
    _meta_with_an_opaque_object(tmp_path / "sharded")
    rooms = StageCheckpoints(SimpleNamespace(state_dict_type="sharded"))
    partition = SimpleNamespace(aliases={})
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        rooms.load_sharded(tmp_path / "sharded", None, partition, None, [], True, None)

    class ReadPastMeta(Exception):
        pass

    def past_meta(path):
        raise ReadPastMeta

    monkeypatch.setattr(ckpt, "saved_model_keys", past_meta)
    with pytest.raises(ReadPastMeta):  # asked for, the full unpickler reads it
        rooms.load_sharded(tmp_path / "sharded", None, partition, None, [], True, False)


def test_an_interrupted_sharded_save_leaves_the_checkpoint_that_was_there(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"the previous full checkpoint")
    tensors = {"model": {"w": torch.arange(4.0)}}

    def fail(state, checkpoint_id):  # a shard half written, then the save stops
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_sharded(path, tensors, {"global_step": 1}, CPU)
    assert path.read_bytes() == b"the previous full checkpoint"
    monkeypatch.undo()
    ckpt.save_sharded(path, tensors, {"global_step": 2}, CPU)  # the next save clears what the last one left
    assert ckpt.is_sharded_checkpoint(path) and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(path / ckpt.META_FILE) == {"global_step": 2}


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for sharded in (True, False):
        with pytest.raises(FileExistsError, match="a folder that is not a checkpoint is there"):
            ckpt.claim_path(folder, sharded=sharded, device=CPU)
    assert (folder / "notes.txt").read_text() == "mine"


def test_full_and_sharded_checkpoints_replace_each_other_at_one_path_on_every_rank(tmp_path):
    launch_forked("checkpoint_replace_run.py", str(tmp_path), ranks=2, cwd=tmp_path, timeout=240)
    result = json.loads((tmp_path / "replace.json").read_text())
    assert result["seen"] == [
        ["full", True, False, ["model.ckpt"]],
        ["sharded", False, True, ["model.ckpt"]],  # nothing left beside it: no staging folder, no old file
        ["full", True, False, ["model.ckpt"]],
        ["sharded", False, True, ["model.ckpt"]],
    ]
    assert result["resumed_to"] == 4  # read back under torch's default weights_only, trained from step 2
