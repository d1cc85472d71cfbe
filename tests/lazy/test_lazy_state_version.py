"""A lazy-sampling state of another layout is refused at load, saying what to do, before any batch is drawn."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_clapping import LazySamplingLoader


def test_a_state_of_another_layout_is_refused_with_the_way_out():
    loader = LazySamplingLoader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2), p=0.5, seed=0)
    state = loader.state_dict()
    LazySamplingLoader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2), p=0.5, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="version 1.*load_from_checkpoint"):
        loader.load_state_dict({**state, "version": 1})
