"""LAG's worker-side trigger on one tensor, without processes: what it compares (lightning_clapping.sync.lag)."""

from __future__ import annotations

import torch

from lightning_clapping import LAG
from lightning_clapping.sync.lag import LazyAggregation


def _lag(**kw) -> LazyAggregation:
    return LazyAggregation(LAG(memory=2, **kw), group=None, replicas=2, device=torch.device("cpu"))


def test_the_papers_trigger_compares_the_gradients_change_with_the_last_steps_over_lr_squared():
    lag = _lag()
    p = torch.nn.Parameter(torch.zeros(4))
    lag.last_sent[0], lag.stale[0] = torch.zeros(4), torch.zeros(4)
    for move in (1.0, 2.0, 3.0):  # three steps of the parameter; the trigger keeps the last D = 2
        lag.before[0] = p.detach().clone()
        with torch.no_grad():
            p.add_(move / 2)  # ||step||^2 = 4 * (move / 2)^2 = move^2
        lag.after_step([p])
    assert list(lag.moves[0]) == [4.0, 9.0]
    lr = 0.5  # right-hand side: 1 / (D lr^2) * (4 + 9) = 26
    assert not lag._fires(0, torch.full((4,), 2.5), lr)  # ||g||^2 = 25
    assert lag._fires(0, torch.full((4,), 2.6), lr)  # 27.04


def test_the_average_reference_uses_the_averaged_gradients_norm_whatever_the_step():
    lag = _lag(reference="average")
    p = torch.nn.Parameter(torch.zeros(4))
    lag.last_sent[0] = torch.zeros(4)
    for value in (1.0, 2.0):
        lag.stale[0] = torch.full((4,), value)
        with torch.no_grad():
            p.add_(100.0)  # an Adam-sized step does not enter it
        lag.after_step([p])
    assert list(lag.moves[0]) == [4.0, 16.0]
    # right-hand side: 1 / D * (4 + 16) = 10, whatever the learning rate
    assert not lag._fires(0, torch.full((4,), 1.5), 1e-6)  # 9
    assert lag._fires(0, torch.full((4,), 1.6), 1e-6)  # 10.24
