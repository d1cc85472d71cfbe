"""The strategy on CUDA devices with NCCL: two stages, one GPU each, launched as a user would (``python script.py``).

Run with ``python -m pytest tests/gpu`` on a machine with at least two CUDA devices; elsewhere every test is skipped.
The scripts are the CPU tests' own (tests/scripts), given ``--accelerator gpu --devices 2``.
"""

from __future__ import annotations

import json

import pytest
import torch

from _models import build
from conftest import launch

DEVICES = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(
    DEVICES < 2, reason=f"needs at least 2 CUDA devices for a 2-stage NCCL pipeline, found {DEVICES}"
)
GPU = ["--accelerator", "gpu", "--devices", "2"]
# cuBLAS picks the same kernels run after run only with a fixed workspace: the resumed run must repeat the losses
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_DEBUG": "WARN"}


def _reference_weights(steps: int) -> dict[str, torch.Tensor]:
    """The MLP after ``steps`` SGD steps on its full batch, on one GPU (what grad_check.py trains)."""
    model, batch = build("mlp")
    model = model.cuda().train()
    model.log = lambda *a, **k: None
    optimizer = model.configure_optimizers()
    batch = [t.cuda() for t in batch]
    for _ in range(steps):
        optimizer.zero_grad()
        model.training_step(batch, 0).backward()
        optimizer.step()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stage_nccl_pipeline_weights_after_sgd_steps_equal_one_gpu(tmp_path, schedule):
    steps = 3
    launch("grad_check.py", "mlp", "2", str(tmp_path), "--schedules", schedule, "--steps", str(steps),
           "--accelerator", "gpu", cwd=tmp_path, env=DETERMINISTIC)
    ref = _reference_weights(steps)
    got = {}
    for rank in range(2):
        data = torch.load(tmp_path / f"{schedule}_rank{rank}.pt")
        stage = set(data["grads"])  # the parameters this rank's stage owns and trained
        got.update({n: w for n, w in data["weights"].items() if n in stage})
    assert set(got) == set(ref)
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _rows(tmp_path, mode, variant):
    return json.loads((tmp_path / f"{mode}_{variant}_full.json").read_text())


@pytest.fixture(scope="module")
def lazy_runs(tmp_path_factory):
    """14 steps of clapping-fc with lazy sampling (p = 0.5), the same stopped after 8 and resumed, and 14
    uncompressed steps; rows of [loss, fresh, bytes] per step."""
    out = tmp_path_factory.mktemp("nccl_lazy")
    for mode, variant in (("full", "clapping-fc"), ("first", "clapping-fc"), ("rest", "clapping-fc"),
                          ("full", "uncompressed")):
        launch("resume_run.py", str(out), mode, variant, "full", *GPU, cwd=out, env=DETERMINISTIC)
    return out


def test_clapping_fc_with_lazy_sampling_trains_and_sends_compressed_bytes(lazy_runs):
    rows, plain = _rows(lazy_runs, "full", "clapping-fc"), _rows(lazy_runs, "full", "uncompressed")
    losses = [r[0] for r in rows]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    assert 0.0 in [r[1] for r in rows[:-1]], "lazy sampling with p=0.5 reuses some batches"
    # steady-state steps (the first ones announce message sizes); q4 forward, q8 backward against fp32. Messages
    # of 4 x 32 values carry headers and per-channel scales too: 2456 bytes a step against 4760 on CPU/gloo
    compressed, uncompressed = [r[2] for r in rows[2:-1]], [r[2] for r in plain[2:-1]]
    assert max(compressed) < 0.55 * min(uncompressed), (compressed, uncompressed)


def test_clapping_fc_resumed_mid_window_on_gpus_repeats_decisions_bytes_and_losses(lazy_runs):
    from lightning_clapping.comm.wire import HEADER_BYTES

    full = _rows(lazy_runs, "full", "clapping-fc")
    first, rest = _rows(lazy_runs, "first", "clapping-fc"), _rows(lazy_runs, "rest", "clapping-fc")
    assert len(full) == 14 and len(first) == 8 and len(rest) == 6
    assert [r[1] for r in rest] == [r[1] for r in full[8:]]
    # the new processes announce each slot's message size once: 1 boundary x 2 directions x 4 micro-batches
    assert rest[0][2] - full[8][2] == 8 * HEADER_BYTES
    assert [r[2] for r in rest[1:]] == [r[2] for r in full[9:]]
    assert [r[0] for r in rest] == pytest.approx([r[0] for r in full[8:]], rel=1e-6)
