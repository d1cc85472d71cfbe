"""Bad input gets a clear error before work starts; a failing stage does not leave the others hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest

import lightning_clapping
from lightning_clapping import ClappingStrategy, PartitionError
from _models import SequentialMLP, TinyGPT
from conftest import ROOT, SCRIPTS, launch, launch_forked


def _trainer(devices, **strategy_kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=ClappingStrategy(**strategy_kwargs), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_devices_must_match_the_number_of_stages():
    with pytest.raises(ValueError, match=r"cut the model into 3 stages, but the Trainer starts 2 processes"):
        _trainer(2, split_points=["net.2", "net.4"])


def test_unknown_cut_point_is_refused_before_any_process_starts_and_lists_what_exists():
    trainer = _trainer(2, split_points=["net.99"])
    with pytest.raises(PartitionError, match=r"'net.99' is not a submodule.*Cuttable blocks: net.0, net.1, net.2"):
        trainer.fit(SequentialMLP())
    assert not trainer.strategy.launcher.procs, "no rank may be started for a model that cannot be cut"


def test_more_stages_than_cuttable_blocks_is_refused():
    model = SequentialMLP(depth=2)  # net = Linear, Tanh, Linear: three blocks
    with pytest.raises(PartitionError, match=r"cannot cut the model into 5 stages: it has only 3 cuttable blocks"):
        _trainer(5).fit(model)


def test_container_that_forward_never_calls_is_refused_as_a_cut_point():
    with pytest.raises(PartitionError, match=r"'blocks' is a ModuleList, which forward never calls.*blocks.0"):
        _trainer(2, split_points=["blocks"]).fit(TinyGPT())


def test_spawn_launch_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"start_method='spawn'.*is refused.*most of its weights untrained"):
        ClappingStrategy(start_method="spawn")


def test_manual_optimization_is_refused():
    class Manual(SequentialMLP):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match=r"automatic optimization only"):
        _trainer(2).fit(Manual())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"microbatches": 0}, "microbatches must be a positive integer"),
    ({"schedule": "zigzag"}, "unknown schedule 'zigzag'"),
    ({"split_points": "net.2"}, "split_points must be a list of module names"),
])
def test_bad_strategy_arguments_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ClappingStrategy(**kwargs)


def test_strategy_name_is_registered_on_import():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="clapping", logger=False)
    assert isinstance(trainer.strategy, lightning_clapping.ClappingStrategy)


def test_forward_whose_values_crossing_the_cut_change_between_steps_fails_with_the_reason(tmp_path):
    proc = launch_forked("failing_run.py", "unsplittable", ranks=2, cwd=tmp_path, expect_ok=False, timeout=120)
    assert proc.returncode != 0
    assert "but the first step's forward did not use it here" in proc.stderr
    assert "make the forward the same on every step, or cut the model elsewhere" in proc.stderr


def test_processes_that_cut_the_model_differently_are_refused_before_training(tmp_path):
    proc = launch_forked("failing_run.py", "other_cuts", ranks=2, cwd=tmp_path, expect_ok=False, timeout=120)
    assert proc.returncode != 0
    assert "the processes cut the model differently: rank 0 at ['net.4'], rank 1 at ['net.2']" in proc.stderr


def test_microbatches_larger_than_the_batch_are_refused_at_the_first_step(tmp_path):
    proc = launch_forked("failing_run.py", "microbatches", ranks=2, cwd=tmp_path, expect_ok=False, timeout=120)
    assert proc.returncode != 0
    assert "microbatches=8 is larger than the batch (4 samples)" in proc.stderr


def test_a_stage_that_dies_ends_the_whole_run(tmp_path):
    start = time.monotonic()
    proc = launch_forked("failing_run.py", "child_dies", ranks=None, cwd=tmp_path, expect_ok=False, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120


def test_when_rank0_dies_the_other_stages_stop_after_the_timeout(tmp_path):
    start = time.monotonic()
    proc = launch_forked("failing_run.py", "rank0_dies", ranks=None, cwd=tmp_path, expect_ok=False, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120


def test_rank0_names_the_stage_that_failed_and_its_exception(tmp_path):
    proc = launch_forked("failing_run.py", "child_raises", ranks=None, cwd=tmp_path, expect_ok=False, timeout=180)
    assert proc.returncode != 0
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]")]
    assert any("StageFailure: stage 0 (rank 1) failed: ValueError: boom in the first stage" in line
               for line in rank0), "\n".join(rank0[-15:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_sigterm_to_the_launching_process_stops_every_stage_within_seconds(tmp_path):
    # preemption (SLURM, Kubernetes) while steps run back to back, three times: no rank may wait for the timeout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(var, None)
    for trial in range(3):
        cwd = tmp_path / f"trial{trial}"
        cwd.mkdir()
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "failing_run.py"), "sigterm"], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (cwd / "started").exists():
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "training never started"
                time.sleep(0.2)
            pids = [int((cwd / f"pid_rank{r}").read_text()) for r in range(2)]
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            while any(_alive(p) for p in pids) and time.monotonic() - sent < 60:
                time.sleep(0.1)
            stopped = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not any(_alive(p) for p in pids), f"trial {trial}: a rank is still running"
        assert stopped < 20, f"trial {trial}: the run took {stopped:.1f} s to stop after SIGTERM"


def test_a_hung_stage_is_found_within_seconds_killed_and_named_by_rank0(tmp_path):
    start = time.monotonic()  # the stage stops itself (SIGSTOP) at step 2; timeout is 10 minutes, liveness 3 s
    proc = launch("failing_run.py", "child_hangs", cwd=tmp_path, expect_ok=False, timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]")]
    assert any("StageFailure: stage 0 (rank 1" in line and "sent no heartbeat" in line for line in rank0), \
        "\n".join(rank0[-15:])
    assert not _alive(int((tmp_path / "pid_rank1").read_text()))  # the stopped process is gone

