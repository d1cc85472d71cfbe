"""Every stage compares a digest of its batch with the last stage's: identical data must always pass, and any
difference in values, order, shape or dtype must stop the run."""

from __future__ import annotations

import pytest
import torch

from lightning_clapping.comm.failures import check_same_batch, fingerprint


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", range(6))
def test_identical_data_has_one_fingerprint_whatever_the_thread_count(seed, threads):
    # few rows of many values: a float sum per row was split over threads differently (4 of these 6 seeds differed)
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(1, 4_000_000, generator=g) * 100, "y": torch.randint(0, 10, (1,), generator=g)}
    seen = set()
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        seen.add(fingerprint(batch))
    assert len(seen) == 1


def test_the_fingerprint_sees_order_values_shape_and_dtype():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    base = fingerprint((x, torch.tensor([0, 1, 2, 3])))
    assert fingerprint((x.clone(), torch.tensor([0, 1, 2, 3]))) == base
    swapped = x[[1, 0, 2, 3]]
    assert fingerprint((swapped, torch.tensor([0, 1, 2, 3]))) != base
    nudged = x.clone()
    nudged[2, 1] = torch.nextafter(nudged[2, 1], torch.tensor(100.0))
    assert fingerprint((nudged, torch.tensor([0, 1, 2, 3]))) != base
    assert fingerprint((x.reshape(3, 4), torch.tensor([0, 1, 2, 3]))) != base
    assert fingerprint((x.double(), torch.tensor([0, 1, 2, 3]))) != base
    assert fingerprint((x.t().contiguous().t(), torch.tensor([0, 1, 2, 3]))) == base  # layout is not data


def test_a_different_batch_is_refused_with_the_reason():
    a, b = fingerprint(torch.ones(2, 3)), fingerprint(torch.zeros(2, 3))
    check_same_batch(a, a, stage=1, step=3)
    with pytest.raises(RuntimeError, match="stage 1 trained on another batch than the last stage at step 3"):
        check_same_batch(a, b, stage=1, step=3)
