"""The liveness watchdog: a hung stage is found within seconds and the group ends; healthy stages are left alone.

Every scenario runs 3 real ranks (gloo over TCP on 127.0.0.1) forked from this process, so they start at once
(the package is already imported); the scenarios run side by side (one module fixture), each in its own directory,
where every rank writes what it saw as JSON. The gloo timeout is 120 s; a scenario that does not end within a few
seconds of the bound fails, and every child is SIGKILLed at the end.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_clapping.comm import failures
from lightning_clapping._compat import default_store
from lightning_clapping.comm.liveness import Watchdog, failure_key

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork, SIGSTOP and /proc")

GLOO_TIMEOUT = timedelta(seconds=120)
WORLD = 3


_PORTS_TAKEN: set[int] = set()


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, for one group's store. The scenarios' 18 processes start at
    once and open many connections; a port the kernel hands out (ephemeral) could be taken by one of them before
    the group's rank 0 binds it, and that group's ranks would fail to start."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _PORTS_TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_TAKEN.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _stage(rank: int) -> int:
    return WORLD - 1 - rank  # as in ClappingStrategy: the last stage runs on rank 0


# ---------------------------------------------------------------------- what the children do


def _wait_on(rank: int, peer: int, out: dict, ready: Path) -> None:
    """Block in a gloo receive from ``peer`` (inside failures.reported, as a training step is)."""
    buf = torch.zeros(4)
    try:
        with failures.reported(_stage(rank), rank, WORLD):
            work = dist.irecv(buf, src=peer)
            ready.touch()
            work.wait(GLOO_TIMEOUT)
        out["outcome"] = "received"
    except Exception as err:  # noqa: BLE001 - what ended the wait is the result
        out["outcome"] = type(err).__name__
        out["message"] = str(err)
    out["ended_at"] = time.monotonic()


def _hang(rank: int, wd: Watchdog, out: dict, ready: Path, target: int) -> None:
    if rank == target:  # the test stops this one once every rank waits
        ready.touch()
        time.sleep(60)
        return
    _wait_on(rank, target, out, ready)
    if rank == 0:
        time.sleep(1.0)  # rank 0 (serving the store) ends a moment later, as after Lightning's teardown


def _hang_blocked_elsewhere(rank: int, wd: Watchdog, out: dict, ready: Path, target: int) -> None:
    # rank 2 is blocked where no closed socket can wake it (here a lock nobody releases): its watchdog must end
    # its process
    if rank == 2:
        ready.touch()
        threading.Event().wait(60)
        out["outcome"] = "the wait returned"
        return
    _hang(rank, wd, out, ready, target)


def _store_host_hangs(rank: int, wd: Watchdog, out: dict, ready: Path, target: int) -> None:
    # rank 0 (the store's host) is stopped; rank 1 waits on it, rank 2 on rank 1 (a cascade)
    if rank == 0:
        ready.touch()
        time.sleep(60)
        return
    _wait_on(rank, rank - 1, out, ready)


def _healthy(rank: int, wd: Watchdog, out: dict, ready: Path, bound: float) -> None:
    if rank == 2:  # finishes first: stops its watchdog and stays alive, sending no heartbeat
        ready.touch()
        began = time.monotonic()
        wd.stop()
        out["stop_s"] = time.monotonic() - began
        out["threads_after_stop"] = [t.name for t in threading.enumerate() if t.name.startswith("clapping-liveness")]
        time.sleep(2.5 * bound)
    elif rank == 1:  # a long step (2 x bound) in the main thread, then the result; ends without stop(): atexit
        ready.touch()
        time.sleep(2 * bound)
        dist.send(torch.ones(4), dst=0)
        out["sent"] = True
    else:  # waits for rank 1, then keeps watching the two finished ranks for longer than the bound
        _wait_on(rank, 1, out, ready)
        time.sleep(1.5 * bound)
        store = default_store()
        out["failure_keys"] = [r for r in range(WORLD) if store.check([failure_key(r)])]
        out["hung_before_stop"] = [h.rank for h in wd.hung]
        dist.destroy_process_group()  # stop() must not need the process group any more
        began = time.monotonic()
        wd.stop()
        out["stop_s"] = time.monotonic() - began


def _group_stopped(rank: int, wd: Watchdog, out: dict, ready: Path, bound: float) -> None:
    # the test stops and resumes every rank (as Ctrl-Z and `fg` do); then each keeps watching for longer than the bound
    ready.touch()
    while not (ready.parent / "resumed").exists():
        time.sleep(0.02)
    time.sleep(1.5 * bound)


SCENARIOS = {
    "hang": _hang,
    "hang_blocked_elsewhere": _hang_blocked_elsewhere,
    "store_host": _store_host_hangs,
    "healthy": _healthy,
    "group_stopped": _group_stopped,
}


def _child(scenario: str, rank: int, port: int, out_dir: str, interval: float, bound: float, fake_hosts: bool,
           arg: object) -> None:
    atexit._clear()  # forked: drop pytest's exit handlers; only what this child registers runs at its end
    err = os.open(Path(out_dir) / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)  # what the watchdog says (e.g. why it ended this process) is kept for the test's message
    sys.stderr = open(2, "w", closefd=False)  # pytest's capture replaced the object; write to the file itself
    out: dict = {"rank": rank}
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=GLOO_TIMEOUT)
        wd = Watchdog(default_store(), rank, WORLD, stage_of_rank=_stage, interval=interval, bound=bound,
                      host=f"host-{rank}" if fake_hosts else None).start()
        SCENARIOS[scenario](rank, wd, out, Path(out_dir) / f"ready{rank}", arg)
        out["hung"] = [{"rank": h.rank, "stage": h.stage, "action": h.action, "reason": h.reason} for h in wd.hung]
        if scenario != "healthy":
            wd.stop()
    except BaseException as err:  # noqa: BLE001
        out["crash"] = f"{type(err).__name__}: {err}"
    path.write_text(json.dumps(out))
    atexit._run_exitfuncs()  # what the interpreter does at a normal exit (multiprocessing skips it)
    os._exit(0)


@dataclass
class _Plan:
    """One scenario: its ranks' behaviour and what the test does to them once every rank waits."""

    scenario: str
    interval: float
    bound: float
    fake_hosts: bool = False  # every rank claims its own host: nobody may kill another
    arg: object = None
    stop_rank: int | None = None  # SIGSTOP this rank
    stop_all_for: float = 0.0  # or SIGSTOP every rank for this long (staggered, see _drive), then SIGCONT
    wait_for: tuple[int, ...] = (0, 1, 2)
    limit: float = 20.0  # seconds the ranks in wait_for get to end


def _fork(plan: _Plan, out_dir: Path) -> list:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(plan.scenario, r, port, str(out_dir), plan.interval, plan.bound,
                                              plan.fake_hosts, plan.arg)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def _drive(plan: _Plan, procs: list, out_dir: Path) -> tuple[dict[int, dict], dict]:
    """Stop ranks as planned, wait for the ranks to end; return each rank's record and what the test saw."""
    seen: dict = {}
    try:
        deadline = time.monotonic() + 60
        while not all((out_dir / f"ready{r}").exists() for r in range(WORLD)):
            assert time.monotonic() < deadline, "the ranks did not start"
            if not all(p.is_alive() for p in procs):
                ended = {r: (out_dir / f"rank{r}.json").read_text() if (out_dir / f"rank{r}.json").exists() else
                         (p.exitcode, (out_dir / f"rank{r}.err").read_text(errors="replace")[-2000:])
                         for r, p in enumerate(procs) if not p.is_alive()}
                raise AssertionError(f"a rank ended before it was ready: {ended}")
            time.sleep(0.05)
        time.sleep(0.3)  # let the receives block
        if plan.stop_rank is not None:
            os.kill(procs[plan.stop_rank].pid, signal.SIGSTOP)
            seen["stopped_at"] = time.monotonic()
        if plan.stop_all_for:
            # the worst case of a stop of the whole group: rank 0 sees the others silent for a moment (2 intervals)
            # before it stops too, and again after it resumes first
            for r in (1, 2, 0):
                os.kill(procs[r].pid, signal.SIGSTOP)
                time.sleep(0.5 if r == 2 else 0)
            time.sleep(plan.stop_all_for)
            for r in (0, 1, 2):
                os.kill(procs[r].pid, signal.SIGCONT)
                time.sleep(0.5 if r == 0 else 0)
            (out_dir / "resumed").touch()
        deadline = time.monotonic() + plan.limit
        seen["joined_at"] = {}
        for r in plan.wait_for:
            procs[r].join(max(0.0, deadline - time.monotonic()))
            seen["joined_at"][r] = time.monotonic()
        seen["exitcodes"] = {r: p.exitcode for r, p in enumerate(procs)}  # None: still running (or stopped)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # also ends a stopped process
            p.join(5)
    records = {}
    for r in range(WORLD):
        f = out_dir / f"rank{r}.json"
        records[r] = json.loads(f.read_text()) if f.exists() else {}
    return records, seen


INTERVAL, BOUND = 0.25, 2.0
PLANS = {
    "same_host": _Plan("hang", INTERVAL, BOUND, arg=1, stop_rank=1),
    "other_host": _Plan("hang", INTERVAL, BOUND, fake_hosts=True, arg=1, stop_rank=1, wait_for=(0, 2)),
    "blocked_elsewhere": _Plan("hang_blocked_elsewhere", INTERVAL, BOUND, fake_hosts=True, arg=1, stop_rank=1,
                               wait_for=(0, 2)),
    "store_host": _Plan("store_host", INTERVAL, BOUND, stop_rank=0),
    # rank 1 computes for 2 x bound, rank 2 stops its watchdog early and lingers, rank 1 ends through atexit
    "healthy": _Plan("healthy", 0.5, 2.0, fake_hosts=True, arg=2.0),
    "group_stopped": _Plan("group_stopped", 0.25, 1.2, arg=1.2, stop_all_for=1.8),
}


WAVES = (("same_host", "other_host", "blocked_elsewhere"), ("store_host", "healthy", "group_stopped"))
assert sorted(n for wave in WAVES for n in wave) == sorted(PLANS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The scenarios side by side (they are independent process groups), in waves of three: name -> future of
    (records, seen). All six at once (18 processes starting together on 2 cores) starved the stores of their
    first heartbeats for longer than these short bounds, and a watchdog then rightly declared a rank that had not
    started yet."""
    forked, futures = {}, {}
    try:
        for wave in WAVES:
            for name in wave:  # fork from this thread alone, while no driving thread exists
                out_dir = tmp_path_factory.mktemp(name)
                forked[name] = (out_dir, _fork(PLANS[name], out_dir))
            with ThreadPoolExecutor(len(wave)) as pool:
                for name in wave:
                    out_dir, procs = forked[name]
                    futures[name] = pool.submit(_drive, PLANS[name], procs, out_dir)
                for name in wave:
                    futures[name].exception()  # wait for the wave
        yield futures
    finally:
        for _, procs in forked.values():
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(5)


# ---------------------------------------------------------------------- a hung peer

def test_stopped_stage_on_same_host_is_killed_and_rank0_names_it(runs):
    records, seen = runs["same_host"].result()
    codes = seen["exitcodes"]
    assert codes[1] == -signal.SIGKILL, f"the stopped rank was not killed by a watchdog: exit codes {codes}"
    assert codes[0] == 0 and codes[2] == 0, f"ranks did not end within the limit: {codes}, {records}"
    rank0 = records[0]
    assert rank0["outcome"] == "StageFailure", rank0
    assert "stage 1 (rank 1, pid" in rank0["message"] and "sent no heartbeat" in rank0["message"], rank0["message"]
    assert "killed it (SIGKILL)" in rank0["message"], rank0["message"]
    for r in (0, 2):
        took = records[r]["ended_at"] - seen["stopped_at"]
        print(f"rank {r} ended {took:.2f} s after rank 1 was stopped (bound {BOUND} s)")
        assert took < BOUND + 3, f"rank {r} took {took:.1f} s to end"
    assert records[2]["outcome"] in ("RuntimeError", "DistBackendError"), records[2]


def test_stopped_stage_on_other_host_gets_its_connections_closed(runs):
    # every rank claims its own host: nobody may kill the stopped process, the others close their sockets to it
    records, seen = runs["other_host"].result()
    codes = seen["exitcodes"]
    assert codes[1] is None, f"a process on 'another host' was killed: {codes}"
    assert codes[0] == 0 and codes[2] == 0, f"ranks did not end within the limit: {codes}, {records}"
    rank0 = records[0]
    assert rank0["outcome"] == "StageFailure", rank0
    assert "stage 1 (rank 1, pid" in rank0["message"] and "closed its connections" in rank0["message"]
    assert [h["action"] for h in rank0["hung"]] == ["connections closed"], rank0["hung"]
    for r in (0, 2):
        took = records[r]["ended_at"] - seen["stopped_at"]
        print(f"rank {r} ended {took:.2f} s after rank 1 was stopped (bound {BOUND} s)")
        assert took < BOUND + 3, f"rank {r} took {took:.1f} s to end"


def test_rank_blocked_where_no_socket_wakes_it_ends_its_own_process(runs):
    # other hosts again; rank 2 waits on a lock, which closing connections does not wake: after one more bound
    # its watchdog ends the process (exit code 1) so that the group still ends; rank 0 still names the hung stage
    records, seen = runs["blocked_elsewhere"].result()
    codes = seen["exitcodes"]
    assert codes[0] == 0 and codes[2] == 1 and codes[1] is None, (codes, records)
    assert records[0]["outcome"] == "StageFailure" and "stage 1 (rank 1" in records[0]["message"], records[0]
    assert records[2] == {}, records[2]  # it never got to write its record: os._exit
    took = seen["joined_at"][2] - seen["stopped_at"]
    print(f"rank 2 ended itself {took:.2f} s after rank 1 was stopped (bound {BOUND} s)")
    assert took < 2 * BOUND + 3, f"rank 2 took {took:.1f} s to end"


def test_stopped_store_host_is_found_through_the_store_and_killed(runs):
    # rank 0 serves the store: stopped, it answers no store call (their own timeout does not help)
    records, seen = runs["store_host"].result()
    codes = seen["exitcodes"]
    assert codes[0] == -signal.SIGKILL, f"the stopped store host was not killed: {codes}"
    assert codes[1] == 0 and codes[2] == 0, f"ranks did not end within the limit: {codes}, {records}"
    detected = [h for r in (1, 2) for h in records[r]["hung"]]
    assert detected and all(h["rank"] == 0 and "did not answer" in h["reason"] for h in detected), records
    for r in (1, 2):
        took = records[r]["ended_at"] - seen["stopped_at"]
        print(f"rank {r} ended {took:.2f} s after rank 0 was stopped (bound {BOUND} s)")
        assert took < BOUND + 3, f"rank {r} took {took:.1f} s to end"


# ---------------------------------------------------------------------- no misfire


def test_long_step_is_not_declared_hung(runs):
    records, seen = runs["healthy"].result()
    assert seen["exitcodes"] == {0: 0, 1: 0, 2: 0}, (seen, records)
    assert records[0]["outcome"] == "received" and records[1].get("sent"), records
    assert all(records[r]["hung"] == [] for r in range(WORLD)), records


def test_ranks_that_finish_early_are_not_declared_hung(runs):
    records, seen = runs["healthy"].result()
    assert "crash" not in records[0], records[0]
    assert records[0]["hung_before_stop"] == [] and records[0]["failure_keys"] == [], records[0]
    assert records[2]["threads_after_stop"] == [], records[2]
    assert records[2]["stop_s"] < 1.0 and records[0]["stop_s"] < 1.0, records


def test_whole_group_stopped_and_resumed_is_not_declared_hung(runs):
    # Ctrl-Z stops every rank; after `fg` each watchdog's own clock jumped by more than the bound: none may blame
    # the others (they restart their timers when their own threads did not run for bound / 2)
    records, seen = runs["group_stopped"].result()
    assert seen["exitcodes"] == {0: 0, 1: 0, 2: 0}, (seen, records)
    assert all(records[r]["hung"] == [] for r in range(WORLD)), records


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 1.0, "bound": 1.0}, "at least 4 x the heartbeat interval"),
        ({"interval": 1.0, "bound": 0.5}, "at least 4 x the heartbeat interval"),
        ({"interval": 0.0, "bound": 3.0}, "interval must be a positive number"),
        ({"interval": -1.0, "bound": 3.0}, "interval must be a positive number"),
        ({"interval": 0.5, "bound": 0}, "bound must be a positive number"),
        ({"interval": 0.5, "bound": float("inf")}, "bound must be a positive number"),
        ({"interval": 0.5, "bound": 3.0, "rank": 3}, "rank must be an int in 0..2"),
        ({"interval": 0.5, "bound": 3.0, "stage_of_rank": [0, 1]}, "2 entries for 3 ranks"),
        ({"interval": 0.5, "bound": 3.0, "store_rank": 5}, "store_rank must be None, .env. or an int"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    rank = kwargs.pop("rank", 0)
    with pytest.raises(ValueError, match=message):
        Watchdog(object(), rank, 3, **kwargs)


def test_single_process_needs_no_threads():
    wd = Watchdog(None, 0, 1, interval=0.5, bound=3.0).start()
    assert wd.alive_threads == []
    wd.stop()
