"""Starting slow_network's ranks: every rank of a run in its namespace (``ip netns exec NS python
benchmarks/slow_network.py --worker CFG``, environment as torchrun sets it), waiting for them, and clean-up: the
ranks are killed and the namespaces deleted at exit, also on failure or on SIGINT/SIGTERM/SIGHUP.

Each run also records how many CPU cores other processes used meanwhile (``other_cores``): timings taken while
other jobs compete for a small CPU are slower.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from _netns import Endpoint, Lab
from _slow_network_settings import ROOT

SCRIPT = Path(__file__).resolve().parent / "slow_network.py"  # started with --worker in each rank's namespace


class Runner:
    """Owns the lab and the live worker processes; ``close()`` (idempotent) kills the workers and tears down."""

    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab, self.workdir = lab, workdir
        self.procs: list[subprocess.Popen] = []
        self.port = 29500

    def _kill_workers(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: only what this script started
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def close(self) -> None:
        self._kill_workers()
        self.lab.teardown()
    def run(self, key: str, cfg: dict, endpoints: list[Endpoint], timeout: float) -> dict:
        """One run: its ranks on ``endpoints`` (rank 0 first), until all exit, one fails or ``timeout`` passes.
        Returns the ranks' records (``ranks``), or ``error`` and the tails of their logs."""
        run_dir = self.workdir / key
        run_dir.mkdir(parents=True)
        cfg = dict(cfg, result_dir=str(run_dir))
        cfg_path = run_dir / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        self.port += 1  # a fresh port per run: no lingering socket of the previous run in the way
        env = self._environment(cfg, endpoints)
        logs = []
        for rank, ep in enumerate(endpoints):  # rank 0 first: it hosts the rendezvous store
            log = open(run_dir / f"rank{rank}.log", "w")
            logs.append(log)
            self.procs.append(subprocess.Popen(
                self.lab.command(ep, [sys.executable, str(SCRIPT), "--worker", str(cfg_path)]),
                env=dict(env, NODE_RANK=str(rank), GLOO_SOCKET_IFNAME=ep.ifname), stdout=log,
                stderr=subprocess.STDOUT, cwd=str(run_dir), start_new_session=True, preexec_fn=_die_with_parent))
        t0 = time.monotonic()
        busy0, mine0 = _cpu_busy_seconds(), _children_cpu_seconds()
        try:
            error = self._wait(t0, timeout)
        finally:
            self._kill_workers()
            for log in logs:
                log.close()
        wall = time.monotonic() - t0
        # CPU time the rest of the machine used meanwhile (all CPU time minus this run's ranks), in cores: timings
        # taken while other jobs compete for a small CPU are slower, and this says by how much the CPU was shared
        other_cores = max(0.0, (_cpu_busy_seconds() - busy0) - (_children_cpu_seconds() - mine0)) / max(wall, 1e-9)
        return _collect(run_dir, len(endpoints), error, wall, other_cores)

    def _environment(self, cfg: dict, endpoints: list[Endpoint]) -> dict[str, str]:
        """What every rank of a run sees: this environment without a scheduler's variables, and torchrun's."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) and k not in ("RANK", "GROUP_RANK")}
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
            OMP_NUM_THREADS=str(cfg["threads"]), MKL_NUM_THREADS=str(cfg["threads"]),
            MASTER_ADDR=endpoints[0].addr, MASTER_PORT=str(self.port), WORLD_SIZE=str(len(endpoints)),
            LOCAL_RANK="0", HF_HUB_OFFLINE="1",
        )
        return env

    def _wait(self, t0: float, timeout: float) -> str | None:
        """Until every rank has exited (None), one failed or the time is up (what happened)."""
        while True:
            codes = [p.poll() for p in self.procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                deadline = time.monotonic() + 10  # the others may still be writing their results
                try:
                    for proc in self.procs:
                        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                return f"rank {bad[0][0]} exited with {bad[0][1]}"
            if all(c == 0 for c in codes):
                return None
            if time.monotonic() - t0 > timeout:
                return f"timed out after {timeout:.0f} s"
            time.sleep(0.2)


def _collect(run_dir: Path, n_ranks: int, error: str | None, wall: float, other_cores: float) -> dict:
    """A run's outcome: the ranks' records, or the error with the last lines of every rank's log."""
    warning = None
    results = [run_dir / f"rank{r}.json" for r in range(n_ranks)]
    if error is not None and error.startswith("rank") and all(f.exists() for f in results):
        # every rank finished its measurements and wrote them; one failed on the way out: keep the numbers, say so
        error, warning = None, f"{error} after writing its results"
    if error is None:
        try:
            ranks = [json.loads(f.read_text()) for f in results]
        except (OSError, ValueError) as err:
            error, ranks = f"missing worker results: {err}", []
    if error is not None:
        tails = []
        for r in range(n_ranks):
            text = (run_dir / f"rank{r}.log").read_text(errors="replace")
            tails.append(f"--- rank {r} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]))
        return {"error": error, "wall_seconds": wall, "other_cores": other_cores, "log_tail": "\n".join(tails)}
    return {"error": None, "warning": warning, "wall_seconds": wall, "other_cores": other_cores, "ranks": ranks}


def clean_up_at_exit(close: Callable[[], None]) -> None:
    """Call ``close`` at exit, also when SIGTERM or SIGHUP ends the benchmark (SIGINT already raises)."""
    atexit.register(close)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)


def _cpu_busy_seconds() -> float:
    """Busy CPU time of the whole machine since boot (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching process dies, so no rank outlives the benchmark."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _raise_on_signal(signum, frame):
    raise SystemExit(128 + signum)
