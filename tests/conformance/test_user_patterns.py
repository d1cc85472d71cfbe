"""Training patterns as their users write them train on 2 pipeline stages as in one process.

Each test runs one case of ``tests/scripts/conformance_run.py`` twice: on 2 stages (``ClappingStrategy``,
``microbatches=1``, ``freeze_rng=False``, ranks forked from this process) and with a plain one-device Trainer, from the
same ``seed_everything(0)``, SGD without momentum, the same unshuffled batches. The promise is the one-process result:
every tensor of the trained model's state dict (rank 0 holds the whole model after ``fit``) within ``ATOL``, or, where a
test says so, a refusal whose message gives the reason; never a silently different run.

No conftest.py in this folder: pytest imports every rootdir-less conftest under the module name ``conftest``, so one
here would replace ``tests/conftest.py`` in ``sys.modules`` for the test files collected after it (their
``from conftest import ...`` would break). ``tests/`` is on ``sys.path`` once pytest has imported its conftest
(rootdir-less conftests are imported with their folder prepended), and it is put there below for any other way in.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from conftest import launch_forked  # noqa: E402

SCRIPT = "conformance_run.py"
ATOL = 1e-5
TIMEOUT = 240


@dataclass
class Run:
    """One case run on 2 stages (``pipe``) and in one process (``single``)."""

    case: str
    out: Path
    returncodes: list
    timed_out: bool
    stderr: str
    rows: dict = field(default_factory=dict)  # rank -> what the pipe run's rank wrote
    single: dict = field(default_factory=dict)
    modes: dict = field(default_factory=lambda: {"pipe": "pipe", "single": "single"})  # the worker's mode names

    @property
    def pipe_ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.returncodes)

    def errors(self) -> list[str]:
        """Each failed rank's exception and the ones it was raised from, ``Type: message``."""
        return ["\n".join(row["error"]["chain"]) for row in self.rows.values() if row.get("error")]

    def weights(self, mode: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"{self.case}_{self.modes[mode]}_weights.pt")

    def failure(self) -> str:
        """Why the pipe run did not end well, for a test's message."""
        why = "timed out" if self.timed_out else f"exit codes {self.returncodes}"
        errors = self.errors()
        if errors:
            return f"the 2-stage run failed ({why}):\n" + "\n---\n".join(e[-2000:] for e in errors)
        return f"the 2-stage run failed ({why}) without recording an error; stderr:\n{self.stderr[-4000:]}"

    def losses(self) -> str:
        pipe = self.rows.get(0, {}).get("losses")
        return f"losses per step: 2 stages {pipe}, one process {self.single.get('losses')}"


def run_case(case: str, out: Path, pipe_mode: str = "pipe", single_mode: str = "single") -> Run:
    """The case on 2 stages (its failure is the test's to judge) and in one process (which must succeed)."""
    pipe = launch_forked(SCRIPT, str(out), case, pipe_mode, ranks=2, cwd=out, timeout=TIMEOUT, expect_ok=False)
    launch_forked(SCRIPT, str(out), case, single_mode, ranks=1, cwd=out, timeout=TIMEOUT)
    run = Run(case, out, list(pipe.returncodes), pipe.timed_out, pipe.stderr,
              modes={"pipe": pipe_mode, "single": single_mode})
    for rank in (0, 1):
        path = out / f"{case}_{pipe_mode}_rank{rank}.json"
        if path.exists():
            run.rows[rank] = json.loads(path.read_text())
    run.single = json.loads((out / f"{case}_{single_mode}_rank0.json").read_text())
    return run


def assert_same_weights(run: Run) -> None:
    """Every tensor of the model trained on 2 stages is the one-process model's, within ``ATOL``."""
    if not run.pipe_ok:
        pytest.fail(run.failure())
    pipe, single = run.weights("pipe"), run.weights("single")
    assert pipe.keys() == single.keys(), f"state dict keys differ: {sorted(pipe.keys() ^ single.keys())}"
    diffs = {}
    for name, ref in single.items():
        got = pipe[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, ref.shape, got.dtype, ref.dtype)
        if got.is_floating_point():
            diffs[name] = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
        else:
            diffs[name] = 0.0 if torch.equal(got, ref) else float("inf")
    bad = {k: v for k, v in diffs.items() if not v <= ATOL}
    if bad:
        worst = max(bad, key=bad.get)
        pytest.fail(f"{len(bad)} of {len(diffs)} tensors differ from one process by more than {ATOL}: max |diff| "
                    f"{bad[worst]:.3g} at {worst!r} (all: {', '.join(f'{k} {v:.2g}' for k, v in bad.items())}); "
                    f"{run.losses()}")


# ------------------------------------------------------------------------------------------ random draws in the step
def test_ddpm_noise_and_timesteps_drawn_in_the_step_train_as_in_one_process(tmp_path):
    assert_same_weights(run_case("ddpm", tmp_path))


def test_bert_masking_drawn_in_the_step_with_a_loss_on_masked_positions_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("mlm", tmp_path))


def test_mixup_with_torch_randperm_and_a_torch_beta_draw_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("mixup_torch", tmp_path))


def test_mixup_with_a_numpy_beta_draw_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("mixup_numpy", tmp_path))


def test_functional_dropout_in_the_parents_loop_between_blocks_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("dropout_parent", tmp_path))


def test_stochastic_depth_drawn_in_the_parents_loop_trains_as_in_one_process_or_is_refused_naming_the_draw(tmp_path):
    run = run_case("stochastic_depth", tmp_path)
    if run.pipe_ok:
        assert_same_weights(run)
        return
    assert not run.timed_out, run.failure()
    errors = run.errors()
    named = [e for e in errors if "torch.rand" in e and "stage" in e]
    assert named, "the 2-stage run failed, but not with a refusal naming the random draw (torch.rand) and the " \
                  "stage: " + run.failure()


# ------------------------------------------------------------------------------------------ state on the module
def test_a_running_total_kept_on_the_module_logs_the_one_process_value_at_epoch_end(tmp_path):
    run = run_case("running_sum", tmp_path)
    if not run.pipe_ok:
        pytest.fail(run.failure())
    expected = run.single["metrics"]["total"]
    assert expected == pytest.approx(sum(run.single["losses"]), rel=1e-5)  # the reference is what it should be
    for rank in (0, 1):
        metrics = run.rows[rank]["metrics"]
        assert "total" in metrics, f"rank {rank} has no logged 'total': {metrics}"
        assert metrics["total"] == pytest.approx(expected, rel=1e-5, abs=1e-6), \
            f"rank {rank} logged total {metrics['total']}, one process {expected}; {run.losses()}"


# ------------------------------------------------------------------------------------------ autograd and callbacks
def test_a_custom_autograd_function_reversing_the_gradient_of_the_features_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("grad_reverse", tmp_path))


def test_stochastic_weight_averaging_trains_as_in_one_process_or_is_refused_at_setup_naming_the_callback(tmp_path):
    run = run_case("swa", tmp_path)
    if run.pipe_ok:
        assert_same_weights(run)
        return
    assert not run.timed_out, run.failure()
    named = [e for e in run.errors() if "StochasticWeightAveraging" in e]
    assert named, "the 2-stage run failed, but not with a refusal naming StochasticWeightAveraging: " + run.failure()
    started = {rank: row["batches_started"] for rank, row in run.rows.items()}
    assert started and not any(started.values()), \
        f"refused only after training started (batches started per rank: {started}): {run.failure()}"


def test_a_straight_through_sign_function_saving_its_input_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("hashing", tmp_path))


def test_hugging_face_bert_masked_as_its_data_collator_masks_with_dropout_on_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("hf_bert_mlm", tmp_path))


def test_bert_masking_with_frozen_seeds_and_micro_batches_trains_as_the_same_strategy_on_one_device(tmp_path):
    assert_same_weights(run_case("mlm", tmp_path, "pipe_frozen", "single_frozen"))


# ------------------------------------------------------------------------------------------ in-place writes
def test_stage_0_values_written_into_a_buffer_by_index_and_through_a_view_train_as_in_one_process(tmp_path):
    assert_same_weights(run_case("writes", tmp_path))


# ------------------------------------------------------------------------------------------ the run-time guard
def test_a_value_recomputed_differently_on_two_stages_stops_the_run_at_the_first_step_naming_the_op(tmp_path):
    run = run_case("rank_dependent", tmp_path)
    assert not run.pipe_ok, "the stages weighted the loss with different values and the run went on"
    assert not run.timed_out, run.failure()
    named = [e for e in run.errors() if "recomputes the value made by `torch.Tensor.mul`" in e
             and "stage 1" in e and "stage 0" in e]
    assert named, run.failure()
    assert not any(row["losses"] for row in run.rows.values()), "stopped only after a step had trained"


# ------------------------------------------------------------------------------------------ the default setting
def test_with_frozen_seeds_and_micro_batches_ddpm_draws_train_as_the_same_strategy_on_one_device(tmp_path):
    """freeze_rng=True (the default) draws each micro-batch's numbers under its own seed; every draw of this step
    happens before the first cut, on stage 0, so the pipeline must draw what the strategy draws on one device."""
    assert_same_weights(run_case("ddpm_frozen", tmp_path, "pipe_frozen", "single_frozen"))


def test_a_permutation_across_the_batch_with_micro_batches_is_warned_about_once(tmp_path):
    """mixup's in-batch permutation mixes only the samples of each micro-batch when the step runs per micro-batch:
    not what one process does with the whole batch, so the run says so (and how to get the one-process result)."""
    pipe = launch_forked(SCRIPT, str(tmp_path), "mixup_torch", "pipe_frozen", ranks=2, cwd=tmp_path, timeout=TIMEOUT)
    warned = [line for line in pipe.stderr.splitlines() if "calls `torch.randperm` across the batch" in line]
    assert len(warned) == 1, pipe.stderr[-3000:]
    assert "microbatches=2" in warned[0] and "Use microbatches=1" in warned[0]
    single = launch_forked(SCRIPT, str(tmp_path), "mlm", "pipe_frozen", ranks=2, cwd=tmp_path, timeout=TIMEOUT)
    assert "across the batch" not in single.stderr  # a loss without a batch-coupling term: no warning


# ------------------------------------------------------------------------------------------ registration order
def test_opt_whose_final_norm_is_registered_before_the_layers_is_refused_with_a_fix_that_works(tmp_path):
    """Hugging Face OPT registers ``final_layer_norm`` before ``layers`` and calls it after them; the refusal names
    the module and the line that registers it where forward calls it, and with that line the model trains as in one
    process."""
    run = run_case("opt", tmp_path)
    assert not run.pipe_ok and not run.timed_out, run.failure()
    fix = "self.model.model.decoder.final_layer_norm = self.model.model.decoder._modules.pop('final_layer_norm')"
    assert any("'model.model.decoder.final_layer_norm' is registered before the cut" in e and fix in e
               for e in run.errors()), run.failure()
    assert_same_weights(run_case("opt_reordered", tmp_path))


# ------------------------------------------------------------------------------------------ hooks around the step
def test_a_mean_teacher_updated_from_the_whole_student_in_a_hook_is_refused_naming_the_tensor(tmp_path):
    """The teacher's moving average reads student layers that another stage holds: on this stage they are placeholders
    without values (``real.add_(meta)`` changes nothing), so it is refused rather than decaying the teacher."""
    run = run_case("mean_teacher", tmp_path)
    assert not run.pipe_ok and not run.timed_out, run.failure()
    named = [e for e in run.errors() if "on_train_batch_end uses 'net.0.weight'" in e or
             "on_train_batch_end uses 'teacher.0.weight'" in e]
    assert named and all("held by stage" in e for e in named), run.failure()


def test_a_value_that_drifts_apart_on_two_stages_after_the_first_step_is_stopped_at_the_next_check(tmp_path):
    """An epoch-end hook (last stage only) changes a scale used on both sides of the cut: the first step agrees, the
    check every recheck_every=2 steps finds it at step 4 (the second epoch) and stops every stage at the next step."""
    run = run_case("drift", tmp_path)
    assert not run.pipe_ok and not run.timed_out, run.failure()
    named = [e for e in run.errors() if "at the check of step 4; they agreed at the first step" in e
             and "recomputes the value made by" in e]
    assert len(named) == 2, run.failure()  # both stages stop with the same verdict
    assert all(len(row["losses"]) == 5 for row in run.rows.values())  # steps 0-4 trained, step 5 did not


# ------------------------------------------------------------------------------------------ model structure
def test_a_masked_autoencoder_with_random_masking_and_block_lists_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("mae", tmp_path))


def test_checkpoint_around_blocks_in_the_parents_loop_trains_as_in_one_process(tmp_path):
    assert_same_weights(run_case("checkpoint_loop", tmp_path))


def test_a_gumbel_softmax_vae_with_a_value_checking_loss_trains_as_in_one_process(tmp_path):
    """binary_cross_entropy refuses inputs outside [0, 1]: the first-step pass must not hand it NaN placeholders."""
    assert_same_weights(run_case("gumbel_vae", tmp_path))


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_every_weight_averaging_callback_of_both_lightnings_is_refused_on_several_stages_only(namespace):
    import importlib

    from lightning_clapping.stage_setup import refuse_weight_averaging

    callbacks = importlib.import_module(f"{namespace}.callbacks")
    for made in (callbacks.StochasticWeightAveraging(swa_lrs=0.1), callbacks.EMAWeightAveraging()):
        with pytest.raises(ValueError, match=rf"{type(made).__name__} cannot run under ClappingStrategy with 2 stages"):
            refuse_weight_averaging([made], 2)
        refuse_weight_averaging([made], 1)  # one stage holds the whole model: nothing to refuse
