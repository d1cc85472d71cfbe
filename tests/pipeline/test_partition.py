"""Cutting models into stages: automatic balance, explicit names, ownership, and the errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from lightning_clapping.pipeline.partition import PartitionError, balance, block_candidates, build_partition
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


def _wrapped(*layers: nn.Module) -> nn.Module:
    model = nn.Module()
    model.net = nn.Sequential(*layers)
    return model


def _mnist_mlp() -> nn.Module:
    # Linear(784, 64) holds 91 % of the parameters
    return _wrapped(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def test_a_dominant_layer_leaves_no_stage_empty():
    model = _mnist_mlp()
    for stages in (2, 3):
        part = build_partition(model, stages)
        assert all(p > 0 for p in part.stage_params), (part.cut_points, part.stage_params)
        assert max(part.stage_params) == 784 * 64 + 64  # the big layer alone: the best any partition can do
    # the raw input (784 wide) never crosses the wire: stage 0 runs the big layer
    assert "net.0" not in build_partition(model, 3).cut_points


def test_more_stages_than_parameter_holding_blocks_is_refused_with_advice():
    with pytest.raises(PartitionError, match="4 stages that all hold parameters.*only 3 runs.*at most 3 devices"):
        balance(_mnist_mlp(), 4)
    # explicit split points are taken as given, even with a stage that holds nothing
    assert build_partition(_mnist_mlp(), 4, ["net.0", "net.1", "net.3"]).stage_params[0] == 0


def test_boundary_sizes_break_ties_between_equally_balanced_cuts():
    model = _mnist_mlp()
    # net.1/net.2 and net.3/net.4 give the same stage sizes: the smaller boundary wins
    sizes = {"net.0": 784, "net.1": 64, "net.2": 64, "net.3": 64, "net.4": 64}
    assert balance(model, 3, {**sizes, "net.2": 30, "net.4": 5}) == ["net.2", "net.4"]
    assert balance(model, 3, {**sizes, "net.1": 30, "net.3": 5}) == ["net.1", "net.3"]
    # but never at the price of a larger largest stage or an empty stage
    assert balance(model, 2, {**sizes, "net.0": 0, "net.4": 1000}) in (["net.1"], ["net.2"])


def test_boundary_sizes_must_cover_every_candidate():
    with pytest.raises(PartitionError, match="no entry for the cuttable blocks \\['net.4'\\]"):
        balance(_mnist_mlp(), 2, {f"net.{i}": 1 for i in range(4)})


@pytest.mark.parametrize("seed", range(25))
def test_balance_is_the_lexicographic_optimum_of_all_partitions(seed):
    """Against brute force: among all partitions, no empty stage when possible, then the smallest largest stage,
    then the smallest total boundary; the empty-stage rule never costs a larger largest stage."""
    rng = random.Random(seed)
    layers: list[nn.Module] = []
    for _ in range(rng.randint(3, 7)):
        layers.append(nn.Linear(rng.choice([1, 2, 8, 30]), rng.choice([1, 2, 8])) if rng.random() < 0.6
                      else nn.ReLU())
    model = _wrapped(*layers)
    candidates = block_candidates(model)
    stages = rng.randint(2, min(4, len(candidates)))
    numel = {c: rng.randint(1, 5) for c in candidates}
    options = []
    for cuts in itertools.combinations(candidates, stages - 1):
        sizes = build_partition(model, stages, list(cuts)).stage_params
        options.append((min(sizes) == 0, max(sizes), sum(numel[c] for c in cuts)))
    best = min(options)
    if best[0]:
        with pytest.raises(PartitionError, match="all hold parameters"):
            balance(model, stages, numel)
        return
    assert best[1] == min(o[1] for o in options)  # avoiding empty stages did not cost balance
    sizes = build_partition(model, stages).stage_params
    assert min(sizes) > 0 and max(sizes) == best[1]
    chosen = balance(model, stages, numel)
    assert (False, max(build_partition(model, stages, chosen).stage_params), sum(numel[c] for c in chosen)) == best


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


def test_parameter_on_a_module_spanning_stages_is_owned_by_the_stage_that_uses_it():
    class RootParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    part = build_partition(RootParam(), 2, ["blocks.1"])
    assert part.shared_params == ("scale",)
    assert part.state_stage["scale"] is None  # every stage holds it until the first step shows who uses it
    part.settle_owner("scale", [1])
    assert part.state_stage["scale"] == 1 and "scale" not in part.owned_state_keys(0)
    with pytest.raises(PartitionError, match="'scale'.*stages 0 and 1 both use it.*split_points"):
        part.settle_owner("scale", [0, 1])


def test_split_point_count_must_match_the_number_of_stages():
    with pytest.raises(PartitionError, match="2 split points make 3 stages"):
        build_partition(TinyGPT(), 2, ["blocks.1", "blocks.2"])


def test_candidates_do_not_descend_into_blocks_that_are_themselves_sequential():
    # a ModuleList of Sequential blocks: the blocks are the candidates, not their layers (in registration order)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))
    assert block_candidates(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert balance(model, 4) == ["blocks.1", "blocks.2", "blocks.3"]
