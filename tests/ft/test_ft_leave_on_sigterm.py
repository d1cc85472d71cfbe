"""A replica group that lost a process must not hold the other groups back.

When one process of a group dies, torchrun sends SIGTERM to the group's other processes. The one hosting the group's
torchft manager may then be waiting inside torchft for the dead rank (its commit vote, up to
``FaultTolerance.timeout``), where Python runs no signal handler, and Lightning's handler would only set a flag
anyway. While that process lives its manager heartbeats, and the lighthouse, which needs a majority of the groups
that heartbeat, forms no quorum for the others. The promise: a connected rank told to stop ends at once, so the other
groups wait about the lighthouse's heartbeat timeout, not the stopped group's commit timeout.

The stuck group here is one process, rank 0 of a group of 2 whose rank 1 never votes; the other group is the test
process itself, asking the lighthouse for a quorum and heartbeating as a manager would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 1000
COMMIT_TIMEOUT_S = 60  # the stuck rank's own wait: far longer than the promise allows the survivor to wait


def stuck_rank(lighthouse: str) -> None:
    """Rank 0 of replica group 1 (2 ranks, the other never comes): connect, then wait for the group's commit vote."""
    import torch
    import torch.distributed as dist

    from lightning_clapping.ft.config import FaultTolerance
    from lightning_clapping.ft.group import ReplicaGroup

    flagged = []
    signal.signal(signal.SIGTERM, lambda signum, frame: flagged.append(signum))  # as Lightning's: a flag, no exit
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = FaultTolerance(lighthouse=lighthouse, replica_group=1, num_replica_groups=2, host="127.0.0.1",
                            timeout=timedelta(seconds=COMMIT_TIMEOUT_S)).resolved({})
    group = ReplicaGroup(config, group_rank=0, group_size=2, device=torch.device("cpu"))
    group.connect(dict, lambda state: None)
    print("waiting", flush=True)
    try:
        group.should_commit()  # blocks in torchft: rank 1 of this group never votes
    except Exception as err:  # noqa: BLE001 - what ended the wait is the test's business, not this process's
        print(f"wait ended: {type(err).__name__}", flush=True)
    print("returned", flush=True)
    sys.exit(3)


def test_a_rank_told_to_stop_while_waiting_in_torchft_frees_the_other_groups_quorum():
    from torchft._torchft import LighthouseClient, LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=HEARTBEAT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_MS)
    address = lighthouse.address()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, __file__, address], stdout=subprocess.PIPE, stderr=errors, text=True,
                            env=env)

    def output() -> str:
        errors.seek(0)
        return (proc.stdout.read() if proc.poll() is not None else "") + errors.read()[-4000:]

    client = LighthouseClient(address, timedelta(seconds=10))
    stop = threading.Event()

    def heartbeat() -> None:  # the survivor's manager does this every 100 ms
        while not stop.is_set():
            client.heartbeat("survivor")
            time.sleep(0.1)

    beats = threading.Thread(target=heartbeat, daemon=True)
    try:
        line = proc.stdout.readline()
        assert line == "waiting\n", line + output()
        beats.start()
        time.sleep(HEARTBEAT_MS / 1000)
        # the precondition: while the stuck rank lives, the survivor alone gets no quorum
        with pytest.raises(Exception, match="(?i)timeout|timed out|cancelled"):
            client.quorum(replica_id="survivor", timeout=timedelta(seconds=2))
        os.kill(proc.pid, signal.SIGTERM)  # what torchrun does to the group's other processes
        told = time.monotonic()
        quorum = client.quorum(replica_id="survivor", timeout=timedelta(seconds=COMMIT_TIMEOUT_S // 2))
        waited = time.monotonic() - told
        assert [p.replica_id for p in quorum.participants] == ["survivor"]
        # the lighthouse's heartbeat timeout and room for a loaded machine: far below the stuck rank's commit timeout
        assert waited < HEARTBEAT_MS / 1000 + 9, f"the survivor waited {waited:.1f} s for its quorum"
        code = proc.wait(timeout=15)
        assert code == -signal.SIGTERM, f"exit code {code}: " + output()  # ended by the signal, not by its handler
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errors.close()
        lighthouse.shutdown()


if __name__ == "__main__":
    stuck_rank(sys.argv[1])
