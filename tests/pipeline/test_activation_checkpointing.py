"""Activation checkpointing per stage: the recompute sees the dropout masks of the original forward, so training is
the same as without it; the argument is checked."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _models import TinyGPT
from _models import Block as GPTBlock
from conftest import launch_forked
from lightning_clapping import ClappingStrategy
from lightning_clapping.pipeline.recompute import check_policy, targets
from lightning_clapping.comm.placement import Placement, Topology
from lightning_clapping.pipeline.executor import PipelineExecutor
from lightning_clapping.pipeline.partition import build_partition
from lightning_clapping.pipeline.stage import StageRunner


class DropBlock(nn.Module):
    calls = 0

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        DropBlock.calls += 1
        return x + self.drop(F.gelu(self.lin(x)))


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[DropBlock(16) for _ in range(3)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def _train_step(policy, seed_base: int = 100):
    """One training step of a one-stage pipeline (its executor, frozen seeds per micro-batch, 1F1B): the gradients,
    how often the blocks ran and how many tensors autograd saved outside checkpointed regions."""
    torch.manual_seed(0)
    model = DropNet()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    runner = StageRunner(model, build_partition(model, 1, None), 0, check_policy(policy))
    runner.install()
    executor = PipelineExecutor(runner, Placement(Topology(1, 1, 1), 0, torch.device("cpu")), lambda *a: None)
    DropBlock.calls, saved = 0, [0]

    def pack(t):
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        executor.train_step([x[:4], x[4:]], lambda mb, j: model(mb).square().mean(), [0.5, 0.5],
                            rng_seed=lambda j: seed_base + j)
    runner.uninstall()
    assert "forward" not in model.blocks[0].__dict__, "uninstall must leave the plain module"
    return {n: p.grad.clone() for n, p in model.named_parameters()}, DropBlock.calls, saved[0], runner.checkpointed


def test_recomputed_blocks_see_the_dropout_masks_of_their_forward():
    plain, plain_calls, plain_saved, none = _train_step(None)
    ckpt, ckpt_calls, ckpt_saved, chosen = _train_step(True)
    assert none == [] and chosen == ["blocks.0", "blocks.1", "blocks.2"], chosen  # the elements of the block list
    ckpt_cls, cls_calls, _, chosen_cls = _train_step({DropBlock})
    assert chosen_cls == chosen
    # checkpointing is really on: every block runs again in backward, and fewer activations are kept
    assert plain_calls == 6 and ckpt_calls == cls_calls == 12
    assert ckpt_saved < plain_saved
    # dropout is really on: other seeds draw other masks
    other, *_ = _train_step(None, seed_base=7)
    assert not torch.equal(other["inp.weight"], plain["inp.weight"])
    for name, grad in plain.items():
        assert torch.equal(ckpt[name], grad), f"{name}: the recompute drew other dropout masks"
        assert torch.equal(ckpt_cls[name], grad), f"{name}: the recompute drew other dropout masks ({{DropBlock}})"


def test_a_stage_checkpoints_only_its_own_outermost_matches():
    model = TinyGPT()
    partition = build_partition(model, 2, ["blocks.2"])
    assert targets(model, partition, 0, frozenset({GPTBlock})) == ["blocks.0", "blocks.1"]
    assert targets(model, partition, 1, True) == ["blocks.2", "blocks.3"]
    # the block list spans both stages: never wrapped; nested Linears inside a wrapped Block are not wrapped again
    assert targets(model, partition, 1, frozenset({nn.ModuleList})) == []
    assert targets(model, partition, 1, frozenset({GPTBlock, nn.Linear})) == ["blocks.2", "blocks.3", "head"]


@pytest.mark.parametrize("bad", ["blocks", [], [nn.Linear, "x"], {int}, nn.Linear(2, 2), 3])
def test_activation_checkpointing_argument_is_validated(bad):
    with pytest.raises(TypeError, match="set of nn.Module subclasses"):
        ClappingStrategy(activation_checkpointing=bad)


def test_activation_checkpointing_accepts_true_classes_and_off():
    assert ClappingStrategy(activation_checkpointing=True).activation_checkpointing is True
    assert ClappingStrategy(activation_checkpointing=nn.Linear).activation_checkpointing == frozenset({nn.Linear})
    assert ClappingStrategy(activation_checkpointing=[DropBlock]).activation_checkpointing == frozenset({DropBlock})
    assert ClappingStrategy(activation_checkpointing=False).activation_checkpointing is None


def test_two_stage_training_with_dropout_is_the_same_with_activation_checkpointing(tmp_path):
    launch_forked("precision_run.py", "pipe", str(tmp_path), "dropout,dropout_ckpt", ranks=2, cwd=tmp_path, timeout=600)
    for rank, blocks in ((0, ["net.3", "net.4", "net.5"]), (1, ["net.0", "net.1", "net.2"])):  # rank 0: last stage
        ckpt = json.loads((tmp_path / f"dropout_ckpt_pipe_rank{rank}.json").read_text())
        assert ckpt["checkpointed"] == blocks
    plain, ckpt = torch.load(tmp_path / "dropout_pipe.pt"), torch.load(tmp_path / "dropout_ckpt_pipe.pt")
    for name, value in plain.items():
        torch.testing.assert_close(ckpt[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
