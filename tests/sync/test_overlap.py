"""Streaming DiLoCo's overlap (``DiLoCo(overlap=tau)``) on one replica, collectives left out: where the parameters
land when a sync's outer step comes ``tau`` inner steps after it started. The runs over 2 replicas x 2 stages
(identical replicas at the end, resume with a sync in flight, bytes) are in ``test_replica_sync.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_clapping.sync.config import DiLoCo
from lightning_clapping.sync.local_updates import LocalUpdates


class OneReplica(LocalUpdates):
    """The average of one replica's change is its change (no process group)."""

    def _start_mean(self, flat):
        return lambda: flat


def run(overlap: int, moves: list[float]) -> tuple[LocalUpdates, torch.nn.Parameter, list[float]]:
    """Inner steps that add ``moves[k]`` to a one-element parameter; the parameter after each step."""
    sync = OneReplica(DiLoCo(inner_steps=2, outer_lr=0.5, momentum=0.0, overlap=overlap), None, 1, 0,
                      torch.device("cpu"))
    p = torch.nn.Parameter(torch.zeros(1))
    seen = []
    for move in moves:
        sync.after_backward([p], [])
        with torch.no_grad():
            p += move
        sync.after_step([p])
        seen.append(p.item())
    return sync, p, seen


def test_without_overlap_the_outer_step_lands_after_its_own_step():
    # steps 1, 2 move +1, +1: the change 2 halved by outer_lr 0.5 lands at step 2
    assert run(0, [1.0, 1.0, 4.0])[2] == [1.0, 1.0, 5.0]


def test_with_overlap_the_steps_taken_beside_the_sync_are_kept_on_top_of_the_new_anchor():
    # the sync started after step 2 (anchor 0, parameters 2) lands after step 3: anchor 0 + 0.5 * 2 = 1, plus step
    # 3's +4 taken meanwhile = 5; before it lands, step 3's parameters are the inner steps' own (6)
    sync, p, seen = run(1, [1.0, 1.0, 4.0])
    assert seen == [1.0, 2.0, 5.0]
    assert sync.anchor[0].item() == 1.0


@pytest.mark.parametrize("overlap", [1])
def test_a_checkpoint_keeps_a_sync_in_flight_and_a_resumed_run_lands_it_as_the_straight_one(overlap):
    straight = run(overlap, [1.0, 1.0, 4.0])[2]
    first, p, _ = run(overlap, [1.0, 1.0])
    state = first.state_dict()
    assert any(k.startswith("flight.") for k in state)
    resumed = OneReplica(first.mode, None, 1, 0, torch.device("cpu"))
    resumed.load_state_dict(state)
    resumed.after_backward([p], [])
    with torch.no_grad():
        p += 4.0
    resumed.after_step([p])
    assert p.item() == straight[-1]


def test_the_end_of_a_fit_lands_the_syncs_in_flight():
    sync, p, _ = run(1, [1.0, 1.0])  # the sync after step 2 is in flight
    sync.finish([p])
    assert p.item() == 1.0 and not sync._flights
