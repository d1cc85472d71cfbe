"""Splitting batches into micro-batches and merging step outputs."""

from __future__ import annotations

import pytest
import torch

from lightning_clapping.pipeline.microbatch import merge_outputs, split_batch


def test_split_is_ordered_and_covers_the_batch_once():
    x, y = torch.arange(10).float().unsqueeze(1), torch.arange(10)
    parts, sizes = split_batch((x, y), 4)
    assert sizes == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert all(torch.equal(p[0].squeeze(1).long(), p[1]) for p in parts)


def test_dict_batches_split_every_batch_tensor_and_repeat_the_rest():
    batch = {"ids": torch.zeros(6, 3), "mask": torch.ones(6, 3), "name": "demo", "table": torch.arange(4)}
    parts, sizes = split_batch(batch, 3)
    assert sizes == [2, 2, 2]
    assert all(p["ids"].shape == (2, 3) and p["name"] == "demo" and p["table"].shape == (4,) for p in parts)


def test_a_batch_smaller_than_the_microbatch_count_gets_one_sample_per_microbatch():
    parts, sizes = split_batch(torch.zeros(2, 5), 4)
    assert sizes == [1, 1] and len(parts) == 2


def test_batch_without_tensors_is_refused():
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        split_batch({"text": ["a", "b"]}, 2)


def test_merge_concatenates_batched_outputs_and_weights_scalars_by_size():
    merged = merge_outputs([torch.ones(3), torch.zeros(1)], [3, 1])
    assert torch.equal(merged, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert float(merge_outputs([torch.tensor(1.0), torch.tensor(0.0)], [3, 1])) == pytest.approx(0.75)
    assert merge_outputs([{"p": torch.ones(2)}, {"p": torch.ones(1)}], [2, 1])["p"].shape == (3,)
