"""Only NaN marks a bad cut: -inf is a value (additive attention masks hold it) and crosses a boundary unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import launch_forked
from lightning_clapping.pipeline.stage import SplitError, check_finite


def test_check_finite_lets_infinities_pass():
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    assert bool(torch.isneginf(mask).any())
    check_finite([mask, torch.tensor([float("inf"), -float("inf"), 1.0])], "stage 0 output", True)


@pytest.mark.parametrize("first_step", [True, False])
def test_check_finite_refuses_nan_and_says_so(first_step):
    bad = torch.tensor([0.0, -float("inf"), float("nan")])
    with pytest.raises(SplitError, match="tensor 1 of shape \\(3,\\) holds NaN\\.") as info:
        check_finite([torch.zeros(2), bad], "stage 0 output for micro-batch 0", first_step)
    assert "inf" not in str(info.value)
    assert ("cannot be cut here" in str(info.value)) == first_step


def test_float_mask_with_minus_inf_crosses_a_boundary_and_training_matches_one_device(tmp_path):
    # 2 stages cut at blocks.1: the boundary carries the hidden states and the -inf causal mask
    launch_forked("inf_mask_run.py", "pipe", str(tmp_path), ranks=2, cwd=tmp_path, timeout=300)
    launch_forked("inf_mask_run.py", "single", str(tmp_path), ranks=1, cwd=tmp_path, timeout=300)
    pipe, single = (json.loads((tmp_path / f"inf_mask_{m}.json").read_text())["losses"] for m in ("pipe", "single"))
    assert len(pipe) == len(single) == 3
    assert pipe == pytest.approx(single, rel=0, abs=1e-5)
    pipe_w, single_w = torch.load(tmp_path / "inf_mask_pipe.pt"), torch.load(tmp_path / "inf_mask_single.pt")
    assert pipe_w.keys() == single_w.keys()
    for k in pipe_w:
        torch.testing.assert_close(pipe_w[k], single_w[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
