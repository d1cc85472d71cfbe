"""Fault-tolerant replica groups (``fault_tolerance="torchft"``): a group that loses a process drops out, the others
keep training, and the restarted group rejoins with their state.

The promise runs with real SIGKILLs through Lightning: 2 replica groups x 2 stages, each group its own job (its own
torch.distributed world), a torchft lighthouse between them. The groups' processes are forked from the test process
(torch and Lightning are imported once), and the test restarts the group whose process it killed, as torchrun's
``--max-restarts`` does; ``benchmarks/replica_failure.py`` runs the same under torchrun itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_clapping.ft import wire
from lightning_clapping.ft.config import INSTALL_HINT, FaultTolerance, resolve
from lightning_clapping.comm.wire import WireError

torchft = pytest.importorskip("torchft", reason=f"needs torchft: {INSTALL_HINT}")

from conftest import _kill_group, _run_forked, free_port  # noqa: E402

SCRIPT = "ft_run.py"


@contextmanager
def lighthouse(heartbeat_ms: int = 2000, join_ms: int = 2000):
    """A torchft lighthouse in a process of its own; yields its address."""
    code = ("import time; from torchft._torchft import LighthouseServer; "
            f"l = LighthouseServer(bind='[::]:0', min_replicas=1, join_timeout_ms={join_ms}, "
            f"heartbeat_timeout_ms={heartbeat_ms}); print(l.address(), flush=True); time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("http"), address
        yield address
    finally:
        proc.kill()
        proc.wait()


class Group:
    """One replica group's processes (2 ranks of ``ft_run.py``), forked, with the launcher environment Lightning's
    own launcher would give them."""

    def __init__(self, index: int, out: Path, steps: int, env: dict[str, str]) -> None:
        self.index, self.out, self.steps, self.env = index, out, steps, env
        self.logs = Path(tempfile.mkdtemp(prefix=f"ft-group{index}-"))
        self.incarnations: list[list[int]] = []
        self.codes: dict[int, int] = {}

    def start(self) -> None:
        import lightning.pytorch  # noqa: F401 - imported once here, not in every fork

        port = str(free_port())
        pids = []
        for rank in range(2):
            env = {**self.env, "REPLICA_GROUP_ID": str(self.index), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "NODE_RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_forked(SCRIPT, [str(self.out), str(self.steps)], self.out, env, rank, self.logs,
                            len(self.incarnations) * 2 + rank)
            pids.append(pid)
        self.incarnations.append(pids)

    @property
    def pids(self) -> list[int]:
        return self.incarnations[-1]

    def poll(self) -> None:
        for pid in self.pids:
            if pid not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)

    def ended(self) -> bool:
        self.poll()
        return all(pid in self.codes for pid in self.pids)

    def stop(self) -> None:
        """What torchrun's agent does to a group whose worker failed: stop the rest (SIGTERM, then SIGKILL)."""
        deadline = time.monotonic() + 10
        for pid in self.pids:
            if pid not in self.codes:
                os.kill(pid, signal.SIGTERM)
        while not self.ended() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.pids:
            if pid not in self.codes:
                _kill_group(pid)
                self.codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def output(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.iterdir()))


def records(out: Path, group: int, rank: int) -> list[dict]:
    path = out / f"group{group}_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_with_failure(out: Path, victim_rank: int, lazy: bool, steps: int = 70, kill_at: int = 12,
                     timeout: float = 240, diloco: int = 0) -> dict:
    """Two groups; when group 1's rank ``victim_rank`` has done ``kill_at`` steps it is SIGKILLed, the rest of group 1
    is stopped and group 1 starts again. Returns what happened, for the assertions.

    Group 1 starts once group 0 has made its first step, and starts again once group 0 has made a step without it:
    a forked group starts in milliseconds, where a real one (torchrun, new interpreters) takes seconds. Started at
    once, either group could take the other's first step from it, or the restarted group could join before the
    survivors had trained alone; which one happened would depend on the machine's load."""
    with lighthouse() as address:
        env = {"TORCHFT_LIGHTHOUSE": address, "NUM_REPLICA_GROUPS": "2", "FT_TIMEOUT": "20", "FT_LAZY": str(int(lazy)),
               "FT_DILOCO": str(diloco or "")}
        groups = [Group(g, out, steps, env) for g in (0, 1)]
        deadline, killed, restarted = time.monotonic() + timeout, None, None
        groups[0].start()
        while not records(out, 0, 0) and not groups[0].ended() and time.monotonic() < deadline:
            time.sleep(0.05)
        groups[1].start()
        try:
            while not all(g.ended() for g in groups):
                assert time.monotonic() < deadline, "the run did not finish in time" + "".join(
                    g.output() for g in groups)
                victim_records = records(out, 1, victim_rank)
                if killed is None and len(victim_records) >= kill_at:
                    killed = {"pid": groups[1].pids[victim_rank], "t": time.time(),
                              "step": victim_records[-1]["step"]}
                    os.kill(killed["pid"], signal.SIGKILL)
                if killed is not None and restarted is None:
                    groups[1].poll()
                    if killed["pid"] in groups[1].codes:
                        groups[1].stop()
                    alone = [r for r in records(out, 0, 0) if r["step"] > killed["step"] and r["participants"] == 1]
                    if groups[1].ended() and (alone or groups[0].ended()):
                        restarted = time.time()
                        groups[1].start()
                time.sleep(0.05)
        finally:
            for g in groups:
                if not g.ended():
                    g.stop()
        outputs = {g.index: g.output() for g in groups}
    return {"groups": groups, "killed": killed, "restarted": restarted, "outputs": outputs}


def expected_inputs(group: int, lazy: bool, steps: int) -> list[float]:
    """The sum of the inputs of each step's batch that an uninterrupted group ``group`` trains on (ft_run.py's data)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from _models import classification_data
    from lightning_clapping import LazySamplingLoader

    x, y = classification_data(n=256, seed=1)
    out: list[float] = []
    if lazy:
        loader = LazySamplingLoader(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), p=0.5, seed=3,
                                    num_replicas=2, replica_rank=group)
        while len(out) < steps:
            out += [float(b[0].double().sum()) for b in loader]
        return out[:steps]
    shard = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=group, shuffle=True, seed=0)
    epoch = 0
    while len(out) < steps:
        shard.set_epoch(epoch)
        order = list(shard)
        out += [float(x[order[i:i + 8]].double().sum()) for i in range(0, len(order), 8)]
        epoch += 1
    return out[:steps]


@pytest.mark.parametrize("victim_rank, lazy, diloco", [(1, False, 0), (0, True, 0), (1, False, 4)],
                         ids=["stage0_killed", "stage1_and_its_manager_killed_lazy_data", "diloco_stage0_killed"])
def test_a_group_that_loses_a_process_rejoins_and_every_group_ends_bit_equal(tmp_path, victim_rank, lazy, diloco):
    """Every-step averaging, and DiLoCo (``replica_sync=DiLoCo(inner_steps=4)``: quorum and vote at each outer
    step only; a joining group also takes the anchor and the outer momentum, the outer step after the last inner
    step makes the groups equal)."""
    steps = 70
    run = run_with_failure(tmp_path, victim_rank, lazy, steps, diloco=diloco)
    groups, killed, outputs = run["groups"], run["killed"], run["outputs"]
    assert killed is not None and run["restarted"] is not None, outputs
    survivor, lost = groups
    # the survivors' processes ran through: one incarnation, both ended well
    assert len(survivor.incarnations) == 1 and all(survivor.codes[p] == 0 for p in survivor.pids), outputs[0]
    assert all(lost.codes[p] == 0 for p in lost.pids), outputs[1]
    for rank in (0, 1):
        recs = records(tmp_path, 0, rank)
        assert {r["pid"] for r in recs} == {survivor.pids[rank]}
        gaps = [b["t"] - a["t"] for a, b in zip(recs, recs[1:])]
        assert max(gaps) < 30, f"survivor rank {rank} paused {max(gaps):.1f} s"
        assert [r["step"] for r in recs] == list(range(1, steps + 1)), "the survivors never restarted a step"
    # the restarted group: joined within 60 s of its start, at the survivors' step, with their state
    again = [r for r in records(tmp_path, 1, 0) if r["pid"] == lost.pids[0]]
    assert again, outputs[1]
    first = next(r for r in again if r["committed"] and r["participants"] == 2)
    assert first["t"] - first["started"] < 60, f"rejoined {first['t'] - first['started']:.1f} s after its start"
    assert again[0]["heals"] >= 1 and again[0]["step"] > killed["step"] + 1
    survivor_at = {r["step"]: r for r in records(tmp_path, 0, 0)}
    assert all((survivor_at[r["step"]]["epoch"], survivor_at[r["step"]]["batch_idx"]) == (r["epoch"], r["batch_idx"])
               for r in again), "the restarted group is at another place in the epoch than the survivors"
    # every group trained on its own shard, the restarted one from where its shard was when it came back
    for g in (0, 1):
        want = expected_inputs(g, lazy, steps)
        for rank in (0, 1):
            got = {r["step"]: r["xsum"] for r in records(tmp_path, g, rank)}
            wrong = [s for s, v in got.items() if v != want[s - 1]]
            assert not wrong, f"group {g} rank {rank} trained on other batches at steps {wrong[:8]}"
    if diloco:  # votes at the outer steps only; a lost group costs the survivors at most the one it failed
        last = records(tmp_path, 0, 0)[-1]
        assert steps // diloco <= last["votes"] <= steps // diloco + 1, last
        assert last["votes_lost"] <= 1, last
    a, b = (torch.load(tmp_path / f"group{g}_final.pt") for g in (0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the groups' final weights differ"


@pytest.mark.parametrize("reused", [True, False], ids=["inside_a_reuse_window", "at_a_fresh_draw"])
def test_a_peers_lazy_loader_state_resumes_this_groups_own_shard_exactly(reused):
    """A restarted group takes the fit-loop state of a peer, whose lazy loader walks another shard: made this
    group's (:func:`~lightning_clapping.fault_tolerance._retarget`), it goes on as this group's uninterrupted loader."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from _models import classification_data
    from lightning_clapping import LazySamplingLoader
    from lightning_clapping.fault_tolerance import _retarget

    x, y = classification_data(n=256, seed=1)

    def loader(group):
        return LazySamplingLoader(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), p=0.5, seed=3,
                                  num_replicas=2, replica_rank=group)

    mine = loader(1)
    batches, fresh = [], []
    for i, b in enumerate(mine):
        batches.append(b[0])
        fresh.append(mine.batch_info(i).fresh)
    at = next(t for t in range(4, len(batches)) if fresh[t] is not reused)  # the first step the rejoined group runs
    peer = loader(0)
    for _, _ in zip(range(at), peer):
        pass
    rejoined = loader(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "exact resume is impossible"
        rejoined.load_state_dict(_retarget(peer.state_dict(), rejoined, 1))
        rest = [b[0] for b in rejoined]
    assert len(rest) == len(batches) - at
    assert all(torch.equal(a, b) for a, b in zip(rest, batches[at:]))


@pytest.mark.parametrize("committed", [True, False])
def test_the_optimizer_steps_only_when_torchft_commits_the_step(committed):
    """The step driver's gate (its ``optimizer_step``, which the strategy's calls): with torchft's sync the closure
    (forward, backward, average) always runs, once, and the update only when every rank of every live group got
    through the step."""
    from types import SimpleNamespace

    from lightning_clapping.fault_tolerance import TorchftSync
    from lightning_clapping.step_driver import StepDriver

    sync = TorchftSync.__new__(TorchftSync)
    sync.group, sync.config = SimpleNamespace(should_commit=lambda: committed), SimpleNamespace(replica_group=0)
    driver = StepDriver.__new__(StepDriver)
    driver.sync, driver.ties, driver._stage_params = sync, None, []
    driver.module = SimpleNamespace(trainer=SimpleNamespace(global_step=3))
    calls = []
    step = lambda closure: calls.append("step") or closure()  # noqa: E731 - Lightning's step calls the closure
    assert driver.optimizer_step(step, lambda: calls.append("closure") or 1.5) == 1.5
    assert calls == (["closure", "step"] if committed else ["closure"])


# ---------------------------------------------------------------------------------------------- the hand-over bytes
def test_the_rejoin_state_round_trips_without_pickle():
    state = {"module": {"w": torch.randn(3, 4), "b": torch.zeros(0, dtype=torch.bfloat16)},
             "optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}},
                           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": [0, 1]}]},
             "flags": [True, False, "x", 2.5, -1]}
    data = wire.encode(state)
    assert b"pickle" not in data and b"\x80\x04" not in data[:16]
    back = wire.decode(data)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert list(back["optimizer"]["state"]) == [0]
    assert torch.equal(back["module"]["w"], state["module"]["w"]) and back["module"]["b"].dtype == torch.bfloat16
    assert back["flags"] == state["flags"]


@pytest.mark.parametrize("cut", [0, 3, 13, 40, -1])
def test_a_damaged_rejoin_state_raises_wire_error(cut):
    data = bytearray(wire.encode({"w": torch.arange(4.0), "n": [1, 2]}))
    if cut >= 0:
        data = data[:cut]
    else:
        data[len(wire.MAGIC) + 8 + 5] ^= 0x55  # inside the JSON header
    with pytest.raises(WireError):
        wire.decode(bytes(data))


def test_an_object_that_is_not_plain_state_is_refused_on_the_sending_side():
    with pytest.raises(TypeError, match="cannot be sent to a rejoining replica"):
        wire.encode({"fn": print})


def test_fault_tolerance_settings_are_checked():
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID"):
        FaultTolerance(lighthouse="http://x:1", num_replica_groups=2).resolved(environ={})
    with pytest.raises(ValueError, match="must lie in"):
        FaultTolerance(lighthouse="http://x:1", replica_group=2, num_replica_groups=2).resolved(environ={})
    got = FaultTolerance().resolved(environ={"TORCHFT_LIGHTHOUSE": "http://h:1", "REPLICA_GROUP_ID": "1",
                                             "NUM_REPLICA_GROUPS": "3"})
    assert (got.lighthouse, got.replica_group, got.num_replica_groups) == ("http://h:1", 1, 3)
    with pytest.raises(ValueError, match="timeout"):
        resolve(FaultTolerance(timeout=timedelta(0)))
    with pytest.raises(TypeError):
        resolve("yes")


def test_a_groups_shard_skips_the_batches_taken_this_epoch_once():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_clapping.ft.sampler import shard_loader

    data = TensorDataset(torch.arange(40.0))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    sampler = shard_loader(loader, num_groups=2, group=1, seed=0)
    reference = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(3)
    reference.set_epoch(3)
    sampler.skip_once(2 * 4)
    assert len(loader) == 5
    assert torch.cat([b[0] for b in loader]).long().tolist() == list(reference)[8:]
    assert torch.cat([b[0] for b in loader]).long().tolist() == list(reference)  # the next pass is whole


def test_a_train_loader_that_cannot_be_sharded_is_refused_with_the_reason():
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

    from lightning_clapping.ft.sampler import shard_loader

    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(ValueError, match="LazySamplingDataModule"):
        shard_loader(loader, 2, 0, 0)
