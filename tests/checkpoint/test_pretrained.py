"""Pretrained weights read per stage from safetensors: a stage reads only its own tensors, from a file or a sharded
folder, and the model it ends with is the pretrained one."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import lightning_clapping
from conftest import has_minilm, launch_forked
from lightning_clapping.checkpoint.pretrained import PretrainedError, load_pretrained
from lightning_clapping.pipeline.materialize import building_on_meta, materialize_module

safetensors_torch = pytest.importorskip("safetensors.torch")


class Base(nn.Module):
    """A base model that names itself as a Hugging Face one does (``base_model_prefix``)."""

    base_model_prefix = "body"

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.register_buffer("steps", torch.arange(4), persistent=False)


def sharded_checkpoint(folder, state: dict[str, torch.Tensor]) -> None:
    """``state`` as a two-file checkpoint with its index, keys prefixed as a model with a head saves them."""
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    weight_map = {}
    for key, tensor in state.items():
        name = sorted(shards)[0 if key.startswith("layers.0.") else 1]
        shards[name][f"body.{key}"] = tensor.contiguous()
        weight_map[f"body.{key}"] = name
    shards[sorted(shards)[1]]["head.weight"] = torch.ones(2, 4)  # the head's: not the base model's
    weight_map["head.weight"] = sorted(shards)[1]
    for name, tensors in shards.items():
        safetensors_torch.save_file(tensors, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_stage_reads_only_its_own_tensors_from_a_sharded_checkpoint(tmp_path):
    torch.manual_seed(0)
    trained = Base()
    sharded_checkpoint(tmp_path, trained.state_dict())
    with building_on_meta():
        model = Base()
    materialize_module(model)
    own = {"layers.0.weight": model.layers[0].weight, "layers.0.bias": model.layers[0].bias}  # what one stage holds
    keys = list(model.state_dict())
    report = load_pretrained(tmp_path, own, keys, ["steps"], base_prefix="body")
    assert sorted(report.read) == ["body.layers.0.bias", "body.layers.0.weight"]
    assert report.files == [str(tmp_path / "model-00001-of-00002.safetensors")]  # the other shard stays closed
    assert report.unexpected == ["head.weight"] and report.missing == []
    assert torch.equal(model.layers[0].weight, trained.layers[0].weight)
    assert not torch.equal(model.layers[1].weight, trained.layers[1].weight)  # not read: still its initialisation
    # the whole model in one process, as the strategy's stages read it together
    with building_on_meta():
        whole = Base()
    with pytest.warns(UserWarning, match=r"1 tensors of the pretrained checkpoint .* are not used: head.weight"):
        materialize_module(whole, pretrained=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), trained.state_dict().values()))
    assert torch.equal(whole.steps, torch.arange(4))  # non-persistent buffers keep the model's own value


def test_bad_pretrained_checkpoints_are_refused_with_the_reason(tmp_path):
    with pytest.raises(TypeError, match=r"pretrained must be the path of a safetensors checkpoint .* got 3"):
        lightning_clapping.ClappingStrategy(pretrained=3)
    model = nn.Linear(4, 2)
    with pytest.raises(PretrainedError, match=r"'.*missing' does not exist"):
        load_pretrained(tmp_path / "missing", {"weight": model.weight}, ["weight"])
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(tmp_path, {"weight": model.weight}, ["weight"])
    safetensors_torch.save_file({"weight": torch.zeros(3, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedError, match=r"'weight' in .* has shape \(3, 4\), but the model's 'weight' has \(2, 4\)"):
        load_pretrained(tmp_path, {"weight": model.weight}, ["weight"])


@pytest.mark.skipif(not has_minilm(), reason="needs the MiniLM package and transformers (the test extras)")
def test_two_stages_read_only_their_own_minilm_tensors_and_hold_the_pretrained_model(tmp_path):
    from safetensors import safe_open
    from transformers import BertModel

    from _models import minilm_path

    launch_forked("pretrained_run.py", str(tmp_path), ranks=2, cwd=tmp_path, timeout=400)
    with safe_open(str(minilm_path() / "model.safetensors"), framework="pt") as f:
        in_file = set(f.keys())
    pretrained = BertModel.from_pretrained(minilm_path())
    expected = dict(pretrained.named_parameters()) | dict(pretrained.named_buffers())
    reads, held = [], {}
    for rank, first_layer in ((1, 0), (0, 3)):  # rank 1 runs stage 0 (embeddings, layers 0-2), rank 0 stage 1
        read = json.loads((tmp_path / f"read_rank{rank}.json").read_text())
        own = torch.load(tmp_path / f"own_rank{rank}.pt")
        encoder = {k[len("encoder."):]: v for k, v in own.items() if k.startswith("encoder.")}
        assert read["opened"] == ["model.safetensors"] * 2  # its header, then its tensors
        assert sorted(read["tensors"]) == sorted(k for k in encoder if k in in_file and k != "embeddings.position_ids")
        assert f"encoder.layer.{first_layer}.output.dense.weight" in read["tensors"]
        reads.append(set(read["tensors"]))
        held.update(encoder)
    assert not reads[0] & reads[1]  # no tensor read twice ...
    assert reads[0] | reads[1] == in_file - {"embeddings.position_ids"}  # ... and every one read once
    assert held.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(held[k], expected[k])] == []  # what from_pretrained builds


@pytest.mark.skipif(not has_minilm(), reason="needs the MiniLM package and transformers (the test extras)")
def test_a_pretrained_hugging_face_model_in_training_mode_validates_on_a_stage_without_its_embeddings(tmp_path):
    # transformers chooses a pretrained model's kernels again at each train/eval switch, for the device of its first
    # parameter: on the later stage that one is on the meta device
    launch_forked("hf_train_mode_run.py", str(tmp_path), ranks=2, cwd=tmp_path, timeout=400)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(0.0 <= row["val_acc"] <= 1.0 for row in rows)
    assert all(row["encoder_training"] for row in rows)  # its training mode is back after the validation
    assert not any(row["kernel_device_left"] for row in rows)  # the model is handed back as it came
