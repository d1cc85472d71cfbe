"""A micro-batch's forward draws from generators seeded for it; the surrounding random streams go on untouched."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from lightning_clapping.pipeline.streams import frozen_rng as _frozen_rng

CPU = torch.device("cpu")


def test_cpu_draws_are_the_seeds_and_the_outer_stream_goes_on_as_if_nothing_ran():
    torch.manual_seed(1)
    expected_outer = torch.rand(4)
    torch.manual_seed(123)
    expected_inner = torch.rand(3)

    torch.manual_seed(1)
    outer = [torch.rand(2)]
    with _frozen_rng(123, CPU):
        inner = torch.rand(3)
    outer.append(torch.rand(2))
    assert torch.equal(inner, expected_inner)
    assert torch.equal(torch.cat(outer), expected_outer)


class _FakeCuda:
    """Records what _frozen_rng does to CUDA generators (there is no GPU here): states by device index."""

    def __init__(self, monkeypatch) -> None:
        self.states = {0: torch.tensor([0]), 1: torch.tensor([1]), 2: torch.tensor([2])}
        self.current = 0
        self.seeded: list[tuple[int, int]] = []
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "manual_seed", self._seed)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", self._device)

    @staticmethod
    def _index(device) -> int:
        return device if isinstance(device, int) else torch.device(device).index

    def _set(self, state, device="cuda") -> None:
        self.states[self._index(device)] = state

    def _seed(self, seed) -> None:
        self.seeded.append((self.current, seed))
        self.states[self.current] = torch.tensor([1000 + seed])

    @contextmanager
    def _device(self, index):
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before


def test_on_a_cuda_device_its_own_generator_is_seeded_and_restored_and_no_other(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    before = {i: s.clone() for i, s in cuda.states.items()}
    with _frozen_rng(7, torch.device("cuda", 1)):
        assert cuda.seeded == [(1, 7)]  # device 1's generator, seeded while device 1 is current
        assert torch.equal(cuda.states[0], before[0]) and torch.equal(cuda.states[2], before[2])
        cpu_inside = torch.rand(2)
    assert cuda.current == 0
    assert all(torch.equal(cuda.states[i], before[i]) for i in before)  # device 1 restored, the others untouched
    torch.manual_seed(7)
    assert torch.equal(cpu_inside, torch.rand(2))  # the CPU generator was seeded too


def test_a_cuda_device_without_index_means_the_current_one(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    cuda.current = 2
    with _frozen_rng(5, torch.device("cuda")):
        assert cuda.seeded == [(2, 5)]
    assert torch.equal(cuda.states[2], torch.tensor([2]))
