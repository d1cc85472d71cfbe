"""DiLoCo under fault tolerance (:class:`lightning_clapping.fault_tolerance.TorchftLocalUpdates`), one rank at a
time with a stand-in for torchft's manager: what the outer step averages and what a failed vote leaves behind. The
whole run (groups killed and restarted) is in ``test_fault_tolerance.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from lightning_clapping.fault_tolerance import TorchftLocalUpdates  # noqa: E402
from lightning_clapping.sync.config import DiLoCo  # noqa: E402
from lightning_clapping.sync.local_updates import LocalUpdates  # noqa: E402


class Manager:
    """torchft's all-reduce (SUM) with one peer group, whose contribution is ``peer``; and its vote."""

    def __init__(self, peer: torch.Tensor, commits: bool = True) -> None:
        self.peer, self.commits = peer, commits

    def allreduce(self, buf, reduce_op):
        buf += self.peer
        return SimpleNamespace(wait=lambda: buf)

    def num_participants(self):
        return 2


def seat(mode: DiLoCo, manager: Manager, healed: bool) -> TorchftLocalUpdates:
    sync = TorchftLocalUpdates.__new__(TorchftLocalUpdates)
    LocalUpdates.__init__(sync, mode, None, 2, 0, torch.device("cpu"))
    votes = []

    def should_commit():
        votes.append(manager.commits)
        return manager.commits

    sync.group = SimpleNamespace(manager=manager, quorum_open=True, heals=int(healed), should_commit=should_commit,
                                 votes=votes)
    sync.config, sync.healed, sync.lazy = SimpleNamespace(replica_group=1), healed, False
    return sync


def stepped(sync: TorchftLocalUpdates, start: torch.Tensor, after: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(start.clone())
    sync.after_backward([p], [])
    with torch.no_grad():
        p.copy_(after)
    sync.after_step([p])  # deferred: the outer step waits for the next batch's quorum
    return p


@pytest.mark.parametrize("healed", [False, True], ids=["trained_since_the_anchor", "healed_in_this_quorum"])
def test_the_outer_step_averages_the_groups_that_trained_and_no_group_that_just_healed(healed):
    """Outer SGD with lr 1 and no momentum moves the anchor by the average: both groups' changes, or, for a group
    that took a peer's state in this quorum (its parameters are a copy of the peer's), the peer's alone."""
    peer_delta = torch.tensor([1.0, -2.0])
    sync = seat(DiLoCo(inner_steps=1, outer_lr=1.0, momentum=0.0), Manager(torch.cat([peer_delta, torch.ones(1)])),
                healed)
    p = stepped(sync, torch.zeros(2), torch.tensor([-3.0, 4.0]))  # own change: anchor - params = [3, -4]
    assert sync.pending() == [0] and torch.equal(p.detach(), torch.tensor([-3.0, 4.0]))
    sync.before_batch()
    average = peer_delta if healed else (peer_delta + torch.tensor([3.0, -4.0])) / 2
    assert torch.equal(p.detach(), -average) and sync.pending() == []


def test_a_sync_the_vote_refuses_drops_the_inner_steps_and_keeps_the_outer_state():
    sync = seat(DiLoCo(inner_steps=1), Manager(torch.tensor([5.0, 5.0, 1.0]), commits=False), healed=False)
    p = stepped(sync, torch.tensor([1.0, 2.0]), torch.tensor([7.0, 7.0]))
    sync.before_batch()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0]))  # back at the anchor
    assert torch.equal(sync.anchor[0], torch.tensor([1.0, 2.0])) and sync.outer_steps == 0
    assert not sync.outer.state  # no momentum from a step that did not happen
    assert sync.pending() == [] and sync.group.votes == [False]


def test_inner_steps_need_no_quorum_and_commit_on_their_own():
    sync = seat(DiLoCo(inner_steps=4), Manager(torch.zeros(3)), healed=False)
    p = stepped(sync, torch.zeros(2), torch.ones(2))
    sync.group.quorum_open = False
    sync.before_batch()  # step 1 of 4: nothing due
    assert sync.commit(1) and sync.group.votes == [] and torch.equal(p.detach(), torch.ones(2))
