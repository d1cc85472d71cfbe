"""What a lost process costs with fault-tolerant replica groups (``fault_tolerance="torchft"``).

    python benchmarks/replica_failure.py [--quick] [--trials N] [--out benchmarks/results]

Each trial is the documented launch recipe on one machine: a torchft lighthouse, then one ``torchrun
--nproc-per-node 2 --max-restarts 3`` per replica group (2 groups x 2 stages of an MLP, 8 samples per group and
step, SGD with momentum). Once group 1 has trained ``KILL_AT`` steps, one of its processes is SIGKILLed (trials
alternate between its rank 1, stage 0, and its rank 0, stage 1, which also hosts the group's torchft manager);
torchrun restarts group 1, which rejoins. Every rank logs each step (``--worker``). Per failure:

* ``steps_lost``: optimizer steps computed (backward done) and then discarded, not committed: on the survivors, and
  on the failed group's dead incarnation (its steps since it last held the shared state);
* ``seconds_paused``: the longest wall-clock gap between two consecutive optimizer steps on a surviving rank, minus
  the median step time (the same definitions as the whole-job restart benchmark), wherever it happened (on a busy
  machine that can be a stall of the scheduler); ``seconds_paused_at_kill``: the same over the steps from the one in
  flight at the SIGKILL to the first that the survivors commit without group 1; ``seconds_paused_at_rejoin``: the
  gap that ends at the first step they take with group 1 again (its heal);
* ``restart_to_first_commit_s``: from the restarted group's process start to its first committed step, and
  ``kill_to_first_commit_s`` from the SIGKILL (torchrun's detection and restart, interpreter start-up and imports);
* ``bit_equal``: whether both groups end with bitwise equal weights;
* ``group1_starts``: how many times torchrun started group 1 (its incarnations, each writing a ``start`` record with
  torchrun's ``TORCHELASTIC_RESTART_COUNT`` before anything else), 2 when the restart after the kill worked at once;
  ``group1_exits``: for every incarnation that ended before the run did, torchrun's exit line and the errors its
  ranks raised (from ``group1.log``).

A group that trains without peers sleeps ``ALONE_SLEEP_S`` per step, so that the survivors are still training when
the restarted group is back however long its interpreters take to start on this machine (up to that much of a
survivor's longest gap is this sleep; the step times in the results are measured with both groups training).

Saves ``replica_failure.json``. ``--quick``: one trial, fewer steps (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.time()
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

KILL_AT = 15
MODES = {"full": (500, 3), "quick": (300, 1)}  # steps, trials
ALONE_SLEEP_S = 0.5  # a group training without peers sleeps this long per step (see the module docstring)
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"]
TIMEOUT_S = 20  # the groups' collective timeout (FaultTolerance.timeout)
MAX_RESTARTS = 3  # torchrun's --max-restarts for each group


# ---------------------------------------------------------------------------------------------- one replica group
def worker(out: Path, steps: int) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    path = out / f"group{os.environ['REPLICA_GROUP_ID']}_rank{int(os.environ['RANK'])}_{os.getpid()}.jsonl"
    with open(path, "a") as f:  # first, so that an incarnation that fails before its first step is counted too
        f.write(json.dumps({"t": time.time(), "started": STARTED, "kind": "start", "restart": restart}) + "\n")

    from datetime import timedelta

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_clapping
    from lightning_clapping.fault_tolerance import replica_group

    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                                     nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Log(L.Callback):
        def __init__(self) -> None:
            self.path = path

        def write(self, **record) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "started": STARTED, "restart": restart, **record}) + "\n")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.write(kind="computed", step=trainer.global_step + 1)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            votes = replica_group(trainer).votes
            self.write(kind="step", step=trainer.global_step, committed=votes[-1][2], participants=votes[-1][3],
                       heals=replica_group(trainer).heals)
            if votes[-1][3] < 2:
                time.sleep(ALONE_SLEEP_S)

    torch.manual_seed(group)
    x, y = torch.randn(4096, 32), torch.randint(0, 4, (4096,))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    ft = lightning_clapping.FaultTolerance(timeout=timedelta(seconds=TIMEOUT_S))
    strategy = lightning_clapping.ClappingStrategy(stages=2, microbatches=2, fault_tolerance=ft, log_bytes=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Log()])
    model = MLP()
    trainer.fit(model, train_dataloaders=data)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / f"group{group}_final.pt")


# ---------------------------------------------------------------------------------------------- one trial
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(out: Path, group: int) -> dict[int, list[dict]]:
    """Per process id, its records in order (both ranks of the group, every incarnation)."""
    by_pid: dict[int, list[dict]] = {}
    for path in sorted(out.glob(f"group{group}_rank*_*.jsonl")):
        pid = int(path.stem.rsplit("_", 1)[1])
        by_pid[pid] = [json.loads(line) for line in path.read_text().splitlines()]
    return by_pid


def trial(out: Path, steps: int, victim_rank: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    lighthouse_bin = shutil.which("torchft_lighthouse")
    if lighthouse_bin is None:
        raise SystemExit("torchft_lighthouse not found: pip install torchft")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "NUM_REPLICA_GROUPS": "2"}
    logs = [open(out / name, "w") for name in ("lighthouse.log", "group0.log", "group1.log")]  # noqa: SIM115
    lighthouse = subprocess.Popen([lighthouse_bin, "--bind", f"[::]:{port}", *LIGHTHOUSE_ARGS], stdout=logs[0],
                                  stderr=subprocess.STDOUT)
    groups = []
    for g in (0, 1):
        cmd = ["torchrun", "--nproc-per-node", "2", "--max-restarts", str(MAX_RESTARTS), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(Path(__file__).resolve()), "--worker", str(out),
               str(steps)]
        groups.append(subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": str(g)}, stdout=logs[g + 1],
                                       stderr=subprocess.STDOUT, start_new_session=True))
    killed = None
    try:
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in groups) and time.monotonic() < deadline:
            for path in out.glob(f"group1_rank{victim_rank}_*.jsonl") if killed is None else ():
                if path.read_text().count('"kind": "step"') >= KILL_AT:
                    pid = int(path.stem.rsplit("_", 1)[1])
                    os.kill(pid, signal.SIGKILL)
                    killed = {"pid": pid, "t": time.time()}
            time.sleep(0.05)
    finally:
        for p in groups:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        lighthouse.kill()
        lighthouse.wait()
        for f in logs:
            f.close()
    return measure(out, killed, [p.returncode for p in groups], victim_rank)


def _exits(log: str) -> list[dict]:
    """Each ended incarnation in torchrun's output (``group1.log``): torchrun's line about the failed rank and the
    errors the incarnation's ranks raised (the last line of each traceback), in order."""
    exits, errors = [], []
    for line in log.splitlines():
        if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception|Exit)\b", line):
            errors.append(line[:240])
        elif "failed (exitcode:" in line:
            exits.append({"torchrun": line[line.index("failed (exitcode:"):][:160], "errors": errors})
            errors = []
    return exits


def measure(out: Path, killed: dict | None, codes: list[int], victim_rank: int) -> dict:
    import torch

    survivors, lost = _records(out, 0), _records(out, 1)
    log = (out / "group1.log").read_text(errors="replace")
    result: dict = {"victim": f"group 1 rank {victim_rank} (stage {1 - victim_rank})", "exit_codes": codes,
                    "group1_starts": len({r["restart"] for recs in lost.values() for r in recs if "restart" in r}),
                    "group1_exits": _exits(log),
                    "group1_mesh_failures": log.count("RuntimeError: Gloo connectFullMesh failed"),
                    "killed": killed is not None, "survivor_processes": len(survivors)}
    paused, at_kill, at_rejoin, survivor_lost = [], [], [], 0
    for recs in survivors.values():
        steps = [r for r in recs if r["kind"] == "step"]
        gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])]
        together = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if a["participants"] == b["participants"] == 2]
        median = statistics.median(together or gaps)  # the step time with both groups training
        paused.append(max(gaps) - median)
        survivor_lost = max(survivor_lost, sum(not r["committed"] for r in steps))
        result["median_step_s"] = round(median, 4)
        if killed is not None:  # the gaps from the step in flight at the kill to the first one committed alone
            pairs = [(a, b) for a, b in zip(steps, steps[1:]) if b["t"] > killed["t"]]
            alone = next((i for i, (a, b) in enumerate(pairs) if b["committed"] and b["participants"] == 1), None)
            if alone is not None:
                at_kill.append(max(b["t"] - a["t"] for a, b in pairs[:alone + 1]) - median)
            back = next(((a, b) for a, b in pairs if a["participants"] == 1 and b["participants"] == 2), None)
            if back is not None:
                at_rejoin.append(back[1]["t"] - back[0]["t"] - median)
    result["seconds_paused"] = round(max(paused), 3)
    if at_kill:
        result["seconds_paused_at_kill"] = round(max(at_kill), 3)
    if at_rejoin:
        result["seconds_paused_at_rejoin"] = round(max(at_rejoin), 3)
    result["steps_lost_survivors"] = survivor_lost
    if killed is not None:
        dead = [r for pid, r in lost.items() if r[0]["started"] < killed["t"]]
        last = max((r[0].get("restart", 0) for r in lost.values()), default=0)
        again = [r for pid, r in lost.items() if r[0]["started"] >= killed["t"] and r[0].get("restart", 0) == last]
        dead_lost = 0
        for recs in dead:
            committed = {r["step"] for r in recs if r["kind"] == "step" and r["committed"]}
            dead_lost = max(dead_lost, len({r["step"] for r in recs if r["kind"] == "computed"} - committed))
        result["steps_lost_failed_group"] = dead_lost
        result["failed_group_last_committed_step"] = max(
            r["step"] for recs in dead for r in recs if r["kind"] == "step" and r["committed"])
        firsts = [next((r for r in recs if r["kind"] == "step" and r["committed"] and r["participants"] == 2), None)
                  for recs in again]
        result["rejoined"] = bool(firsts) and None not in firsts
        if result["rejoined"]:
            result["rejoined_at_step"] = min(r["step"] for r in firsts)
            result["restart_to_first_commit_s"] = round(max(r["t"] - r["started"] for r in firsts), 2)
            result["kill_to_first_commit_s"] = round(max(r["t"] for r in firsts) - killed["t"], 2)
            result["heals_after_restart"] = min(
                max(r.get("heals", 0) for r in recs if r["kind"] == "step") for recs in again)
    finals = [out / f"group{g}_final.pt" for g in (0, 1)]
    if all(p.exists() for p in finals):
        a, b = (torch.load(p) for p in finals)
        result["bit_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--work", type=Path, default=None, help="folder for the trials' logs (default: temporary)")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]))
        return
    import tempfile

    from _machine import describe

    steps, trials = MODES["quick" if args.quick else "full"]
    trials = args.trials or trials
    work = args.work or Path(tempfile.mkdtemp(prefix="replica-failure-"))
    results = []
    for i in range(trials):
        r = trial(work / f"trial{i}", steps, victim_rank=1 if i % 2 == 0 else 0)
        print(json.dumps(r), flush=True)
        results.append(r)
    summary = {
        "steps": steps, "kill_at_step": KILL_AT, "trials": len(results),
        "rejoined": sum(bool(r.get("rejoined")) for r in results),
        "bit_equal": sum(bool(r.get("bit_equal")) for r in results),
        "steps_lost_survivors_max": max(r["steps_lost_survivors"] for r in results),
        "steps_lost_failed_group_max": max(r.get("steps_lost_failed_group", 0) for r in results),
        "seconds_paused_max": max(r["seconds_paused"] for r in results),
        "seconds_paused_at_kill_max": max(r.get("seconds_paused_at_kill", float("nan")) for r in results),
        "seconds_paused_at_rejoin_max": max(r.get("seconds_paused_at_rejoin", float("nan")) for r in results),
        "restart_to_first_commit_s_max": max(r.get("restart_to_first_commit_s", float("nan")) for r in results),
        "kill_to_first_commit_s_max": max(r.get("kill_to_first_commit_s", float("nan")) for r in results),
    }
    report = {"benchmark": "replica_failure", "mode": "quick" if args.quick else "full", "machine": describe(),
              "lighthouse": LIGHTHOUSE_ARGS, "timeout_s": TIMEOUT_S, "alone_sleep_s": ALONE_SLEEP_S, "summary": summary, "trials": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "replica_failure.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
