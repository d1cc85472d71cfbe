"""Lazy sampling (lightning_clapping.data): decisions, batches, metadata, epochs, resume and sharding."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from lightning_clapping.data import (
    BatchInfo,
    LazySamplingDataModule,
    LazySamplingLoader,
    find_lazy_loader,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def id_loader(n: int, batch_size: int, shuffle: bool = True, gen_seed: int | None = 7, drop_last: bool = False):
    """DataLoader whose batches are ``[ids]``: each sample is its own dataset index, so contents == sample ids."""
    generator = None if gen_seed is None else torch.Generator().manual_seed(gen_seed)
    return DataLoader(
        TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle, generator=generator,
        drop_last=drop_last,
    )


def run_epoch(lazy: LazySamplingLoader):
    """One epoch: list of (info, batch) in order."""
    return [(lazy.batch_info(i), batch) for i, batch in enumerate(lazy)]


class CountingStream(IterableDataset):
    """Online stream: batch k holds the sample numbers k*B .. k*B+B-1; counts reads and keeps weakrefs to batches."""

    def __init__(self, batch_size: int = 3, limit: int | None = None):
        self.batch_size = batch_size
        self.limit = limit
        self.reads = 0
        self.produced: list = []

    def __iter__(self):
        for k in itertools.count() if self.limit is None else range(self.limit):
            self.reads += 1
            batch = torch.arange(k * self.batch_size, (k + 1) * self.batch_size)
            self.produced.append(weakref.ref(batch))
            yield batch


def binomial_bound(n: int, p: float, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(n * p * (1 - p))


# ---------------------------------------------------------------------------------------------------------------------
# decisions
# ---------------------------------------------------------------------------------------------------------------------

def record_decisions():
    loader = DataLoader(TensorDataset(torch.arange(50)), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(5))
    lazy = LazySamplingLoader(loader, p=0.35, seed=1234)
    out = []
    for _ in range(3):
        for i, batch in enumerate(lazy):
            info = lazy.batch_info(i)
            out.append([int(info.fresh), info.batch_id, info.step, batch[0].tolist()])
    return out


_DECISION_SCRIPT = """
import json, sys
sys.path[:0] = [{here!r}, {tests_dir!r}]
from test_lazy_sampling import record_decisions
print(json.dumps(record_decisions()))
"""


def test_decision_sequence_is_identical_in_separate_processes():
    # two child processes (importing lightning takes seconds, so not more) plus this one
    here = Path(__file__).resolve().parent  # this module; tests/ for what it imports from there
    script = _DECISION_SCRIPT.format(here=str(here), tests_dir=str(here.parent))
    procs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONHASHSEED=hash_seed)
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, cwd=str(REPO_ROOT),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [record_decisions()]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1] == results[2]
    flags = [r[0] for r in results[0]]
    assert 0 in flags and 1 in flags  # the sequence really mixes fresh draws and reuses


def test_reused_steps_yield_the_very_same_tensors():
    lazy = LazySamplingLoader(id_loader(40, 4), p=0.4, seed=0)
    reuses = 0
    previous = previous_copy = None
    for info, batch in run_epoch(lazy):
        if not info.fresh:
            reuses += 1
            assert batch is previous and batch[0] is previous[0]
            assert torch.equal(batch[0], previous_copy)
        previous, previous_copy = batch, batch[0].clone()
    assert reuses > 5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_fresh_draw_frequency_matches_p(p):
    source = (torch.full((2,), i) for i in itertools.count())  # endless, no length
    lazy = LazySamplingLoader(source, p=p, seed=11)
    steps = 20_000
    it = iter(lazy)
    fresh = 0
    for i in range(steps):
        next(it)
        fresh += lazy.batch_info(i).fresh
    # step 0 is always fresh; the other steps are Bernoulli(p)
    n = steps - 1
    assert abs((fresh - 1) - p * n) <= binomial_bound(n, p)


def test_first_step_is_always_fresh():
    for seed in range(20):
        lazy = LazySamplingLoader(id_loader(12, 4), p=0.01, seed=seed)
        next(iter(lazy))
        assert lazy.batch_info(0).fresh and lazy.batch_info(0).batch_id == 0


# ---------------------------------------------------------------------------------------------------------------------
# arguments, p = 1
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -0.2, 1.0001, 2, float("nan"), float("inf"), "0.5", None, True])
def test_p_outside_zero_one_or_not_a_number_is_refused(bad):
    with pytest.raises(ValueError, match=r"\(0, 1\].*probability of drawing a fresh"):
        LazySamplingDataModule(id_loader(8, 2), p=bad)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        LazySamplingLoader(id_loader(8, 2), p=bad)


class ShuffledDM(L.LightningDataModule):
    def __init__(self, n=23, batch_size=4, gen_seed=7, drop_last=False):
        super().__init__()
        self.n, self.batch_size, self.gen_seed, self.drop_last = n, batch_size, gen_seed, drop_last

    def train_dataloader(self):
        return id_loader(self.n, self.batch_size, True, self.gen_seed, self.drop_last)


@pytest.mark.parametrize("gen_seed", [7, None], ids=["seeded-generator", "global-rng"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_p_one_is_exactly_the_wrapped_datamodule(gen_seed, drop_last):
    torch.manual_seed(123)
    plain = ShuffledDM(gen_seed=gen_seed, drop_last=drop_last).train_dataloader()
    expected = [[b[0].tolist() for b in plain] for _ in range(3)]
    expected_len = len(plain)

    torch.manual_seed(123)
    lazy = LazySamplingDataModule(ShuffledDM(gen_seed=gen_seed, drop_last=drop_last), p=1.0).train_dataloader()
    got, lens = [], []
    for _ in range(3):
        lens.append(len(lazy))
        got.append([b[0].tolist() for b in lazy])
    assert got == expected
    assert lens == [expected_len] * 3


# ---------------------------------------------------------------------------------------------------------------------
# iterable sources (streams)
# ---------------------------------------------------------------------------------------------------------------------


def test_stream_is_read_about_p_times_per_step():
    p, steps = 0.3, 4000
    stream = CountingStream()
    lazy = LazySamplingLoader(DataLoader(stream, batch_size=None), p=p, seed=2)
    it = iter(lazy)
    for _ in range(steps):
        next(it)
    n = steps - 1
    assert abs((stream.reads - 1) - p * n) <= binomial_bound(n, p)
    assert stream.reads == lazy.fresh_draws


def test_stream_batches_are_not_kept_beyond_the_current_one():
    stream = CountingStream()
    lazy = LazySamplingLoader(DataLoader(stream, batch_size=None), p=0.5, seed=3)
    it = iter(lazy)
    for _ in range(300):
        batch = next(it)
        alive = sum(ref() is not None for ref in stream.produced)
        assert alive == 1 and stream.produced[-1]() is batch  # only the current batch is still in memory
    assert stream.reads > 100


def test_stream_sample_ids_count_the_samples_read():
    stream = CountingStream(batch_size=3, limit=40)
    lazy = LazySamplingLoader(DataLoader(stream, batch_size=None), p=0.5, seed=4)
    seen = 0
    for info, batch in run_epoch(lazy):
        assert torch.equal(info.sample_ids, batch)  # batch k holds samples 3k..3k+2
        seen += 3 if info.fresh else 0
        assert info.distinct_samples == seen
    assert seen == 120 and lazy.distinct_samples == 120


# ---------------------------------------------------------------------------------------------------------------------
# map-style: sample ids, epochs, length
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sample_ids_match_the_batch_with_shuffling(num_workers):
    dataset = TensorDataset(torch.arange(30) * 10, torch.arange(30))
    loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1),
                        num_workers=num_workers)
    lazy = LazySamplingLoader(loader, p=0.5, seed=5)
    orders = []
    for _ in range(2):
        epoch = run_epoch(lazy)
        for info, (values, labels) in epoch:
            assert info.sample_ids.dtype == torch.long
            assert torch.equal(info.sample_ids, labels) and torch.equal(values, info.sample_ids * 10)
        orders.append([info.sample_ids.tolist() for info, _ in epoch if info.fresh])
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])  # really shuffled


def test_each_epoch_draws_every_wrapped_batch_exactly_once():
    lazy = LazySamplingLoader(id_loader(23, 4), p=0.3, seed=6)
    for _ in range(4):
        fresh_ids = [info.sample_ids for info, _ in run_epoch(lazy) if info.fresh]
        assert sorted(torch.cat(fresh_ids).tolist()) == list(range(23))
        assert len(fresh_ids) == 6


def test_len_equals_the_steps_each_epoch_takes():
    lazy = LazySamplingLoader(id_loader(23, 4), p=0.3, seed=7)
    lengths = []
    for _ in range(6):
        planned = len(lazy)
        steps = 0
        for _batch in lazy:
            steps += 1
            if steps < planned:
                assert len(lazy) == planned  # stable during the epoch (after its last step: the next one's)
        assert steps == planned
        lengths.append(planned)
    assert len(set(lengths)) > 1  # epochs really differ in length


def test_reuse_never_changes_the_shape_of_a_ragged_last_batch():
    lazy = LazySamplingLoader(id_loader(23, 4), p=0.2, seed=8)
    ragged_reuses = 0
    for _ in range(6):
        previous = None
        for info, batch in run_epoch(lazy):
            if not info.fresh:
                assert batch[0].shape == previous[0].shape
                ragged_reuses += batch[0].shape[0] == 3
            else:
                assert previous is None or batch is not previous
            previous = batch
    assert ragged_reuses > 0


def test_distinct_samples_counts_fresh_draws_only():
    lazy = LazySamplingLoader(id_loader(23, 4), p=0.4, seed=9)
    total = 0
    for info, batch in run_epoch(lazy):
        total += batch[0].numel() if info.fresh else 0
        assert info.distinct_samples == total
    assert total == 23


def test_batch_info_keeps_only_a_small_window():
    lazy = LazySamplingLoader(itertools.repeat(torch.zeros(2)), p=0.5, seed=0)
    it = iter(lazy)
    for _ in range(100):
        next(it)
    assert isinstance(lazy.batch_info(99), BatchInfo)
    with pytest.raises(KeyError, match="position 0"):
        lazy.batch_info(0)


# ---------------------------------------------------------------------------------------------------------------------
# data-parallel replicas
# ---------------------------------------------------------------------------------------------------------------------


def test_replicas_share_decisions_and_draw_disjoint_shards():
    replicas = [LazySamplingLoader(id_loader(40, 4), p=0.4, seed=10, num_replicas=2, replica_rank=r) for r in (0, 1)]
    for _ in range(3):
        assert len(replicas[0]) == len(replicas[1])
        epochs = [run_epoch(lazy) for lazy in replicas]
        assert [i.fresh for i, _ in epochs[0]] == [i.fresh for i, _ in epochs[1]]
        ids = [torch.cat([i.sample_ids for i, _ in epoch if i.fresh]).tolist() for epoch in epochs]
        assert not set(ids[0]) & set(ids[1])
        assert sorted(ids[0] + ids[1]) == list(range(40))
        for epoch in epochs:
            for info, batch in epoch:
                assert torch.equal(info.sample_ids, batch[0])


def test_sharding_an_iterable_source_is_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        LazySamplingLoader(DataLoader(CountingStream(), batch_size=None), num_replicas=2, replica_rank=1)


# ---------------------------------------------------------------------------------------------------------------------
# state_dict / load_state_dict without a trainer
# ---------------------------------------------------------------------------------------------------------------------


def walk(lazy, n, position=0):
    """n steps across epochs: (fresh, batch_id, contents); ``position`` = batches already taken from this epoch."""
    out = []
    it = iter(lazy)
    while len(out) < n:
        try:
            batch = next(it)
        except StopIteration:
            it, position = iter(lazy), 0
            continue
        info = lazy.batch_info(position)
        position += 1
        out.append((info.fresh, info.batch_id, batch[0].tolist(), position))
    return out


def test_loader_state_dict_continues_identically_mid_window():
    reference = walk(LazySamplingLoader(id_loader(23, 4), p=0.4, seed=12), 60)
    # a step inside a reuse window, in the second epoch
    k = next(k for k in range(10, 60) if not reference[k][0] and reference[k][3] > 1 and reference[k][1] > 6)

    first = LazySamplingLoader(id_loader(23, 4), p=0.4, seed=12)
    walk(first, k)
    state = first.state_dict()

    resumed = LazySamplingLoader(id_loader(23, 4), p=0.4, seed=12)  # fresh generator, as in a new process
    resumed.load_state_dict(state)
    assert walk(resumed, 60 - k, position=reference[k - 1][3]) == reference[k:]


class PythonRandomSampler(Sampler):
    """Shuffles with Python's `random`: not reproducible from torch generator states."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        import random

        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n


def test_resume_warns_when_the_sample_order_cannot_be_reproduced():
    def make():
        return DataLoader(TensorDataset(torch.arange(20)), batch_size=4, sampler=PythonRandomSampler(20))

    first = LazySamplingLoader(make(), p=0.5, seed=0)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = LazySamplingLoader(make(), p=0.5, seed=0)
    with pytest.warns(RuntimeWarning, match="exact resume is impossible"):
        resumed.load_state_dict(state)


# ---------------------------------------------------------------------------------------------------------------------
# data module pass-through and lookup
# ---------------------------------------------------------------------------------------------------------------------


class FullDM(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.calls = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return id_loader(8, 2)

    def val_dataloader(self):
        return "val-loader"

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch

    def state_dict(self):
        return {"answer": 42}

    def load_state_dict(self, state):
        self.loaded = state


def test_other_hooks_pass_through_and_missing_ones_stay_undefined():
    inner = FullDM()
    dm = LazySamplingDataModule(inner, p=0.5)
    dm.prepare_data()
    dm.setup("fit")
    assert inner.calls == ["prepare_data", "setup:fit"]
    assert dm.val_dataloader() == "val-loader"
    assert is_overridden("val_dataloader", dm) and is_overridden("on_after_batch_transfer", dm)
    assert not is_overridden("test_dataloader", dm) and not is_overridden("transfer_batch_to_device", dm)
    state = dm.state_dict()
    assert state["wrapped"] == {"answer": 42}
    dm.load_state_dict(state)
    assert inner.loaded == {"answer": 42}
    assert isinstance(dm.train_dataloader(), LazySamplingLoader)


def test_find_lazy_loader_looks_inside_containers_and_the_datamodule():
    lazy = LazySamplingLoader(id_loader(8, 2), p=0.5)
    assert find_lazy_loader(SimpleNamespace(train_dataloader=lazy)) is lazy
    assert find_lazy_loader(SimpleNamespace(train_dataloader=[id_loader(4, 2), {"a": lazy}])) is lazy
    dm = LazySamplingDataModule(id_loader(8, 2), p=0.5)
    loader = dm.train_dataloader()
    assert find_lazy_loader(SimpleNamespace(train_dataloader=None, datamodule=dm)) is loader
    assert find_lazy_loader(SimpleNamespace(train_dataloader=[id_loader(4, 2)], datamodule=None)) is None


# ---------------------------------------------------------------------------------------------------------------------
# with a real Trainer
# ---------------------------------------------------------------------------------------------------------------------


class ReplayableStream(IterableDataset):
    """Finite, deterministic stream without a length (Lightning then prefetches one batch)."""

    def __iter__(self):
        x = torch.arange(40, dtype=torch.float32).unsqueeze(1)
        for i in range(0, 40, 4):
            yield x[i:i + 4], x[i:i + 4] * 2 + 1


class RegressionDM(L.LightningDataModule):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def train_dataloader(self):
        if self.kind == "stream":
            return DataLoader(ReplayableStream(), batch_size=None)
        x = torch.arange(40, dtype=torch.float32).unsqueeze(1)
        return DataLoader(TensorDataset(x, x * 2 + 1), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(7))


class Recorder(L.LightningModule):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(1, 1)
        self.records = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        lazy = find_lazy_loader(self.trainer)
        info = lazy.batch_info(batch_idx)
        samples = x.squeeze(1).long()
        if self.kind == "map":
            assert torch.equal(info.sample_ids, samples), (batch_idx, info, samples)
        else:  # the stream's k-th batch holds samples 4k..4k+3; ids count samples read
            assert torch.equal(info.sample_ids % 40, samples), (batch_idx, info, samples)
        loss = ((self.lin(x / 40) - y / 40) ** 2).mean()
        self.records.append(dict(epoch=self.current_epoch, batch_id=info.batch_id, fresh=info.fresh,
                                 samples=samples.tolist(), loss=loss.item(), ids=info.sample_ids.tolist(),
                                 planned=len(lazy) if self.kind == "map" else None))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(kind, max_steps, tmp_path, ckpt_path=None, save_every_step=False, p=0.4, seed=3):
    L.seed_everything(0, verbose=False)
    model = Recorder(kind)
    dm = LazySamplingDataModule(RegressionDM(kind), p=p, seed=seed)
    callbacks = []
    if save_every_step:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                         filename="{step}"))
    trainer = L.Trainer(
        max_steps=max_steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        enable_checkpointing=save_every_step, callbacks=callbacks, default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.records


@pytest.mark.parametrize("kind", ["map", "stream"], ids=["map-with-length", "stream-prefetched"])
def test_batch_info_matches_what_training_step_receives(kind, tmp_path):
    records = fit(kind, 30, tmp_path)  # sample-id checks run inside training_step
    assert len(records) == 30
    assert records[0]["fresh"] and records[0]["batch_id"] == 0
    for prev, cur in zip(records, records[1:]):
        if cur["fresh"]:
            assert cur["batch_id"] == prev["batch_id"] + 1
        else:
            assert cur["batch_id"] == prev["batch_id"] and cur["samples"] == prev["samples"]
    assert any(not r["fresh"] for r in records)


RESUME_KEYS = ("batch_id", "fresh", "samples", "loss", "ids")


def epoch_starts(records):
    return [i for i, r in enumerate(records) if i == 0 or r["epoch"] != records[i - 1]["epoch"]]


def resume_and_compare(kind, full, k, tmp_path, total):
    ckpt = tmp_path / "ckpt" / f"step={k}.ckpt"  # written after k steps: the resumed run starts at step k
    assert ckpt.exists()
    resumed = fit(kind, total, tmp_path / f"resumed-{k}", ckpt_path=str(ckpt))
    expected = [tuple(r[key] for key in RESUME_KEYS) for r in full[k:]]
    assert [tuple(r[key] for key in RESUME_KEYS) for r in resumed] == expected


@pytest.mark.parametrize("kind", ["map", "stream"], ids=["map-with-length", "stream-prefetched"])
def test_resume_mid_window_mid_epoch_is_exact(kind, tmp_path):
    total = 70
    full = fit(kind, total, tmp_path, save_every_step=True)
    starts = epoch_starts(full)
    assert len(starts) >= 3
    # in each of the first two epochs: resume at the first step that reuses the previous step's batch (so the
    # checkpoint cuts a reuse window); the run then crosses at least one more epoch boundary
    for first, nxt in zip(starts, starts[1:3]):
        k = next(i for i in range(first + 1, nxt) if not full[i]["fresh"])
        resume_and_compare(kind, full, k, tmp_path, total)


@pytest.mark.parametrize("kind", ["map", "stream"], ids=["map-with-length", "stream-prefetched"])
def test_resume_after_the_last_step_of_an_epoch_is_exact(kind, tmp_path):
    total = 50
    full = fit(kind, total, tmp_path, save_every_step=True)
    k = epoch_starts(full)[1]  # checkpoint written after the first epoch's last step
    resume_and_compare(kind, full, k, tmp_path, total)


def test_max_steps_rolls_over_whole_epochs_of_varying_length(tmp_path):
    records = fit("map", 70, tmp_path)
    assert len(records) == 70
    epochs = {}
    for r in records:
        epochs.setdefault(r["epoch"], []).append(r)
    finished = [e for e in sorted(epochs) if e < max(epochs)]
    assert len(finished) >= 2
    lengths = []
    for e in finished:
        steps = epochs[e]
        assert len(steps) == steps[0]["planned"]  # Lightning ran exactly len(loader) steps
        drawn = [s["samples"] for s in steps if s["fresh"]]
        assert sorted(itertools.chain.from_iterable(drawn)) == list(range(40))  # whole pass, nothing cut
        lengths.append(len(steps))
    assert len(set(lengths)) > 1
