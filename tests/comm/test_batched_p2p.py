"""Point-to-point messages go out in groups (batch_isend_irecv) that cannot deadlock under NCCL's semantics.

NCCL's sends may wait for the peer's receive, it ignores tags, and a rank's groups run one after the other. The
executor's ordered mode (``prepost=False``, NCCL's) keeps to that on every backend: tag 0 everywhere, and a group
starts only when the previous one has completed, sends included. gloo's sends also wait for the receive (checked
below), so on gloo a grouping that could deadlock under NCCL deadlocks here, and a wrong order pairs the wrong
messages.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import run_gloo_ranks
from lightning_clapping.comm.channel import PeerChannel, exchange
from lightning_clapping.comm.wire import Part, from_raw_bytes, pack, raw_bytes, unpack
from lightning_clapping.comm.p2p import P2PQueue

TIMEOUT = timedelta(seconds=10)  # a deadlock ends as a timeout in the worker, reported as an error
CPU = torch.device("cpu")

# (rank 0's shapes, rank 1's shapes), one exchange each: rank 1 changes size first, then both at once (a resize
# in each direction within one group), then rank 0 alone
SHAPES = ([(4, 8), (4, 8), (2, 8), (2, 8), (3, 8)], [(4, 8), (5, 8), (2, 8), (2, 8), (2, 8)])


def _message(shape, value: float) -> torch.Tensor:
    return pack([Part(0, torch.float32, shape, raw_bytes(torch.full(shape, float(value))))])


def _both_send_first(rank: int) -> list:
    """Both ranks send before they receive, in every exchange, with resizes; returns (shape, value) received."""
    queue = P2PQueue(ordered=True, timeout=TIMEOUT)
    out, into = (PeerChannel(1 - rank, purpose, CPU, prepost=False, timeout=TIMEOUT, queue=queue)
                 for purpose in (1 + rank, 2 - rank))  # one channel per direction, as the executor has
    got = []
    for i, shape in enumerate(SHAPES[rank]):
        sends = [out.send_ops(0, _message(shape, 10 * rank + i))]
        exchange(queue, sends, [(into, 0, None, f"exchange {i}")])
        p = unpack(into.recv(0))[0]
        got.append((p.shape, float(from_raw_bytes(p.payload, p.dtype, p.shape).mean())))
    queue.flush()
    return got


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _batches(rank: int, schedule: str, prepost: bool) -> dict:
    """Two training steps of a 2-stage executor, the second with a smaller micro-batch 2 (a resize each way).

    Records every batch_isend_irecv call of the second step as (sends, receives, bytes sent), and compares the
    stage's gradients with the one-process model's.
    """
    from lightning_clapping.pipeline.executor import PipelineExecutor
    from lightning_clapping.codecs.feedback import MessageRule
    from lightning_clapping.comm.placement import Placement, Topology
    from lightning_clapping.pipeline.partition import build_partition
    from lightning_clapping.pipeline.stage import StageRunner

    torch.manual_seed(0)
    net, reference = Net(), Net()
    reference.load_state_dict(net.state_dict())
    placement = Placement(Topology(2, 1, 2), rank, CPU)  # stage 1 on rank 0, as the strategy places them
    stage = placement.stage
    runner = StageRunner(net, build_partition(net, 2, ["second"]), stage=stage)
    runner.release_foreign_state()
    runner.install()
    executor = PipelineExecutor(runner, placement, lambda b, d, t: MessageRule("uncompressed", "identity", b, d),
                                schedule=schedule, prepost=prepost, timeout=TIMEOUT)
    recorded, real = [], dist.batch_isend_irecv

    def recording(ops):
        sends = [op for op in ops if op.op is dist.isend]
        recorded.append((len(sends), len(ops) - len(sends), sum(op.tensor.numel() for op in sends)))
        return real(ops)

    step = lambda x, j: net(x).pow(2).mean()  # noqa: E731
    stats = None
    for sizes in ([3, 3, 3, 3], [3, 3, 2, 3]):
        gen = torch.Generator().manual_seed(sum(sizes))
        micro = [torch.randn(k, 6, generator=gen) for k in sizes]
        weights = [k / sum(sizes) for k in sizes]
        net.zero_grad(set_to_none=True)
        recorded.clear()
        dist.batch_isend_irecv = recording
        try:
            _, stats = executor.train_step(micro, step, weights)
        finally:
            dist.batch_isend_irecv = real
    reference.zero_grad()
    sum(w * reference(x).pow(2).mean() for x, w in zip(micro, weights)).backward()
    mine = net.first if stage == 0 else net.second
    theirs = reference.first if stage == 0 else reference.second
    same = all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(mine.parameters(), theirs.parameters()))
    return {"batches": recorded, "bytes": stats.fwd_bytes + stats.bwd_bytes, "same_grads": same, "stage": stage}


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for name, run in [("both_send_first", lambda: _both_send_first(rank)),
                      *[((sched, prepost), lambda s=sched, p=prepost: _batches(rank, s, p))
                        for sched, prepost in (("1f1b", False), ("gpipe", False), ("1f1b", True))]]:
        try:
            out.put((name, rank, run()))
        except Exception as err:  # a deadlock: the wait timed out
            out.put((name, rank, f"error: {type(err).__name__}: {err}"))
            break
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    items, exitcodes = run_gloo_ranks(_worker, expected=8, timeout=300)
    return {(name, rank): value for name, rank, value in items}, exitcodes


def _get(ranks, name, rank):
    results, exitcodes = ranks
    value = results.get((name, rank), f"no result (exit codes {exitcodes})")
    assert not isinstance(value, str), value
    return value


def test_ranks_that_both_send_before_receiving_and_resize_at_once_exchange_in_order(ranks):
    for rank in (0, 1):
        peer = 1 - rank
        expected = [(shape, float(10 * peer + i)) for i, shape in enumerate(SHAPES[peer])]
        assert _get(ranks, "both_send_first", rank) == expected


# per stage, (sends, receives) per batch of the second step, micro-batch 2 resized both ways (see
# schedule.with_exchanges)
EXPECTED = {
    "1f1b": ([(1, 0), (1, 1), (1, 1), (1, 0), (1, 1), (0, 1), (0, 1)],  # f2 resized: its message follows alone
             [(0, 1), (1, 1), (1, 1), (0, 1), (1, 1), (1, 0), (1, 0)]),
    "gpipe": ([(1, 0)] * 5 + [(0, 1)] * 5, [(0, 1)] * 5 + [(1, 0)] * 5),  # the last forward's send goes alone
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_executor_issues_each_exchange_as_one_batch_and_matches_one_process(ranks, schedule):
    for rank in (0, 1):
        got = _get(ranks, (schedule, False), rank)
        assert got["same_grads"]
        assert [(s, r) for s, r, _ in got["batches"]] == EXPECTED[schedule][got["stage"]]


@pytest.mark.parametrize("key", [("1f1b", False), ("gpipe", False), ("1f1b", True)], ids=["ordered-1f1b",
                                                                                          "ordered-gpipe", "prepost"])
def test_every_byte_the_executor_counts_goes_through_batch_isend_irecv(ranks, key):
    for rank in (0, 1):
        got = _get(ranks, key, rank)
        assert got["same_grads"]
        assert sum(b for _, _, b in got["batches"]) == got["bytes"] > 0


def test_receives_posted_ahead_are_refused_where_nccl_matches_messages_by_order(monkeypatch):
    from types import SimpleNamespace

    from lightning_clapping.comm.placement import Placement, Topology
    from lightning_clapping.pipeline.executor import PipelineExecutor

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    runner, no_rules = SimpleNamespace(stage=0, num_stages=2), lambda boundary, direction, training: None
    cuda = Placement(Topology(2, 1, 2), 1, torch.device("cuda", 0))  # stage 0
    with pytest.raises(ValueError, match="prepost_receives=True .* NCCL matches point-to-point messages by their order"):
        PipelineExecutor(runner, cuda, no_rules, prepost=True)
    assert PipelineExecutor(runner, cuda, no_rules, prepost=False).queue.ordered
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # gloo matches CUDA tensors by tag too
    assert not PipelineExecutor(runner, cuda, no_rules, prepost=True).queue.ordered
