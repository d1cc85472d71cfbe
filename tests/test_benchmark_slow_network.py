"""The slow-network benchmark still runs end to end in its tiniest mode, also over a delayed link (the user-space
relay), checks its links against their configuration, and leaves no namespace or relay behind."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "slow_network.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _netns import delay_unavailable_reason, unavailable_reason  # noqa: E402


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _relay_processes(prefix: str) -> list[int]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmd = Path("/proc", pid, "cmdline").read_bytes()
        except OSError:
            continue
        if b"_delay_link.py\0relay" in cmd and prefix.encode() in cmd:
            found.append(int(pid))
    return found


def _launch(out: Path, *args: str, timeout: float = 300):
    """Run the benchmark as a user does; returns the process (with its output) and what it left behind."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script stops its ranks and deletes its namespaces itself
        try:
            proc.stdout_text, proc.stderr_text = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.stdout_text, proc.stderr_text = proc.communicate()
    prefixes = (f"clapbn{proc.pid}", f"clapprobe{proc.pid}", f"clapdprobe{proc.pid}")  # that run's namespaces
    left = {name for name in _namespaces() if name.startswith(prefixes)}
    relays = [pid for prefix in prefixes for pid in _relay_processes(prefix)]
    for pid in relays:  # report them (below), but do not leave them on the machine
        os.kill(pid, signal.SIGKILL)
    for name in left:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return proc, out, left | {f"relay process {pid}" for pid in relays}


def _needs_the_benchmark(delayed: bool = False) -> None:
    reason = delay_unavailable_reason() if delayed else unavailable_reason()
    if reason:
        pytest.skip(f"slow-network benchmark needs network namespaces{' and TUN devices' if delayed else ''}: "
                    f"{reason}")
    from examples.datasets import missing_reason

    reason = missing_reason("shakespeare")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    _needs_the_benchmark()
    return _launch(tmp_path_factory.mktemp("slow_network"), "--tiny")


@pytest.fixture(scope="module")
def tiny_delayed_run(tmp_path_factory):
    _needs_the_benchmark(delayed=True)
    return _launch(tmp_path_factory.mktemp("slow_network_delay"), "--tiny", "--delay-ms", "10")


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


# ------------------------------------------------------------------------------------------------ links with delay


def test_links_parse_with_and_without_a_delay():
    import slow_network

    link = slow_network.parse_link
    assert link("100") == slow_network.LinkSpec(100.0, None)
    assert link("100@25") == link("100@25ms") == slow_network.LinkSpec(100.0, 25.0)
    assert link("25@0").delay_ms == 0.0 and link("25@0").kind == "tun+relay" and link("25").kind == "veth+tbf"
    assert (link("100").label, link("100@25").label) == ("100 Mbit/s", "100 Mbit/s 25 ms")
    for bad in ("fast", "100@", "100@-5", "0@10"):
        with pytest.raises(argparse.ArgumentTypeError):
            link(bad)
    assert slow_network._ms("100ms") == 100.0 and slow_network._ms("0.1s") == 100.0


def test_delay_ms_applies_to_every_link_given_without_its_own():
    import slow_network

    ns = argparse.Namespace(tiny=False, quick=True, steps=None, val_every=None, val_batches=None, skip=None, seed=None,
                            links=[slow_network.parse_link("100"), slow_network.parse_link("25@5")], delay_ms=25.0)
    mode = slow_network.make_mode(ns)
    assert [(x.rate_mbit, x.delay_ms) for x in mode.links] == [(100.0, 25.0), (25.0, 5.0)]
    ns.delay_ms, ns.links = None, None
    assert [(x.rate_mbit, x.delay_ms) for x in slow_network.make_mode(ns).links] == [(100.0, None), (25.0, None)]


def test_every_delayed_link_is_judged_on_its_own():
    import slow_network

    rows = [_row("loopback", "uncompressed", "uncompressed", 0.2, [3.0, 2.0]),
            _row("100 Mbit/s 0 ms", "uncompressed", "uncompressed", 0.6, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 0 ms", "clapping-fc p=0.5", "clapping-fc", 0.22, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 25 ms", "uncompressed", "uncompressed", 1.2, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 25 ms", "clapping-fc p=0.5", "clapping-fc", 0.5, [3.0, 2.0], 100.0)]
    for r in rows:
        r["delay_ms"] = None if r["rate_mbit"] is None else float(r["link"].split()[2])
        r["per_rank"] = [{}] * 4
    slow_network.add_comparisons(rows)
    verdicts = {t["target"]: (t["verdict"], t["value"]) for t in slow_network.evaluate_targets(rows)}
    assert verdicts["100 Mbit/s 0 ms: clapping-fc step time <= 1.15x loopback step time"] == ("MET",
                                                                                             pytest.approx(1.1))
    assert verdicts["100 Mbit/s 25 ms: clapping-fc step time <= 1.15x loopback step time"] == ("NOT MET",
                                                                                              pytest.approx(2.5))
    assert verdicts["100 Mbit/s 25 ms: clapping-fc time-to-target >= 2x shorter than uncompressed"] == (
        "MET", pytest.approx(1.2 / 0.5))
    assert verdicts["25 Mbit/s: clapping-fc time-to-target >= 4x shorter than uncompressed"][0].startswith("not")
    # the floor of a synchronous step on a delayed link: loopback step + 2 x (stages - 1) x delay
    delayed = rows[4]
    assert delayed["delay_floor_step_s"] == pytest.approx(0.2 + 2 * 3 * 0.025)
    assert delayed["x_delay_floor"] == pytest.approx(0.5 / 0.35)
    assert rows[1]["delay_floor_step_s"] == pytest.approx(0.2)  # no delay: the floor is the loopback step


def test_a_link_check_that_cannot_measure_says_so_instead_of_stopping_the_benchmark():
    import slow_network
    from _netns import Endpoint, NetnsError

    class BrokenLab:
        def measure(self, src, dst, pings, seconds):
            raise NetnsError("probe server did not start")

        def relay_stats(self):
            return None

    args = argparse.Namespace(burst="8kb", latency="100ms")
    eps = [Endpoint("ns0", "d0", "10.77.1.1"), Endpoint("ns1", "d1", "10.77.1.2")]
    check = slow_network.check_link(BrokenLab(), slow_network.LinkSpec(100.0, 25.0), eps, args)
    assert check["verdict"] == "FAILED" and "probe server did not start" in check["problems"][0]
    assert check["rtt_ms_median"] is None and check["expected_rtt_ms"] == 50.0
    slow_network.print_link_checks([check])  # prints dashes for what it could not measure


def test_validate_only_measures_each_link_against_its_configuration(tmp_path):
    reason = delay_unavailable_reason()
    if reason:
        pytest.skip(f"delayed links need network namespaces and TUN devices: {reason}")
    proc, out, left = _launch(tmp_path, "--validate-only", "--links", "100", "50@10", timeout=120)
    assert proc.returncode == 0, proc.stdout_text[-4000:] + proc.stderr_text[-4000:]
    assert not left, f"left behind: {sorted(left)}"
    checks = {c["link"]: c for c in json.loads((out / "slow_network_links.json").read_text())["links"]}
    assert set(checks) == {"100 Mbit/s", "50 Mbit/s 10 ms"}
    veth, relay = checks["100 Mbit/s"], checks["50 Mbit/s 10 ms"]
    assert (veth["link_kind"], relay["link_kind"]) == ("veth+tbf", "tun+relay")
    assert veth["verdict"] == relay["verdict"] == "ok", (veth["problems"], relay["problems"])
    assert 20.0 <= relay["rtt_ms_min"] and relay["rtt_ms_median"] <= 35.0
    assert veth["rtt_ms_median"] < 10.0
    assert 0.6 * 50 <= relay["steady_mbit_s"] <= 1.1 * 50 and 0.6 * 100 <= veth["steady_mbit_s"] <= 1.1 * 100
    assert relay["relay"]["write_errors"] == 0 and veth["relay"] is None
    for line in ("100 Mbit/s       veth+tbf", "50 Mbit/s 10 ms  tun+relay"):  # the printed table
        assert line in proc.stdout_text


def test_tiny_mode_runs_over_a_delayed_link(tiny_delayed_run):
    proc, out, left = tiny_delayed_run
    assert proc.returncode == 0, proc.stdout_text[-4000:] + proc.stderr_text[-4000:]
    assert not left, f"left behind: {sorted(left)}"
    data = json.loads((out / "slow_network.json").read_text())
    [check] = data["links"]
    assert check["link"] == "100 Mbit/s 10 ms" and check["verdict"] == "ok", check["problems"]
    runs = {(r["link"], r["kind"]): r for r in data["runs"]}
    assert set(runs) == {("loopback", "uncompressed"), ("100 Mbit/s 10 ms", "uncompressed"),
                         ("100 Mbit/s 10 ms", "clapping-fc")}
    for r in (r for r in data["runs"] if r["link"] != "loopback"):
        assert r["error"] is None and r["link_kind"] == "tun+relay" and r["delay_ms"] == 10.0
        # the ranks' traffic really crossed the relay (the link check above shows that it delays)
        sent = sum(e["strategy_sent_bytes"] for e in r["per_rank"])
        assert r["relay_wire_bytes"] >= sent > 0
        assert r["relay"]["write_errors"] == 0
        loop = runs[("loopback", "uncompressed")]["median_step_s"]
        assert r["delay_floor_step_s"] == pytest.approx(loop + 2 * (2 - 1) * 0.010)  # 2 stages, 10 ms
    assert "links as measured before their runs" in proc.stdout_text
