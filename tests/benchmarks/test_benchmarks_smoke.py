"""Every benchmark script runs in its tiniest mode, so none of them can rot unnoticed."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_codec_speed_times_the_shapes_asked_for_under_the_stem_asked_for(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import codec_speed

    codec_speed.main(["--tiny", "--threads", "0", "--codecs", "q4", "--shapes", "8x16", "3x5",
                      "--stem", "small", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "small.json").read_text())["rows"]
    assert [(r["codec"], r["shape"], r["values"]) for r in rows] == [("q4", "8x16", 128), ("q4", "3x5", 15)]
    assert (tmp_path / "small.csv").is_file() and not (tmp_path / "codec_speed.json").exists()


def test_codec_speed_times_a_fused_quantizer_beside_its_eager_code(tmp_path):
    pytest.importorskip("numba", reason="the fused CPU kernels need numba (in the test extras)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import codec_speed

    codec_speed.main(["--tiny", "--codecs", "q4", "identity", "--shapes", "256x256", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "codec_speed.json").read_text())["rows"]
    assert [(r["codec"], r["path"]) for r in rows] == [("q4", "fused"), ("q4", "eager"), ("identity", "eager")]
    fused, eager = rows[0], rows[1]
    assert fused["payload_bytes"] == eager["payload_bytes"] and fused["relative_error"] == eager["relative_error"]


def test_codec_speed_benchmark_runs_and_reports_ratios_to_memory_copy(tmp_path):
    import torch

    from lightning_clapping.codecs import get_codec

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import codec_speed

    proc = _run("codec_speed.py", tmp_path)
    rows = json.loads((tmp_path / "codec_speed.json").read_text())["rows"]
    assert [r["codec"] for r in rows] == codec_speed.CODECS  # --tiny: one shape, 64 x 64
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for r in rows:
        codec = get_codec(r["codec"])
        assert (r["shape"], r["values"]) == ("64x64", 4096)
        assert r["payload_bytes"] == codec.payload_nbytes(x.shape, x.dtype)
        assert r["compression_vs_fp32"] == pytest.approx(4 * 4096 / r["payload_bytes"])
        error = float((codec.decode(codec.encode(x), x.shape, x.dtype) - x).norm() / x.norm())
        assert r["relative_error"] == pytest.approx(error, rel=1e-6, abs=1e-12)
        assert min(r["copy_ms"], r["encode_ms"], r["decode_ms"], r["decode_into_ms"]) > 0
        assert r["ratio_to_copy"] == pytest.approx(r["copy_ms"] / r["encode_decode_ms"])
        assert r["encode_decode_gbps"] == pytest.approx(4 * 4096 / r["encode_decode_ms"] / 1e6)
    q4 = next(r for r in rows if r["codec"] == "q4")
    assert f"encode+decode at {q4['ratio_to_copy']:.2f} of memory-copy" in proc.stdout
    with open(tmp_path / "codec_speed.csv") as f:
        assert [row["codec"] for row in csv.DictReader(f)] == codec_speed.CODECS


def test_overhead_benchmark_runs_all_three_methods(tmp_path):
    proc = _run("overhead.py", tmp_path)
    summary = json.loads((tmp_path / "overhead.json").read_text())
    assert set(summary["median_samples_per_s"]) == {"torch_pipelining", "bare_executor", "lightning"}
    assert all(v > 0 for v in summary["median_samples_per_s"].values())
    assert "lightning / torch_pipelining" in proc.stdout


def test_lazy_messages_benchmark_compares_thresholds_with_the_trigger_off(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from datasets import missing_reason

    if missing_reason("shakespeare"):
        pytest.skip(missing_reason("shakespeare"))
    _run("lazy_messages.py", tmp_path)
    summary = json.loads((tmp_path / "lazy_messages.json").read_text())
    off, *lazy = summary["runs"]
    assert [r["threshold"] for r in summary["runs"]] == [None, 0.01, 0.03, 0.1]
    assert off["skipped_messages"] == 0 and off["bytes"] > 0 and math.isfinite(off["val_loss"])
    for r in lazy:  # each threshold against the run without lazy messages (same seed and steps)
        assert r["bytes_saved_vs_off"] == pytest.approx(1 - r["bytes"] / off["bytes"])
        assert r["val_loss_change_vs_off"] == pytest.approx(r["val_loss"] - off["val_loss"])
        if r["skipped_messages"]:  # a skipped message sends nothing
            assert r["bytes"] < off["bytes"]
        else:  # nothing skipped: the very same run
            assert (r["bytes"], r["val_loss"]) == (off["bytes"], off["val_loss"])


def test_memory_benchmark_measures_every_build_and_the_sharded_save_and_resume(tmp_path):
    proc = _run("memory.py", tmp_path)
    result = json.loads((tmp_path / "memory.json").read_text())
    rows, model_bytes = result["rows"], result["model_bytes"]
    assert model_bytes == 4 * (4 * (256 * 256 + 256) + 256 * 10 + 10)  # --tiny: 4 blocks of 256 + a 10-class head
    assert sorted((r["build"], r["rank"]) for r in rows) == sorted(
        (b, rank) for b in ("eager", "configure_model", "configure_model+save", "resume") for rank in (0, 1))
    for build in ("eager", "configure_model"):
        ranks = [r for r in rows if r["build"] == build]
        assert sum(r["own_bytes"] for r in ranks) == model_bytes  # the stages hold the model exactly once
        assert all(0 < r["build_peak"] <= r["train_peak"] for r in ranks)
    assert all(r["save_peak"] > 0 for r in rows if r["build"] == "configure_model+save")
    worst = max(r["train_peak"] for r in rows if r["build"] == "configure_model")
    assert result["target"] == ("met" if worst <= 0.8 * model_bytes else "not met")
    assert f"worst rank {worst / model_bytes:.2f}x the model" in proc.stdout


def test_bottleneck_fit_benchmark_fits_in_one_process_and_on_the_stages_alike(tmp_path):
    proc = _run("bottleneck_fit.py", tmp_path)
    result = json.loads((tmp_path / "bottleneck_fit.json").read_text())
    rows = result["rows"]
    assert [r["run"] for r in rows] == ["one process"] + ["4 stages"] * 4
    assert sorted(r["rank"] for r in rows[1:]) == [0, 1, 2, 3]
    assert all(r["fit_s"] > 0 for r in rows)
    assert all(0 < k <= 1 for k in rows[0]["kept"].values())
    assert result["largest_weight_difference"] == 0.0  # the same forward, the same sums, the same directions
    assert rows[0]["kept"] == rows[1]["kept"] and len(rows[0]["kept"]) == 3
    assert f"largest difference between the fitted weights: {result['largest_weight_difference']:.3g}" in proc.stdout


def test_bytes_by_kind_counts_the_replicas_average_as_the_models_gradients_and_the_tied_sum(tmp_path):
    _run("bytes_by_kind.py", tmp_path, timeout=600)
    rows = json.loads((tmp_path / "bytes_by_kind.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["uncompressed", "clapping-fc q4/q8"]
    for r in rows:
        # 2 replicas: a ring all-reduce sends 2 (R - 1) / R = 1 times every gradient (and flag) from each rank
        assert r["replica_bytes_per_step"] == r["gradient_bytes"]
        assert r["tied_bytes_per_step"] > 0 and r["pipeline_messages_per_step"] > 0
    assert rows[1]["pipeline_messages_per_step"] < rows[0]["pipeline_messages_per_step"]  # compression acts there
    assert rows[1]["tied_bytes_per_step"] == rows[0]["tied_bytes_per_step"]  # and only there


def test_replica_sync_counts_every_step_averaging_as_the_gradients_and_diloco_once_per_interval(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _quality_tasks import TASKS

    reason = TASKS["fashion_mnist"].missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replica_sync.py"), "--tiny", "--tasks",
                           "fashion_mnist", "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    rows = {r["config"]: r for r in json.loads((tmp_path / "replica_sync_tiny.json").read_text())["runs"]}
    every, diloco = rows["every-step"], rows["diloco H=8 q4"]
    # 2 replicas: each rank sends its stage's fp32 gradients once per step (and a 4-byte flag per tensor)
    assert every["gradient_bytes"] < every["replica_per_step"] < every["gradient_bytes"] * 1.001
    # DiLoCo H=8 with 4-bit pseudo-gradients: the change once per 8 steps, all-gathered as q4 payloads
    assert 0 < diloco["replica_per_step"] < every["replica_per_step"] / 8 / 6
    assert diloco["pipeline_per_step"] == every["pipeline_per_step"]  # the pipeline's messages are not its business


def test_replica_sync_counts_the_tied_sum_and_the_tied_codec_compresses_only_that(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _tied_task import TIED_TASKS

    reason = TIED_TASKS["shakespeare_tied"].missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    sparse = "clapping-fc q4/q8 + diloco H=16 q4 + tied topk:0.05+q4"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replica_sync.py"), "--tiny", "--tasks",
                           "shakespeare_tied", "--configs", "every-step", "every-step + tied q4", sparse,
                           "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    runs = {r["config"]: r for r in json.loads((tmp_path / "replica_sync_tiny.json").read_text())["runs"]}
    every, q4, topk = runs["every-step"], runs["every-step + tied q4"], runs[sparse]
    # the embedding / head tensor [vocab, 128] on 2 stages: each copy's fp32 gradient goes to the other every step
    raw = every["tied_raw_per_step"]
    assert raw > 0 and raw % (2 * 128 * 4) == 0
    assert every["tied_per_step"] == raw and q4["tied_raw_per_step"] == raw
    # 4 bits a value, the scales and a finite flag; top 5 % of that with positions: several times fewer again
    assert raw / 8 < q4["tied_per_step"] < raw / 6
    assert 0 < topk["tied_per_step"] < q4["tied_per_step"] / 3
    # the tied codec acts on the tied sum only; the fp32 reference counts that sum uncompressed either way
    assert q4["pipeline_per_step"] == every["pipeline_per_step"] and q4["replica_per_step"] == every["replica_per_step"]
    assert q4["raw_per_step"] == every["raw_per_step"] == topk["raw_per_step"]
    assert q4["bytes_per_step"] == pytest.approx(every["bytes_per_step"] - raw + q4["tied_per_step"], abs=1.0)
