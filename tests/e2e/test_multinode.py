"""Multi-node: two "nodes" on this machine, each a network namespace with one address on a shared bridge, and the
training script launched once per node, as users launch a multi-node Lightning job by hand.

    namespace <tag>r0  (node 0)  v0  10.77.0.1/24 --+
                                                    +-- bridge br0 in namespace <tag>sw
    namespace <tag>r1  (node 1)  v1  10.77.0.2/24 --+

The two nodes reach each other only over the bridge; the rendezvous is node 0's address. Every launch runs
``tests/scripts/multinode_run.py`` with ``Trainer(num_nodes=2, devices=2)``, through Lightning's own multi-node launch
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE``) or through ``torchrun``. Needs root and ``ip netns``
(skipped with the reason otherwise). The fixture kills what the test started and deletes the namespaces even when a
test fails, then fails the test if a namespace, an interface or a process of the run is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from _models import SequentialMLP, classification_data
from conftest import ROOT, SCRIPTS, host_links, netns_names

sys.path.insert(0, str(ROOT / "benchmarks"))

from _delay_link import _die_with_parent  # noqa: E402
from _netns import Endpoint, Lab, NetnsError  # noqa: E402

NODES, DEVICES = 2, 2
PORT = 29511  # inside the test's own namespaces: no other program's ports there
RUN_TIMEOUT = 240.0
# what multinode_run.py trains on: 24 samples, 3 steps, SGD with momentum from SequentialMLP's defaults
SAMPLES, STEPS, SEED, DATA_SEED = 24, 3, 0, 1
# variables that would tell Lightning or torch about another cluster than the one each test sets up
_FOREIGN_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "GLOO_SOCKET_IFNAME")


# ----------------------------------------------------------------------------------------------------------- helpers


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a run's output folder: only that run's processes)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path("/proc", pid, "cmdline").read_bytes()
            state = Path("/proc", pid, "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if text.encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


@dataclass
class TwoNodes:
    """The two node namespaces, where runs write, and the node launches started so far."""

    nodes: list[Endpoint]
    out: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def launch(self, case: str, launcher: str) -> list[str]:
        """Start one launch per node and wait for both; returns each node's output. Fails (after killing both) as
        soon as one node exits with an error, or when the run outlasts ``RUN_TIMEOUT``."""
        self.out.mkdir(parents=True, exist_ok=True)
        script = [str(SCRIPTS / "multinode_run.py"), str(self.out), case]
        base = {k: v for k, v in os.environ.items()
                if k not in _FOREIGN_ENV and not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
        base.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), base.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        master = self.nodes[0].addr
        logs = []
        for node, ep in enumerate(self.nodes):
            env = dict(base, GLOO_SOCKET_IFNAME=ep.ifname)
            if launcher == "lightning":
                env.update(MASTER_ADDR=master, MASTER_PORT=str(PORT), NODE_RANK=str(node),
                           WORLD_SIZE=str(NODES * DEVICES))
                argv = [sys.executable, *script]
            elif launcher == "torchrun":
                argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
                        str(DEVICES), "--node-rank", str(node), "--master-addr", master, "--master-port", str(PORT),
                        *script]
            else:
                raise ValueError(launcher)
            log = self.out / f"node{node}.log"
            logs.append(log)
            with open(log, "w") as fh:
                # its own session, so the fixture can kill the node's whole process tree and nothing else
                self.procs.append(subprocess.Popen(["ip", "netns", "exec", ep.ns, *argv], env=env, cwd=self.out,
                                                   stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                                   preexec_fn=_die_with_parent))
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return [log.read_text() for log in logs]
            failed = [(n, c) for n, c in enumerate(codes) if c not in (None, 0)]
            if failed or time.monotonic() > deadline:
                self.kill()
                why = f"node {failed[0][0]} exited with {failed[0][1]}" if failed else f"no end in {RUN_TIMEOUT:.0f} s"
                tails = "\n".join(f"--- node {n} ---\n{log.read_text()[-4000:]}" for n, log in enumerate(logs))
                pytest.fail(f"{case} launched with {launcher}: {why}\n{tails}")
            time.sleep(0.2)

    def kill(self) -> None:
        """Kill every process of the runs: each launch's session, and whatever else runs in the node namespaces
        (torchrun starts its workers in sessions of their own). Only this test's processes live there."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ep in self.nodes:
            pids = subprocess.run(["ip", "netns", "pids", ep.ns], capture_output=True, text=True, timeout=30).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10  # killed processes that are not our children vanish a moment later
        while _processes_mentioning(str(self.out)) and time.monotonic() < deadline:
            time.sleep(0.1)

    def ranks(self) -> list[dict]:
        files = sorted(self.out.glob("rank*.pt"))
        assert [f.name for f in files] == [f"rank{r}.pt" for r in range(NODES * DEVICES)], files
        return [torch.load(f) for f in files]


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")  # a killed test run still reaches the fixture's clean-up


@pytest.fixture
def two_nodes(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces need Linux")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` is missing (apt-get install -y iproute2)")
    tag = f"cmn{os.getpid() % 100000}n"  # the "n" ends it: no other run's tag starts with this one
    before = host_links()
    lab = Lab(tag=tag)
    cluster = None
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        try:
            nodes = lab.build_star(NODES)
        except (NetnsError, OSError, subprocess.SubprocessError) as err:
            pytest.skip(f"`ip netns` with veth pairs and a bridge does not work here: {err}")
        cluster = TwoNodes(nodes, tmp_path / "run")
        yield cluster
    finally:
        if cluster is not None:
            cluster.kill()
        undeleted = lab.teardown()
        signal.signal(signal.SIGTERM, previous)
    left = [f"namespace {n}" for n in sorted(netns_names()) if n.startswith(tag)]
    left += [f"namespace {n} (could not be deleted)" for n in undeleted]
    ours = {f"{kind}{i}" for kind in "vp" for i in range(NODES)} | {"br0"}  # the names Lab gives its links
    left += [f"interface {n} in this namespace" for n in sorted((host_links() - before) & ours)]
    left += [f"process {p}" for p in _processes_mentioning(str(tmp_path))]
    assert not left, f"left behind: {left}"


def _index_of(x: torch.Tensor, rows: torch.Tensor) -> list[int]:
    """Which samples of ``x`` a batch of inputs is (the data's rows are all different)."""
    return [int((x == row).all(1).nonzero().item()) for row in rows]


def _trained_alone(steps: list[list[int]]) -> dict[str, torch.Tensor]:
    """The weights of the same model trained in this one process, one optimizer step per list of sample indices."""
    torch.manual_seed(SEED)
    model = SequentialMLP(lr=0.1, optimizer="sgd")
    model.log = lambda *a, **k: None
    x, y = classification_data(n=SAMPLES, seed=DATA_SEED)
    opt = model.configure_optimizers()
    for k, idx in enumerate(steps):
        opt.zero_grad()
        model.training_step((x[idx], y[idx]), k).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _assert_weights(ranks: list[dict], expected: dict[str, torch.Tensor]) -> None:
    """Rank 0 ends with the whole model (the module in the launching process); every parameter any rank holds, on
    either node, equals ``expected``."""
    assert set(ranks[0]["params"]) == set(expected), "rank 0 does not hold the whole model after fit"
    for r, info in enumerate(ranks):
        for name, value in info["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=lambda m: f"rank {r} {name}: {m}")


def _assert_placement(ranks: list[dict], environment: str) -> None:
    for r, info in enumerate(ranks):
        assert (info["node_rank"], info["local_rank"]) == divmod(r, DEVICES), f"rank {r} ran on {info}"
        assert info["environment"] == environment, f"rank {r}: {info['environment']}"


# ------------------------------------------------------------------------------------------------------------- tests

ENVIRONMENT = {"lightning": "LightningEnvironment", "torchrun": "TorchElasticEnvironment"}


# Lightning's own multi-node launch is the one the 2 x 2 test below uses; one launch per style keeps CI short
@pytest.mark.parametrize("launcher", ["torchrun"])
def test_four_stages_on_two_nodes_train_like_one_process(two_nodes, launcher):
    """Ranks 0-1 on node 0, ranks 2-3 on node 1, one stage each: after 3 SGD steps the weights are those of one
    process trained on the same batches."""
    two_nodes.launch("pipeline", launcher)
    ranks = two_nodes.ranks()
    _assert_placement(ranks, ENVIRONMENT[launcher])
    x, _ = classification_data(n=SAMPLES, seed=DATA_SEED)
    in_order = [list(range(k * 8, (k + 1) * 8)) for k in range(STEPS)]
    for r, info in enumerate(ranks):  # one pipeline: every stage reads the DataLoader's own batches
        assert [_index_of(x, b) for b in info["inputs"]] == in_order, f"rank {r} trained on other batches"
    _assert_weights(ranks, _trained_alone(in_order))


def test_two_replicas_of_two_stages_train_like_one_process_on_both_batches(two_nodes):
    """stages=2 on 2 nodes x 2 devices: replica r is global ranks 2r, 2r+1 (one node each); the replicas split the
    data, and after 3 SGD steps every copy of the weights equals one process trained on both replicas' batches
    together (batch 2 x 4).

    The sampler Lightning injects (``use_distributed_sampler=True``, the default) shuffles training data even for a
    ``shuffle=False`` loader (as under DDP), so the global batch of each step is taken from what the replicas drew,
    not assumed to be every other sample in order."""
    two_nodes.launch("dp", "lightning")
    ranks = two_nodes.ranks()
    _assert_placement(ranks, ENVIRONMENT["lightning"])
    x, _ = classification_data(n=SAMPLES, seed=DATA_SEED)
    drawn = [[_index_of(x, b) for b in info["inputs"]] for info in ranks]
    for r in range(1, NODES * DEVICES, 2):  # the two stages of a replica read the same batches
        assert drawn[r] == drawn[r - 1], f"the stages of replica {r // 2} trained on different batches"
    replica = [drawn[0], drawn[2]]
    assert all(len(steps) == STEPS and all(len(b) == 4 for b in steps) for steps in replica), replica
    # the replicas split the data: together, one epoch of it, every sample once
    assert sorted(i for steps in replica for b in steps for i in b) == list(range(SAMPLES)), replica
    _assert_weights(ranks, _trained_alone([replica[0][k] + replica[1][k] for k in range(STEPS)]))
