"""A whole-job restart (``torchrun --max-restarts``, ``ModelCheckpoint(save_last=True)``, ``fit(ckpt_path="last")``)
heals after a process is SIGKILLed, and ends where the uninterrupted run ends.

The runs use torchrun's own agent (``torch.distributed.run``: its argument parser, its rendezvous, its store and its
restarts) with the workers forked (``--start-method fork``, as torchrun does for a function entry point) so that no
worker pays the imports of torch and Lightning again. ``benchmarks/restart_heal.py`` runs the ``torchrun`` command.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import SCRIPTS, free_port, launch_forked

from lightning_clapping import launcher

sys.path.insert(0, str(SCRIPTS))


def _torchrun(out, max_restarts: int, *worker_args: str) -> None:
    """``torchrun --nproc-per-node 3 --max-restarts N restart_run.py OUT ...``, its workers forked from this process."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    import restart_run

    args = torchrun.parse_args(["--nproc-per-node", "3", "--max-restarts", str(max_restarts), "--master-port",
                                str(free_port()), "--start-method", "fork", "restart_run.py", str(out), *worker_args])
    config, _, _ = torchrun.config_from_args(args)
    elastic_launch(config, restart_run.run)(str(out), *worker_args)


def _events(out) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_a_sigkilled_run_restarted_by_torchrun_heals_and_ends_bit_equal_to_the_uninterrupted_run(tmp_path):
    """Rank 1 is SIGKILLed in epoch 2; in the restarted round rank 2 connects 2 s after the others. Before the fix
    those others read rank 2's address of the killed round from torchrun's store and the restart failed."""
    reference, healed = tmp_path / "reference", tmp_path / "healed"
    for out in (reference, healed):
        out.mkdir()
    launch_forked(_torchrun, reference, 0, "--timeout", "20", ranks=None, cwd=reference, timeout=120)
    proc = launch_forked(_torchrun, healed, 1, "--kill-at", "9", "--late-rank", "2", "--late-s", "2", "--timeout",
                         "20", ranks=None, cwd=healed, timeout=120, expect_ok=False)
    assert proc.returncode == 0, f"the restart did not heal:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    events = _events(healed)
    assert [e["kill"] for e in events if "kill" in e] == [9]
    resumed = [e["step"] for e in events if "step" in e and e["round"] == 1]
    assert resumed == list(range(7, 19)), resumed  # from the checkpoint at the end of epoch 1 (step 6) to the end
    expected, got = torch.load(reference / "final.pt"), torch.load(healed / "final.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "the healed run's weights differ"


# ------------------------------------------------------------------------------------------ the round's name
def _round(store, world: int, late: dict[int, float] | None = None) -> list[str]:
    """Every rank of one start of a job (a thread each) asks ``round_token`` for the start's name."""
    tokens: list[str | None] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            threading.Event().wait((late or {}).get(r, 0.0))
            tokens[r] = launcher.round_token(store.clone(), r, world, timedelta(seconds=20))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return tokens


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    yield server


def test_every_start_agrees_on_a_name_no_earlier_start_of_the_job_used(store):
    """Three starts on one store, as torchrun's agent keeps it across restarts; ranks that ask late (rank 0 last,
    then another rank last) still get this start's name, never the one the keys of the previous start hold."""
    first = _round(store, 4)
    second = _round(store, 4, late={0: 0.3})
    third = _round(store, 4, late={2: 0.3})
    assert len(set(first)) == len(set(second)) == len(set(third)) == 1
    assert len({first[0], second[0], third[0]}) == 3


def test_a_rank_whose_peers_never_come_fails_with_the_reason(store):
    with pytest.raises(RuntimeError, match=r"rank 0 waited .* for ranks \[1, 2\]"):
        launcher.round_token(store, 0, 3, timedelta(seconds=0.3))
    with pytest.raises(RuntimeError, match="rank 0 never answered"):
        launcher.round_token(store.clone(), 2, 3, timedelta(seconds=0.3))
