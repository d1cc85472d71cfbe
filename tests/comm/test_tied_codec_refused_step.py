"""fault_tolerance="torchft" with a compressed tied sum (tied_codec): a step that torchft's vote refuses applies no
update, so it must leave the error-feedback residual of the tied sum as it was; the next committed step then goes on
exactly as if the refused one had never run. The tied sum runs for real on two gloo ranks (the two stages holding the
copies); the vote is the step driver's gate on the update (its optimizer_step, with torchft's sync), with torchft's
vote on each step stood in for."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from conftest import run_gloo_ranks
from lightning_clapping.pipeline.partition import TiedGroup

GROUP = TiedGroup(("a.weight", "c.weight"), (0, 1))


def _grad(step: int, stage: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * step + stage))


def _vote_worker(rank, port, out):
    from lightning_clapping.codecs import get_codec
    from lightning_clapping.comm.ties import TiedGradients
    from lightning_clapping.fault_tolerance import TorchftSync
    from lightning_clapping.step_driver import StepDriver

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        residuals = {}
        for run, votes in (("refused", {0: True, 1: False, 2: True}), ("reference", {0: True, 2: True})):
            torch.manual_seed(0)
            model = nn.ModuleDict({"a": nn.Linear(3, 5), "c": nn.Linear(3, 5)})
            ties = TiedGradients([GROUP], rank, lambda s: s, None, torch.device("cpu"), get_codec("q4"),
                                 timedelta(seconds=20))
            param = model.get_parameter(GROUP.key_on(rank))
            optimizer = torch.optim.SGD([param], lr=0.1)
            # this rank's step driver with torchft's sync (replica group 0 of 2), whose vote gates the update
            sync = TorchftSync.__new__(TorchftSync)
            sync.config = SimpleNamespace(replica_group=0)
            driver = StepDriver.__new__(StepDriver)
            driver.sync, driver.ties, driver._stage_params = sync, ties, []
            driver.module = SimpleNamespace(trainer=SimpleNamespace(global_step=0))
            for step, committed in votes.items():
                sync.group = SimpleNamespace(should_commit=lambda c=committed: c)  # torchft's vote on this step
                before = {i: r.clone() for i, r in ties.residuals.items()}
                weight = param.detach().clone()

                def closure(step=step):  # Lightning's closure: training_step, then backward, where the sum runs
                    param.grad = _grad(step, rank)
                    ties.sum_gradients(model, step)

                # Lightning's optimizer step through the strategy: the closure, then the (gated) update
                driver.optimizer_step(lambda c: optimizer.step(c), closure)
                if not committed:
                    residuals["refused_kept"] = (before.keys() == ties.residuals.keys()
                                                 and all(torch.equal(before[i], ties.residuals[i]) for i in before))
                    residuals["refused_no_update"] = torch.equal(weight, param.detach())
            residuals[run] = {i: r.clone() for i, r in ties.residuals.items()}
            residuals[f"{run}_weight"] = param.detach().clone()
        out.put((rank, residuals))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def test_a_step_torchft_refuses_leaves_the_tied_residual_as_it_was():
    items, exitcodes = run_gloo_ranks(_vote_worker, expected=2, world=2, timeout=120)
    got = dict(items)
    assert len(got) == 2 and not any(isinstance(v, str) for v in got.values()), (got, exitcodes)
    for rank, r in got.items():
        assert r["refused_no_update"], rank  # the gate held the update back
        assert r["refused_kept"], f"stage {rank}: the refused step changed the tied sum's residual"
        # the committed step after it went on as if the refused step had never run
        assert r["refused"].keys() == r["reference"].keys() == {0}
        assert torch.equal(r["refused"][0], r["reference"][0]), rank
        assert torch.equal(r["refused_weight"], r["reference_weight"]), rank
