"""``replica_sync=``: LAG and DiLoCo over 2 replicas x 2 stages (lightning_clapping.sync).

One launch of ``tests/scripts/replica_sync_run.py`` (4 forked ranks, every config in turn); each test reads what
its config's ranks wrote. No conftest.py in this folder (see tests/conformance/test_user_patterns.py for why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from conftest import launch_forked  # noqa: E402

CONFIGS = ("every,lag0,lag_avg0,lag,diloco1,diloco3,diloco4_end,diloco3_q8,diloco2_frag,diloco3_first,diloco3_rest,"
           "lag_first,lag_rest,diloco3_q8_first,diloco3_q8_rest,every_rest,diloco4,diloco4_ov2,diloco4_ov2_first,"
           "diloco4_ov2_rest")
STAGE_PARAMS = {0: 1600, 1: 1188}  # SequentialMLP cut at net.4: parameters per stage (2 + 2 tensors on stage 0,
TENSORS = {0: 4, 1: 4}             # 4 on stage 1: net.4 and net.6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replica_sync")
    launch_forked("replica_sync_run.py", str(out), CONFIGS, ranks=4, cwd=out, timeout=600)

    def rank(name: str, r: int) -> dict:
        return json.loads((out / f"{name}_rank{r}.json").read_text())

    def weights(name: str) -> dict[str, torch.Tensor]:
        return torch.load(out / f"weights_{name}.pt")

    return SimpleNamespace(rank=rank, weights=weights)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max().item() for k in a)


def _replicas_apart(runs, name: str) -> float:
    """The largest difference between the two replicas' copies of a stage's tensors (ranks 1, 3: stage 0; ranks 2
    and 0: stage 1, whose rank 0 also holds the whole model after fit)."""
    diffs = []
    for a, b in ((1, 3), (0, 2)):
        mine, theirs = runs.rank(name, a)["own"], runs.rank(name, b)["own"]
        diffs.append(_max_diff({k: mine[k] for k in theirs}, theirs))
    return max(diffs)


@pytest.mark.parametrize("name", ["lag0", "lag_avg0", "diloco1"])
def test_lag_with_a_zero_threshold_and_diloco_with_one_inner_step_equal_every_step_averaging(runs, name):
    # LAG(threshold=0) sends every changed gradient (whatever its reference); DiLoCo(inner_steps=1, outer_lr=1, momentum=0) under SGD
    # applies the average of the replicas' SGD steps: both are every-step averaging
    assert _max_diff(runs.weights(name), runs.weights("every")) <= 1e-5


@pytest.mark.parametrize("name", ["every", "lag", "diloco3", "diloco3_q8", "diloco4_end", "diloco2_frag",
                                  "diloco4_ov2"])
def test_every_mode_ends_with_identical_replicas(runs, name):
    # LAG: the stale average is the same on every replica; DiLoCo: the last step is a sync step (diloco3: step 6),
    # or the fit ends with one (diloco4_end: synced after step 4, then the end of fit after step 6)
    assert _replicas_apart(runs, name) == 0.0


def test_diloco_trains_otherwise_than_every_step_averaging(runs):
    # Adam's inner steps on each replica's own data, then the Nesterov outer step: a different run (the equality
    # above is not reached by a mode that ignores its settings)
    assert _max_diff(runs.weights("diloco3"), runs.weights("every")) > 1e-3


def _per_replica_every_step_bytes() -> float:
    # both stages, each rank sends 2 (R - 1) / R = 1 times its fp32 gradients and a flag per tensor
    return sum((STAGE_PARAMS[s] + TENSORS[s]) * 4 for s in (0, 1))


def test_diloco_sends_the_stage_once_per_inner_steps_and_counts_it(runs):
    totals = runs.rank("diloco3", 0)["totals"]
    per_sync = sum(STAGE_PARAMS[s] * 4 for s in (0, 1))  # an fp32 all-reduce of the pseudo-gradient, no flags
    assert totals["replica_bytes"] == 2 * per_sync  # 6 steps / 3
    assert totals["raw_bytes"] - runs.rank("every", 0)["totals"]["raw_bytes"] == 0  # raw: every-step, uncompressed
    every = runs.rank("every", 0)["totals"]["replica_bytes"]
    assert every == 6 * _per_replica_every_step_bytes()


def test_a_fit_that_ends_between_syncs_syncs_once_more_and_counts_it(runs):
    totals = runs.rank("diloco4_end", 0)["totals"]
    assert totals["replica_bytes"] == 2 * sum(STAGE_PARAMS[s] * 4 for s in (0, 1))  # after step 4, at the end


def test_a_compressed_pseudo_gradient_sends_the_codecs_payload_to_the_other_replica(runs):
    from _models import SequentialMLP
    from lightning_clapping.codecs import get_codec

    codec = get_codec("q8")
    payload = sum(codec.payload_nbytes(p.shape, torch.float32) for p in SequentialMLP().parameters())
    assert runs.rank("diloco3_q8", 0)["totals"]["replica_bytes"] == 2 * payload  # all-gather: (R - 1) payloads


def test_fragments_sync_their_tensors_at_staggered_steps(runs):
    # inner_steps=2, fragments=2: tensors dealt round-robin (weights: fragment 0, biases: fragment 1, on both
    # stages); fragment 0 synced after steps 1, 3, 5 and at the end of the fit, fragment 1 after steps 2, 4, 6
    weights = (16 * 32 + 32 * 32) + (32 * 32 + 32 * 4)
    biases = (32 + 32) + (32 + 4)
    assert runs.rank("diloco2_frag", 0)["totals"]["replica_bytes"] == 4 * weights * 4 + 3 * biases * 4


def test_an_overlapped_sync_sends_the_same_bytes_and_keeps_the_steps_taken_beside_it(runs):
    # the sync started after step 4 lands after step 6 (steps 5 and 6 kept on top of the new anchor), then the end
    # of the fit syncs once more: the bytes of diloco4, a different model
    per_sync = sum(STAGE_PARAMS[s] * 4 for s in (0, 1))
    assert runs.rank("diloco4_ov2", 0)["totals"]["replica_bytes"] == 2 * per_sync
    assert runs.rank("diloco4", 0)["totals"]["replica_bytes"] == 2 * per_sync
    assert _max_diff(runs.weights("diloco4_ov2"), runs.weights("diloco4")) > 1e-4


def test_lag_counts_its_flags_and_only_the_gradients_it_sends(runs):
    lag0 = runs.rank("lag0", 0)["totals"]["replica_bytes"]
    flags = 6 * sum(TENSORS.values())  # one uint8 per tensor and step
    assert lag0 == 6 * sum(STAGE_PARAMS.values()) * 4 + flags
    lag = runs.rank("lag", 0)["totals"]["replica_bytes"]
    assert flags <= lag <= lag0


@pytest.mark.parametrize("name, straight", [("diloco3_rest", "diloco3"), ("lag_rest", "lag"),
                                            ("diloco3_q8_rest", "diloco3_q8"), ("diloco4_ov2_rest", "diloco4_ov2")])
def test_a_run_resumed_between_syncs_equals_the_uninterrupted_one_on_every_rank(runs, name, straight):
    # saved after step 4 (DiLoCo: one step past its sync at 3, the replicas apart; diloco3_q8: a sharded checkpoint
    # with error-feedback residuals; diloco4_ov2: the sync started after step 4 still in flight), resumed to step 6:
    # every rank's stage as in the run that never stopped
    for rank in range(4):
        resumed, whole = runs.rank(name, rank)["own"], runs.rank(straight, rank)["own"]
        if name.startswith("diloco3_q8") and rank == 0:  # sharded: rank 0 keeps its own stage only
            whole = {k: whole[k] for k in resumed}
        assert _max_diff(resumed, whole) == 0.0, f"rank {rank}"


def test_a_checkpoint_of_another_sync_mode_resumes_with_a_warning_that_its_sync_state_is_not_used(runs):
    said = runs.rank("every_rest", 0)["warnings"]
    assert any("replica_sync='diloco'" in w and "'every-step'" in w for w in said), said


def test_replicas_built_from_different_random_weights_are_refused_at_the_first_step(tmp_path):
    # as under DDP the replicas must start alike; nothing broadcasts one replica's weights, so it is checked
    proc = launch_forked("replica_sync_run.py", str(tmp_path), "apart", ranks=4, cwd=tmp_path, timeout=300,
                         expect_ok=False)
    assert proc.returncode != 0
    assert "start from different weights" in proc.stderr and "seed_everything" in proc.stderr
