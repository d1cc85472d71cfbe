"""Every stage draws its batches from one stream: a loader that shuffles with torch's global RNG gets a generator the
strategy seeds alike on every rank, so the model's use of the global RNG cannot move the order."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import launch_forked
from lightning_clapping import LazySamplingDataModule, LazySamplingLoader
from lightning_clapping.shuffle import SharedShuffle


class Stage(SharedShuffle):
    """What the strategy gives the mixin, in one process (no process group: nothing to agree with)."""

    root_device = torch.device("cpu")
    options = SimpleNamespace(freeze_rng=True)


class UnfrozenStage(Stage):
    options = SimpleNamespace(freeze_rng=False)


def shuffled(n: int = 24) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True)


def epochs(loader, count: int, rng_draws: int) -> list:
    """The batches of ``count`` epochs, drawing ``rng_draws`` numbers from the global RNG after every batch (a
    stage's dropout)."""
    out = []
    for _ in range(count):
        for batch in loader:
            out.append(batch[0].tolist())
            torch.rand(rng_draws)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("shuffle_stream")
    launch_forked("shuffle_stream_run.py", str(out), "plain,lazy", ranks=2, cwd=out, timeout=300)
    return out


@pytest.mark.parametrize("case", ["plain", "lazy"])
def test_two_stages_that_use_the_global_rng_differently_train_on_the_same_batches(runs, case):
    last, first = (json.loads((runs / f"{case}_rank{r}.json").read_text()) for r in (0, 1))
    assert len(last) >= 8  # 2 epochs of 4 batches (more steps with lazy sampling's reuse)
    assert last == first
    assert len({tuple(b) for b in last}) == 8  # the second epoch is shuffled anew


def test_stages_shuffle_alike_however_much_of_the_global_rng_each_uses():
    torch.manual_seed(3)
    stages = [Stage().process_dataloader(shuffled()) for _ in range(2)]
    seen = [epochs(loader, 3, draws) for loader, draws in zip(stages, (0, 7))]
    assert seen[0] == seen[1]
    assert seen[0][:6] != seen[0][6:12]  # each epoch has its own order


def test_with_freeze_rng_off_the_loader_draws_from_the_global_rng_as_in_one_process():
    """There every stage ends each step with the last stage's generator state (pipeline/streams.py), so the loader
    keeps one process's draws: its order and its workers' seed come from the global RNG."""
    loader = shuffled()
    assert UnfrozenStage().process_dataloader(loader) is loader and loader.generator is None
    torch.manual_seed(3)
    alone = epochs(shuffled(), 2, 0)
    torch.manual_seed(3)
    assert epochs(loader, 2, 0) == alone


def test_a_lazy_loader_draws_from_the_shared_stream_and_resumes_it_exactly():
    torch.manual_seed(3)
    stages = [Stage().process_dataloader(LazySamplingLoader(shuffled(), p=0.5, seed=1)) for _ in range(2)]
    seen = [epochs(loader, 3, draws) for loader, draws in zip(stages, (0, 7))]
    assert seen[0] == seen[1]

    torch.manual_seed(3)
    first = Stage().process_dataloader(LazySamplingLoader(shuffled(), p=0.5, seed=1))
    head = epochs(first, 1, 0)
    it = iter(first)
    head += [next(it)[0].tolist() for _ in range(3)]  # in the second epoch, whose order the generator drew
    state = first.state_dict()
    dm = LazySamplingDataModule(shuffled(), p=0.5, seed=1)  # a resumed run: the state is loaded before the loader
    dm.trainer = SimpleNamespace(strategy=Stage())
    dm.load_state_dict({"lazy_loader": state})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "shuffles with the global torch RNG" warning: the order is restorable
        resumed = dm.train_dataloader()
    rest = [b[0].tolist() for b in resumed] + epochs(resumed, 1, 5)
    assert head + rest == seen[0]


def test_a_given_generator_is_kept_and_each_new_loader_gets_a_stream_of_its_own():
    generator = torch.Generator().manual_seed(0)
    own = DataLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True, generator=generator)
    stage = Stage()
    assert stage.process_dataloader(own).generator is generator
    reloaded = [stage.process_dataloader(shuffled()) for _ in range(2)]  # reload_dataloaders_every_n_epochs
    assert epochs(reloaded[0], 1, 0) != epochs(reloaded[1], 1, 0)
