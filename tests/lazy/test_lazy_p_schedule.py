"""A schedule of lazy sampling's p: ``LazySamplingDataModule(dm, p={0: 0.5, 400: 1.0})``."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from lightning_clapping.data import LazySamplingDataModule, LazySamplingLoader
from test_lazy_sampling import binomial_bound, epoch_starts, fit, id_loader, walk


def fresh_steps(lazy: LazySamplingLoader, steps: int) -> list[bool]:
    it = iter(lazy)
    out = []
    for i in range(steps):
        next(it)
        out.append(lazy.batch_info(i).fresh)
    return out


def test_each_p_of_a_schedule_holds_from_its_step_to_the_next():
    schedule = {0: 0.1, 5000: 0.9, 12000: 0.5}
    lazy = LazySamplingLoader((torch.full((2,), i) for i in itertools.count()), p=schedule, seed=11)
    fresh = fresh_steps(lazy, 20000)
    for (start, p), end in zip(schedule.items(), [5000, 12000, 20000]):
        n = end - start - (start == 0)  # step 0 is always fresh
        count = sum(fresh[start + (start == 0): end])
        assert abs(count - p * n) <= binomial_bound(n, p), (start, p, count, n)
        assert lazy.p_at(start) == p and lazy.p_at(end - 1) == p


def test_a_schedule_of_one_entry_decides_as_that_p():
    plain = walk(LazySamplingLoader(id_loader(23, 4), p=0.4, seed=5), 80)
    assert walk(LazySamplingLoader(id_loader(23, 4), p={0: 0.4}, seed=5), 80) == plain


def test_len_counts_the_steps_of_an_epoch_that_crosses_a_change_of_p():
    lazy = LazySamplingLoader(id_loader(40, 4), p={0: 0.2, 12: 1.0}, seed=3)
    lengths, taken = [], []
    for _ in range(3):
        lengths.append(len(lazy))
        taken.append(sum(1 for _ in lazy))
    assert lengths == taken
    assert lengths[0] > 12 and lengths[1:] == [10, 10]  # p = 1 from step 12 on: one step per wrapped batch


@pytest.mark.parametrize("bad, match", [
    ({5: 0.5}, "from step 0"),
    ({0: 0.5, -1: 0.2}, "ints >= 0"),
    ({0: 0.5, True: 0.2}, "ints >= 0"),
    ({0: 0.5, "10": 0.2}, "ints >= 0"),
    ({0: 0.5, 10: 0.0}, r"p from step 10 must be a number in the range \(0, 1\]"),
    ({0: 1.5}, r"p from step 0 must be a number in the range \(0, 1\]"),
])
def test_a_bad_schedule_is_refused_with_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        LazySamplingDataModule(id_loader(8, 2), p=bad)
    with pytest.raises(ValueError, match=match):
        LazySamplingLoader(id_loader(8, 2), p=bad)


def test_a_run_resumed_after_p_changed_repeats_the_uninterrupted_one(tmp_path):
    total, schedule = 70, {0: 0.3, 25: 0.8}
    full = fit("map", total, tmp_path, save_every_step=True, p=schedule)
    reuse_after_change = next(i for i in range(30, total) if not full[i]["fresh"])
    resume_and_compare_p(full, reuse_after_change, tmp_path, total, schedule)
    assert len(epoch_starts(full)) >= 3


def resume_and_compare_p(full, k, tmp_path, total, schedule):
    ckpt = tmp_path / "ckpt" / f"step={k}.ckpt"
    assert ckpt.exists()
    resumed = fit("map", total, tmp_path / f"resumed-{k}", ckpt_path=str(ckpt), p=schedule)
    keys = ("batch_id", "fresh", "samples", "loss", "ids")
    assert [tuple(r[x] for x in keys) for r in resumed] == [tuple(r[x] for x in keys) for r in full[k:]]


def test_the_mean_p_over_steps_weights_each_entry_by_the_steps_it_holds():
    lazy = LazySamplingLoader(id_loader(8, 2), p={0: 0.5, 100: 1.0}, seed=0)
    assert lazy.mean_p(0, 200) == pytest.approx(0.75)
    assert lazy.mean_p(50, 150) == pytest.approx(0.75)
    assert lazy.mean_p(120, 200) == 1.0 and lazy.mean_p(0, 100) == 0.5
    assert lazy.mean_p(10, float("inf")) == 1.0  # the p that holds for ever
    assert LazySamplingLoader(id_loader(8, 2), p=0.3).mean_p(0, 1000) == pytest.approx(0.3)


def test_a_float_p_and_its_one_entry_schedule_resume_each_other_without_a_warning():
    first = LazySamplingLoader(id_loader(23, 4), p=0.4, seed=12)
    walk(first, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LazySamplingLoader(id_loader(23, 4), p={0: 0.4}, seed=12).load_state_dict(first.state_dict())
    with pytest.warns(UserWarning, match="written with p=0.4"):
        LazySamplingLoader(id_loader(23, 4), p={0: 0.4, 5: 1.0}, seed=12).load_state_dict(first.state_dict())
