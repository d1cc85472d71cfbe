"""Whole-job restarts under torchrun: how often a SIGKILLed run heals, and what each failure costs.

    python benchmarks/restart_heal.py [--quick] [--trials N] [--ddp-trials N] [--before COMMIT] [--out DIR]

Each trial is one ``torchrun --nproc-per-node 3 --max-restarts 2 tests/scripts/restart_run.py`` command (a 3-stage
``ClappingStrategy`` run of 3 epochs x 6 steps, ``ModelCheckpoint(save_last=True)`` at every epoch's end,
``fit(ckpt_path="last")``) in which rank 1 SIGKILLs itself as step 9 starts (epoch 2). Trials run one after the
other under ``nice -n 5``. Per trial:

* ``healed``: the command ended with exit code 0; ``bit_equal``: its final weights equal, bit for bit, those of an
  uninterrupted run of the same command (one per strategy and code, run first);
* ``steps_lost``: optimizer steps computed and then discarded: the last step the killed round completed minus the
  step the restarted round resumed from (the last checkpoint's);
* ``seconds_paused``: wall-clock from the kill to the first optimizer step after the restart, minus the run's
  median step time; split into ``down_s`` (kill -> the restarted processes start: torchrun notices, the other
  processes end), ``start_s`` (-> every rank reaches ``fit``: imports, connecting, building the stages) and
  ``resume_s`` (-> the first step ends: the checkpoint loads, the step runs).

Arms: ``clapping`` (this tree), ``clapping-before`` (the package at ``--before COMMIT``, with this tree's script;
optional) and ``ddp`` (Lightning's ``DDPStrategy`` on 3 processes under the same kill: the package is not involved,
so it shows what torch and Lightning do alone). Saves ``restart_heal.json`` (``restart_heal_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = ROOT / "tests" / "scripts" / "restart_run.py"
sys.path.insert(0, str(HERE))

KILL_AT, KILL_RANK, EPOCHS, MAX_RESTARTS = 9, 1, 3, 2
MODES = {"full": (20, 5, 5), "quick": (1, 0, 0)}  # trials of: clapping, ddp, clapping-before
TRIAL_TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(out: Path, strategy: str, kill: bool) -> list[str]:
    worker = [str(SCRIPT), str(out), "--strategy", strategy, "--epochs", str(EPOCHS)]
    if kill:
        worker += ["--kill-at", str(KILL_AT), "--kill-rank", str(KILL_RANK)]
    return ["nice", "-n", "5", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
            "--max-restarts", str(MAX_RESTARTS if kill else 0), "--master-port", str(_free_port()), *worker]


def _run(out: Path, strategy: str, kill: bool, package_root: Path) -> tuple[int, float, str]:
    """One torchrun command; returns its exit code, wall-clock seconds and the tail of its output."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PL_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(package_root), str(ROOT / "tests")]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    began = time.monotonic()
    with open(out / "torchrun.log", "w") as log:
        proc = subprocess.Popen(_command(out, strategy, kill), cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own session: nothing of it outlives the trial
        try:
            code = proc.wait(TRIAL_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    tail = (out / "torchrun.log").read_text(errors="replace")[-4000:]
    return (-1 if code is None else code), time.monotonic() - began, tail


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _same_weights(a: Path, b: Path) -> bool:
    import torch

    if not (a.exists() and b.exists()):
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def measure(events: list[dict]) -> dict:
    """Steps lost and seconds paused of the first kill in a trial's events (None where the run never resumed)."""
    kill = next(e for e in events if "kill" in e)
    steps = [e for e in events if "step" in e]
    failed = [e for e in steps if e["round"] == kill["round"]]
    after = [e for e in steps if e["round"] > kill["round"]]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if a["round"] == b["round"]]
    step_s = statistics.median(gaps) if gaps else 0.0
    row = {"kill_step": kill["kill"], "rounds": 1 + max(e["round"] for e in events), "median_step_s": step_s,
           "steps_lost": None, "seconds_paused": None, "down_s": None, "start_s": None, "resume_s": None}
    if not after:
        return row
    first = after[0]
    restarted = first["round"]
    starts = [e["started"] for e in events if "start" in e and e["round"] == restarted]
    fits = [e["time"] for e in events if "fit_start" in e and e["round"] == restarted]
    completed = max((e["step"] for e in failed), default=0)
    row.update(steps_lost=completed - (first["step"] - 1), seconds_paused=first["time"] - kill["time"] - step_s,
               down_s=min(starts) - kill["time"] if starts else None,
               start_s=max(fits) - min(starts) if starts and fits else None,
               resume_s=first["time"] - max(fits) if fits else None)
    return row


def _arm(name: str, strategy: str, trials: int, package_root: Path, work: Path) -> dict:
    reference = work / f"{name}-reference"
    code, seconds, tail = _run(reference, strategy, kill=False, package_root=package_root)
    if code != 0:
        raise SystemExit(f"the uninterrupted {name} run failed ({code}):\n{tail}")
    print(f"{name}: uninterrupted run {seconds:.0f} s", flush=True)
    rows = []
    for trial in range(trials):
        out = work / f"{name}-{trial}"
        code, seconds, tail = _run(out, strategy, kill=True, package_root=package_root)
        events = _events(out)
        row = {"trial": trial, "healed": code == 0, "exit_code": code, "wall_s": seconds,
               "bit_equal": code == 0 and _same_weights(reference / "final.pt", out / "final.pt"),
               **(measure(events) if any("kill" in e for e in events) else {"kill_step": None})}
        if not row["healed"]:
            row["error"] = next((line.strip() for line in tail.splitlines()[::-1]
                                 if "connectFullMesh failed" in line or "Error" in line), tail.splitlines()[-1:])
        rows.append(row)
        paused = f"{row['seconds_paused']:.1f} s paused" if row.get("seconds_paused") is not None else "no resume"
        print(f"{name} trial {trial}: healed={row['healed']} bit_equal={row['bit_equal']} "
              f"steps_lost={row.get('steps_lost')} {paused} ({seconds:.0f} s)", flush=True)
    healed = [r for r in rows if r["healed"]]
    summary = {"trials": trials, "healed": len(healed), "bit_equal": sum(r["bit_equal"] for r in rows)}
    for key in ("steps_lost", "seconds_paused", "down_s", "start_s", "resume_s"):
        values = [r[key] for r in healed if r.get(key) is not None]
        summary[f"median_{key}"] = statistics.median(values) if values else None
        summary[f"max_{key}"] = max(values) if values else None
    return {"summary": summary, "rows": rows}


def _checkout(commit: str, into: Path) -> Path:
    """The package as of ``commit`` (only ``lightning_clapping/``), for the ``clapping-before`` arm."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "lightning_clapping"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one trial of this tree's package, no other arm")
    ap.add_argument("--trials", type=int, help="trials of this tree's package (default 20; --quick: 1)")
    ap.add_argument("--ddp-trials", type=int, help="trials of Lightning's DDPStrategy (default 5; --quick: 0)")
    ap.add_argument("--before", metavar="COMMIT", help="also run the package as of COMMIT (e.g. the fix's parent)")
    ap.add_argument("--before-trials", type=int, help="trials of the --before package (default 5)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--keep", type=Path, help="keep every trial's folder (logs, events) here")
    args = ap.parse_args()
    from _machine import describe

    mode = "quick" if args.quick else "full"
    trials, ddp_trials, before_trials = MODES[mode]
    trials = trials if args.trials is None else args.trials
    ddp_trials = ddp_trials if args.ddp_trials is None else args.ddp_trials
    before_trials = before_trials if args.before_trials is None else args.before_trials
    work = args.keep or Path(tempfile.mkdtemp(prefix="restart-heal-"))
    work.mkdir(parents=True, exist_ok=True)
    arms: dict[str, dict] = {}
    try:
        arms["clapping"] = _arm("clapping", "clapping", trials, ROOT, work)
        if args.before and before_trials:
            old = _checkout(args.before, Path(tempfile.mkdtemp(prefix="restart-heal-before-")))
            arms["clapping-before"] = _arm("clapping-before", "clapping", before_trials, old, work)
            arms["clapping-before"]["commit"] = args.before
        if ddp_trials:
            arms["ddp"] = _arm("ddp", "ddp", ddp_trials, ROOT, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": describe(),
        "setup": {"command": "torchrun --nproc-per-node 3 --max-restarts 2 tests/scripts/restart_run.py OUT "
                             f"--kill-at {KILL_AT} --kill-rank {KILL_RANK}", "stages_or_replicas": 3,
                  "epochs": EPOCHS, "steps_per_epoch": 6, "checkpoint": "ModelCheckpoint(save_last=True), every "
                  "epoch's end; fit(ckpt_path='last')", "rendezvous": "torchrun's default (static, agent store)",
                  "nice": 5, "mode": mode},
        "arms": arms,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("restart_heal.json" if mode == "full" else "restart_heal_quick.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    for name, arm in arms.items():
        s = arm["summary"]
        paused = "-" if s["median_seconds_paused"] is None else f"{s['median_seconds_paused']:.1f}"
        print(f"{name:16s} healed {s['healed']}/{s['trials']}, bit-equal {s['bit_equal']}/{s['trials']}, "
              f"median steps lost {s['median_steps_lost']}, median seconds paused {paused}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
