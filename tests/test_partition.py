"""Cutting models into stages: automatic balance, explicit names, ownership, and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_clapping.partition import PartitionError, balance, block_candidates, build_partition
from _models import SequentialMLP, TinyGPT


def test_candidates_are_the_elements_of_block_lists():
    assert block_candidates(TinyGPT(layers=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert block_candidates(SequentialMLP(depth=2)) == ["net.0", "net.1", "net.2"]


def test_model_without_block_lists_falls_back_to_the_root_children():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    assert block_candidates(Plain()) == ["a", "b", "c"]


def test_balance_minimises_the_largest_stage():
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)], nn.Linear(10, 1000))
    # the big last layer deserves a stage of its own; the four small ones share the other
    wrapped = nn.Module()
    wrapped.net = model
    assert balance(wrapped, 2) == ["net.4"]


def test_automatic_partition_of_a_transformer_gives_each_stage_whole_blocks():
    model = TinyGPT(layers=4)
    part = build_partition(model, 4)
    assert len(part.cut_points) == 3 and all(c.startswith("blocks.") for c in part.cut_points)
    assert sum(part.stage_params) == sum(p.numel() for p in model.parameters())
    assert part.unit_stage["tok"] == 0 and part.unit_stage["head"] == 3


def test_every_state_tensor_has_exactly_one_stage():
    model = TinyGPT(layers=4)
    part = build_partition(model, 3, ["blocks.1", "blocks.3"])
    assert set(part.state_stage) == set(model.state_dict())
    owned = [part.owned_state_keys(s) for s in range(3)]
    assert set().union(*owned) == set(model.state_dict())
    assert not owned[0] & owned[1] and not owned[1] & owned[2]


def test_stage_table_names_each_stage_start_and_share():
    table = build_partition(TinyGPT(layers=4), 2, ["blocks.2"]).table()
    assert "blocks.2" in table and "<start>" in table and "%" in table


def test_cut_points_must_follow_registration_order():
    with pytest.raises(PartitionError, match="in the order the model registers"):
        build_partition(TinyGPT(layers=4), 3, ["blocks.3", "blocks.1"])


def test_nested_cut_points_are_refused():
    with pytest.raises(PartitionError, match="must not be nested"):
        build_partition(TinyGPT(layers=4), 3, ["blocks.1", "blocks.1.mlp"])


def test_parameter_on_a_module_spanning_stages_is_refused_with_advice():
    class RootParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    with pytest.raises(PartitionError, match="'scale' sits directly on.*Move it into a submodule"):
        build_partition(RootParam(), 2, ["blocks.1"])


def test_tied_weights_across_stages_are_refused():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(PartitionError, match="tied weights cannot be split"):
        build_partition(Tied(), 2, ["blocks.1"])


def test_split_point_count_must_match_the_number_of_stages():
    with pytest.raises(PartitionError, match="2 split points make 3 stages"):
        build_partition(TinyGPT(), 2, ["blocks.1", "blocks.2"])
