"""The slow-network benchmark still runs end to end in its tiniest mode, and leaves no namespace behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "slow_network.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _netns import unavailable_reason  # noqa: E402


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"slow-network benchmark needs network namespaces: {reason}")
    from examples.datasets import missing_reason

    reason = missing_reason("shakespeare")
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("slow_network")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script stops its ranks and deletes its namespaces itself
        try:
            proc.stdout_text, proc.stderr_text = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.stdout_text, proc.stderr_text = proc.communicate()
    prefixes = (f"clapbn{proc.pid}", f"clapprobe{proc.pid}")  # the names that run gave its namespaces
    left = {name for name in _namespaces() if name.startswith(prefixes)}
    for name in left:  # report them (below), but do not leave them on the machine
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return proc, out, left


def test_tiny_mode_runs_every_setting_and_writes_its_results(tiny_run):
    proc, out, _ = tiny_run
    assert proc.returncode == 0, proc.stdout_text[-4000:] + proc.stderr_text[-4000:]
    data = json.loads((out / "slow_network.json").read_text())
    runs = {(r["link"], r["kind"]): r for r in data["runs"]}
    assert set(runs) == {("loopback", "uncompressed"), ("100 Mbit/s", "uncompressed"), ("100 Mbit/s", "clapping-fc")}
    for r in runs.values():
        assert r["error"] is None
        assert r["steps"] == data["settings"]["steps"] and r["median_step_s"] > 0
        assert r["vals"] and r["vals"][-1]["step"] == data["settings"]["steps"]
    assert (out / "slow_network.csv").read_text().count("\n") == 1 + len(runs)
    assert (out / "slow_network.png").stat().st_size > 0
    # the targets, recomputed from the runs (their values mean little at this size, but the arithmetic must hold)
    loop, unc = runs[("loopback", "uncompressed")], runs[("100 Mbit/s", "uncompressed")]
    fc = runs[("100 Mbit/s", "clapping-fc")]
    targets = {t["target"]: t for t in data["targets"]}
    step = targets.pop("100 Mbit/s: clapping-fc step time <= 1.15x loopback step time")
    assert step["value"] == pytest.approx(fc["median_step_s"] / loop["median_step_s"])
    assert step["verdict"] == ("MET" if step["value"] <= 1.15 else "NOT MET")
    ttt = targets.pop("100 Mbit/s: clapping-fc time-to-target >= 2x shorter than uncompressed")
    target_loss = unc["final_val_loss"]  # the uncompressed run's final validation loss on the same link
    unc_time = next(v["train_seconds"] for v in unc["vals"] if v["val_loss"] <= target_loss)
    fc_time = next((v["train_seconds"] for v in fc["vals"] if v["val_loss"] <= target_loss), None)
    if fc_time is None:
        assert (ttt["value"], ttt["verdict"]) == (None, "NOT MET (target loss not reached)")
    else:
        assert ttt["value"] == pytest.approx(unc_time / fc_time)
        assert ttt["verdict"] == ("MET" if ttt["value"] >= 2.0 else "NOT MET")
    # and 25 Mbit/s, a link the tiny mode does not have
    assert [(t["value"], t["verdict"].split(" (")[0]) for t in targets.values()] == [(None, "not measured")]


def test_tiny_mode_counts_bytes_on_the_wire_and_at_the_strategy(tiny_run):
    proc, out, _ = tiny_run
    assert proc.returncode == 0, proc.stderr_text[-4000:]
    data = json.loads((out / "slow_network.json").read_text())
    fp32 = data["settings"]["fp32_message_bytes"]
    for r in data["runs"]:
        if r["kind"] == "uncompressed":
            assert r["bytes_per_step"] >= 2 * fp32  # one boundary, both directions, fp32 plus headers
        else:
            # q4 forward, q8 backward (the median: the first step is sent in full precision, a warm start)
            assert r["median_bytes_per_step"] < r["fp32_bytes_per_step"] / 3
        if r["rate_mbit"] is not None:
            # what left the shaped veths covers at least what the strategy says it sent, and tbf did shape it
            assert r["veth_over_strategy"] >= 1.0
            assert r["tbf_overlimits"] > 0


def test_tiny_mode_deletes_the_namespaces_it_created(tiny_run):
    proc, _, left = tiny_run
    assert proc.returncode == 0, proc.stderr_text[-4000:]
    assert not left, f"left behind: {sorted(left)}"


def _row(link, variant, kind, step_s, val_losses, rate=None):
    """A summarised run as ``summarize`` leaves it, reduced to what the comparisons read."""
    vals = [{"step": 10 * (i + 1), "train_seconds": step_s * 10 * (i + 1), "val_loss": v}
            for i, v in enumerate(val_losses)]
    return {"link": link, "variant": variant, "kind": kind, "rate_mbit": rate, "error": None,
            "median_step_s": step_s, "mean_step_s": step_s, "final_val_loss": val_losses[-1], "vals": vals}


def test_every_clapping_fc_codec_pair_is_judged_against_the_targets():
    import slow_network

    rows = [_row("loopback", "uncompressed", "uncompressed", 0.2, [3.0, 2.0]),
            _row("100 Mbit/s", "uncompressed", "uncompressed", 0.6, [3.0, 2.0], 100.0),
            _row("100 Mbit/s", "clapping-fc p=0.5", "clapping-fc", 0.3, [3.0, 2.1, 2.05], 100.0),
            _row("100 Mbit/s", "clapping-fc p=0.5 q4/q4", "clapping-fc", 0.22, [3.0, 2.0], 100.0),
            _row("25 Mbit/s", "uncompressed", "uncompressed", 2.0, [3.0, 2.0], 25.0),
            _row("25 Mbit/s", "clapping-fc p=0.5 q4/q4", "clapping-fc", 0.4, [2.5, 1.9], 25.0)]
    slow_network.add_comparisons(rows)
    verdicts = {t["target"]: (t["verdict"], t["value"]) for t in slow_network.evaluate_targets(rows)}
    # the first clapping-fc row of a link is the main one; q4/q8 never reached 2.0 in its runs
    assert verdicts["100 Mbit/s: clapping-fc time-to-target >= 2x shorter than uncompressed"][0].startswith("NOT MET")
    verdict, value = verdicts["100 Mbit/s: clapping-fc p=0.5 q4/q4 step time <= 1.15x loopback step time"]
    assert verdict == "MET" and value == pytest.approx(1.1)
    verdict, value = verdicts["100 Mbit/s: clapping-fc p=0.5 q4/q4 time-to-target >= 2x shorter than uncompressed"]
    assert verdict == "MET" and value == pytest.approx(0.6 / 0.22)
    # on 25 Mbit/s the q4/q4 run is the only clapping-fc, so it is the main one there
    verdict, value = verdicts["25 Mbit/s: clapping-fc time-to-target >= 4x shorter than uncompressed"]
    assert verdict == "MET" and value == pytest.approx(5.0)


def test_a_malformed_codec_pair_is_refused_with_the_expected_form():
    import slow_network

    import argparse

    args = argparse.Namespace(forward_codec="q4", backward_codec="q8", p=0.5, fu_p=[0.5], tiny=False, fc_extra=["q4"])
    with pytest.raises(SystemExit, match="FORWARD/BACKWARD"):
        slow_network.make_variants(args)
    args.fc_extra = ["q4/q4"]
    labels = [v.label for v in slow_network.make_variants(args)]
    assert labels == ["uncompressed", "clapping-fc p=0.5", "clapping-fc p=0.5 q4/q4", "clapping-fu p=0.5"]
