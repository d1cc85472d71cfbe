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

ROOT = Path(__file__).resolve().parents[2]
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
    # the baselines already ran in tiny_run: here the flags that leave them out
    return _launch(tmp_path_factory.mktemp("slow_network_delay"), "--tiny", "--delay-ms", "10", "--no-direct",
                   "--no-aqsgd")


def _has_autotune() -> bool:
    import _slow_network_settings as settings

    return settings.strategy_accepts("autotune")


def test_tiny_mode_runs_every_setting_and_writes_its_results(tiny_run):
    proc, out, _ = tiny_run
    assert proc.returncode == 0, proc.stdout_text[-4000:] + proc.stderr_text[-4000:]
    data = json.loads((out / "slow_network.json").read_text())
    runs = {(r["link"], r["variant"]): r for r in data["runs"]}
    expected = {("loopback", "uncompressed"), ("100 Mbit/s", "uncompressed"), ("100 Mbit/s", "direct"),
                ("100 Mbit/s", "aqsgd"), ("100 Mbit/s", "clapping-fc p=0.5")}
    if _has_autotune():
        expected.add(("100 Mbit/s", "auto p=0.5"))
    assert set(runs) == expected
    assert runs[("100 Mbit/s", "direct")]["kind"] == "direct" and runs[("100 Mbit/s", "aqsgd")]["kind"] == "aqsgd"
    for r in runs.values():
        assert r["error"] is None
        assert r["steps"] == data["settings"]["steps"] and r["median_step_s"] > 0
        assert r["vals"] and r["vals"][-1]["step"] == data["settings"]["steps"]
    assert (out / "slow_network.csv").read_text().count("\n") == 1 + len(runs)
    assert (out / "slow_network.png").stat().st_size > 0
    # the targets, recomputed from the runs (their values mean little at this size, but the arithmetic must hold)
    loop, unc = runs[("loopback", "uncompressed")], runs[("100 Mbit/s", "uncompressed")]
    fc = runs[("100 Mbit/s", "clapping-fc p=0.5")]
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
    for key in [k for k in targets if k.startswith("100 Mbit/s: auto")]:  # the auto row: judged like clapping-fc
        targets.pop(key)
    # no delay: no delay-floor target; and 25 Mbit/s, a link the tiny mode does not have
    assert [(t["value"], t["verdict"].split(" (")[0]) for t in targets.values()] == [(None, "not measured")]
    # every shaped run is in the link's order to the target, those that reached it first
    order = data["first_to_target"]["100 Mbit/s"]
    assert {e["variant"] for e in order} == {v for link, v in expected if link == "100 Mbit/s"}
    reached = [e["time_to_target_s"] for e in order if e["time_to_target_s"] is not None]
    assert reached == sorted(reached) and order[0]["time_to_target_s"] is not None  # uncompressed reaches its own
    assert [e["time_to_target_s"] is None for e in order] == sorted(e["time_to_target_s"] is None for e in order)
    assert "first to the target" in proc.stdout_text


def test_tiny_mode_counts_bytes_on_the_wire_and_at_the_strategy(tiny_run):
    proc, out, _ = tiny_run
    assert proc.returncode == 0, proc.stderr_text[-4000:]
    data = json.loads((out / "slow_network.json").read_text())
    fp32 = data["settings"]["fp32_message_bytes"]
    steps = data["settings"]["steps"]
    for r in data["runs"]:
        totals = r["byte_totals"]
        # the strategy's exact totals cover every step; the per-step series holds each step's own numbers (the
        # strategy logs them a step late: re-aligned), so the last step's are only in the totals
        assert totals["steps"] == steps and r["bytes_per_step"] == pytest.approx(totals["bytes"] / steps)
        series = r["bytes_per_step_series"]
        assert r["metrics_lag"] == 1 and series[-1] is None and None not in series[:-1]
        assert sum(series[:-1]) < totals["bytes"]
        if r["kind"] == "uncompressed":
            assert r["bytes_per_step"] >= 2 * fp32  # one boundary, both directions, fp32 plus headers
            assert min(series[:-1]) >= 2 * fp32
            assert r["distinct_samples"] == steps * data["settings"]["batch"]
        elif r["kind"] == "aqsgd":
            # every sample is new in 3 steps: activations go in full (first visits), only gradients are compressed
            assert all(2 * fp32 > b > fp32 for b in series[:-1])
        elif r["kind"] == "direct":
            assert all(b < r["fp32_bytes_per_step"] / 3 for b in series[:-1])  # q4 forward, q8 backward throughout
        else:
            # q4 forward, q8 backward, after the first step (the warm start sends it in full precision)
            assert series[0] > fp32 and all(b < r["fp32_bytes_per_step"] / 3 for b in series[1:-1])
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
    import _slow_network_report as report

    rows = [_row("loopback", "uncompressed", "uncompressed", 0.2, [3.0, 2.0]),
            _row("100 Mbit/s", "uncompressed", "uncompressed", 0.6, [3.0, 2.0], 100.0),
            _row("100 Mbit/s", "clapping-fc p=0.5", "clapping-fc", 0.3, [3.0, 2.1, 2.05], 100.0),
            _row("100 Mbit/s", "clapping-fc p=0.5 q4/q4", "clapping-fc", 0.22, [3.0, 2.0], 100.0),
            _row("25 Mbit/s", "uncompressed", "uncompressed", 2.0, [3.0, 2.0], 25.0),
            _row("25 Mbit/s", "clapping-fc p=0.5 q4/q4", "clapping-fc", 0.4, [2.5, 1.9], 25.0)]
    report.add_comparisons(rows)
    verdicts = {t["target"]: (t["verdict"], t["value"]) for t in report.evaluate_targets(rows)}
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
    import _slow_network_settings as settings

    import argparse

    args = argparse.Namespace(forward_codec="q4", backward_codec="q8", p=0.5, fu_p=[0.5], tiny=False, fc_extra=["q4"],
                              no_direct=True, no_aqsgd=True, no_auto=True)
    with pytest.raises(SystemExit, match="FORWARD/BACKWARD"):
        settings.make_variants(args)
    args.fc_extra = ["q4/q4"]
    labels = [v.label for v in settings.make_variants(args)]
    assert labels == ["uncompressed", "clapping-fc p=0.5", "clapping-fc p=0.5 q4/q4", "clapping-fu p=0.5"]


def _variant_args(**kw):
    base = dict(forward_codec="q4", backward_codec="q8", p=0.5, fu_p=[0.5, 0.2], tiny=False, fc_extra=["q4/q4"],
                no_direct=False, no_aqsgd=False, no_auto=False, no_loopback_fc=False)
    return argparse.Namespace(**dict(base, **kw))


def test_the_baselines_run_with_clappings_codecs_and_no_lazy_sampling_and_each_can_be_left_out():
    import _slow_network_settings as settings

    variants = {v.label: v for v in settings.make_variants(_variant_args())}
    direct, aq = variants["direct"], variants["aqsgd"]
    assert (direct.variant, direct.p, direct.forward_codec, direct.backward_codec) == ("direct", 1.0, "q4", "q8")
    assert (aq.variant, aq.p, aq.forward_codec, aq.backward_codec) == ("aqsgd", 1.0, "q4", "q8")
    # AQ-SGD needs the sample ids that LazySamplingDataModule(p=1) reports; nothing else gets wrapped at p = 1
    assert aq.sample_ids and not direct.sample_ids and not variants["uncompressed"].sample_ids
    assert list(variants)[:4] == ["uncompressed", "direct", "aqsgd", "clapping-fc p=0.5"]
    assert not any(v.autotune for label, v in variants.items() if label != "auto p=0.5")
    left = [v.label for v in settings.make_variants(_variant_args(no_direct=True, no_aqsgd=True, no_auto=True))]
    assert left == ["uncompressed", "clapping-fc p=0.5", "clapping-fc p=0.5 q4/q4", "clapping-fu p=0.5",
                    "clapping-fu p=0.2"]
    tiny = [v.label for v in settings.make_variants(_variant_args(tiny=True, no_auto=True))]
    assert tiny == ["uncompressed", "direct", "aqsgd", "clapping-fc p=0.5"]
    # loopback: uncompressed and the main clapping-fc only, whatever comes first in the list
    loop = settings.loopback_variants(settings.make_variants(_variant_args()), _variant_args())
    assert [v.label for v in loop] == ["uncompressed", "clapping-fc p=0.5"]
    assert [v.label for v in settings.loopback_variants(settings.make_variants(_variant_args()),
                                                            _variant_args(no_loopback_fc=True))] == ["uncompressed"]


def test_the_auto_row_follows_the_strategys_autotune_parameter(monkeypatch):
    import _slow_network_settings as settings

    monkeypatch.setattr(settings, "strategy_accepts", lambda name: name == "autotune")
    variants = settings.make_variants(_variant_args())
    auto = variants[-1]
    assert (auto.label, auto.variant, auto.p, auto.autotune) == ("auto p=0.5", "clapping-fc", 0.5, True)
    assert auto.label not in [v.label for v in settings.loopback_variants(variants, _variant_args())]
    assert not any(v.autotune for v in settings.make_variants(_variant_args(no_auto=True)))
    assert auto.schedule is None  # the run's --schedule
    both = settings.make_variants(_variant_args(auto_schedule=True))
    assert [(v.label, v.schedule) for v in both if v.autotune] == [("auto p=0.5", None),
                                                                   ("auto p=0.5 schedule=auto", "auto")]
    frontier = {v.label: v for v in settings.make_variants(_variant_args(frontier=True))}
    best = frontier["clapping-fu p=0.5 randk fresh-q4"]  # the quality benchmark's best frontier configuration
    assert (best.variant, best.p, best.forward_codec, best.backward_codec, best.fresh_codec) == (
        "clapping-fu", 0.5, "randk:0.1+q4", "randk:0.1+q4", "q4:fp16")
    assert best.label not in {v.label for v in variants}  # only with --frontier
    monkeypatch.setattr(settings, "strategy_accepts", lambda name: False)
    assert not any(v.autotune for v in settings.make_variants(_variant_args()))


def test_byte_numbers_logged_a_step_late_are_put_back_on_their_own_step():
    import _slow_network_worker as worker

    # as the recorder reads trainer.callback_metrics at the end of each step: the strategy's values of step t - 1
    recorded = [{"step": 1, "seconds": 0.5, "tx": 10, "train_loss": 3.0},
                {"step": 2, "seconds": 0.4, "tx": 11, "train_loss": 2.9, "clapping/bytes": 900.0,
                 "clapping/b0_fwd_bytes": 500.0},
                {"step": 3, "seconds": 0.3, "tx": 12, "train_loss": 2.8, "clapping/bytes": 200.0,
                 "clapping/b0_fwd_bytes": 100.0}]
    assert worker.metrics_lag(recorded) == 1
    aligned = worker.align_step_metrics(recorded, 1)
    assert [s.get("clapping/bytes") for s in aligned] == [900.0, 200.0, None]
    assert [s.get("clapping/b0_fwd_bytes") for s in aligned] == [500.0, 100.0, None]
    # what is the step's own stays where it is
    assert [(s["step"], s["seconds"], s["tx"], s["train_loss"]) for s in aligned] == [
        (s["step"], s["seconds"], s["tx"], s["train_loss"]) for s in recorded]
    # a strategy that logs every step's own numbers: nothing moves
    same_step = [dict(s, **{"clapping/bytes": 1.0}) for s in recorded]
    assert worker.metrics_lag(same_step) == 0
    assert worker.align_step_metrics(same_step, 0) == same_step
    assert worker.metrics_lag([]) == 0 and worker.metrics_lag(recorded[:1]) == 0


def test_results_of_quick_or_delayed_runs_do_not_overwrite_the_full_runs_files():
    import _slow_network_settings as settings

    def stem(mode_name, links, given=None):
        mode = settings.Mode(mode_name, links=[settings.parse_link(x) for x in links])
        return settings.output_stem(mode, argparse.Namespace(stem=given))

    assert stem("full", ["100", "25"]) == "slow_network"
    assert stem("quick", ["100", "25"]) == "slow_network_quick"
    assert stem("quick", ["100@0", "100@25", "25@25"]) == "slow_network_delay_quick"
    assert stem("full", ["100", "25@25"]) == "slow_network_delay"
    assert stem("quick", ["100@25"], given="mine") == "mine"


# ------------------------------------------------------------------------------------------------ links with delay


def test_links_parse_with_and_without_a_delay():
    import _slow_network_settings as settings

    link = settings.parse_link
    assert link("100") == settings.LinkSpec(100.0, None)
    assert link("100@25") == link("100@25ms") == settings.LinkSpec(100.0, 25.0)
    assert link("25@0").delay_ms == 0.0 and link("25@0").kind == "tun+relay" and link("25").kind == "veth+tbf"
    assert (link("100").label, link("100@25").label) == ("100 Mbit/s", "100 Mbit/s 25 ms")
    for bad in ("fast", "100@", "100@-5", "0@10"):
        with pytest.raises(argparse.ArgumentTypeError):
            link(bad)
    assert settings._ms("100ms") == 100.0 and settings._ms("0.1s") == 100.0


def test_delay_ms_applies_to_every_link_given_without_its_own():
    import _slow_network_settings as settings

    ns = argparse.Namespace(tiny=False, quick=True, steps=None, val_every=None, val_batches=None, skip=None, seed=None,
                            links=[settings.parse_link("100"), settings.parse_link("25@5")], delay_ms=25.0)
    mode = settings.make_mode(ns)
    assert [(x.rate_mbit, x.delay_ms) for x in mode.links] == [(100.0, 25.0), (25.0, 5.0)]
    ns.delay_ms, ns.links = None, None
    assert [(x.rate_mbit, x.delay_ms) for x in settings.make_mode(ns).links] == [(100.0, None), (25.0, None)]


def test_every_delayed_link_is_judged_on_its_own():
    import _slow_network_report as report

    rows = [_row("loopback", "uncompressed", "uncompressed", 0.2, [3.0, 2.0]),
            _row("100 Mbit/s 0 ms", "uncompressed", "uncompressed", 0.6, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 0 ms", "clapping-fc p=0.5", "clapping-fc", 0.22, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 25 ms", "uncompressed", "uncompressed", 1.2, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 25 ms", "clapping-fc p=0.5", "clapping-fc", 0.5, [3.0, 2.0], 100.0)]
    for r in rows:
        r["delay_ms"] = None if r["rate_mbit"] is None else float(r["link"].split()[2])
        r["per_rank"] = [{}] * 4
    report.add_comparisons(rows)
    verdicts = {t["target"]: (t["verdict"], t["value"]) for t in report.evaluate_targets(rows)}
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
    # the physical-limit target on the delayed 100 Mbit/s link, and uncompressed's distance from it, reported only
    floor = "100 Mbit/s 25 ms: clapping-fc step time <= 1.25x the delay floor (loopback step + 2 x (stages - 1) x " \
            "one-way delay)"
    assert verdicts[floor] == ("NOT MET", pytest.approx(0.5 / 0.35))
    assert verdicts["100 Mbit/s 25 ms: uncompressed step time / delay floor"] == ("reported (not a target)",
                                                                                 pytest.approx(1.2 / 0.35))
    # not on the link without delay (there the 1.15x loopback target says it all)
    assert not [t for t in verdicts if t.startswith("100 Mbit/s 0 ms") and "delay floor" in t]


def _delayed_rows(fc_step, extra=()):
    rows = [_row("loopback", "uncompressed", "uncompressed", 0.2, [3.0, 2.0]),
            _row("100 Mbit/s 25 ms", "uncompressed", "uncompressed", 1.2, [3.0, 2.0], 100.0),
            _row("100 Mbit/s 25 ms", "clapping-fc p=0.5", "clapping-fc", fc_step, [3.0, 2.0], 100.0), *extra,
            _row("25 Mbit/s 25 ms", "uncompressed", "uncompressed", 2.4, [3.0, 2.0], 25.0),
            _row("25 Mbit/s 25 ms", "clapping-fc p=0.5", "clapping-fc", 0.5, [3.0, 2.0], 25.0)]
    for r in rows:
        r["delay_ms"] = None if r["rate_mbit"] is None else 25.0
        r["per_rank"] = [{}] * 4
    return rows


def test_the_delay_floor_target_holds_up_to_125_percent_of_the_floor_on_delayed_100_mbit_links():
    import _slow_network_report as report

    # floor: 0.2 s loopback + 2 x 3 x 25 ms = 0.35 s; 1.25 x 0.35 = 0.4375 s
    def floor_verdicts(fc_step, extra=()):
        rows = _delayed_rows(fc_step, extra)
        report.add_comparisons(rows)
        return {t["target"]: (t["verdict"], t["value"], t["bound"]) for t in report.evaluate_targets(rows)
                if "delay floor" in t["target"]}

    key = ("100 Mbit/s 25 ms: clapping-fc step time <= 1.25x the delay floor (loopback step + 2 x (stages - 1) x "
           "one-way delay)")
    assert floor_verdicts(0.43)[key] == ("MET", pytest.approx(0.43 / 0.35), 1.25)
    assert floor_verdicts(0.4375)[key][0] == "MET"
    assert floor_verdicts(0.44)[key] == ("NOT MET", pytest.approx(0.44 / 0.35), 1.25)
    # judged on 100 Mbit/s links only: 25 Mbit/s has its time-to-target target
    assert [k for k in floor_verdicts(0.43) if k.startswith("25 Mbit/s")] == []
    # every further clapping-fc row of the link (codec pairs, auto) is judged too; other baselines only in the table
    auto = _row("100 Mbit/s 25 ms", "auto p=0.5", "clapping-fc", 0.42, [3.0, 2.0], 100.0)
    direct = _row("100 Mbit/s 25 ms", "direct", "direct", 0.41, [3.0, 2.0], 100.0)
    verdicts = floor_verdicts(0.5, (auto, direct))
    assert verdicts[key.replace("clapping-fc", "auto p=0.5")] == ("MET", pytest.approx(0.42 / 0.35), 1.25)
    assert verdicts[key][0] == "NOT MET"
    assert not [k for k in verdicts if "direct" in k]
    assert direct["x_delay_floor"] == pytest.approx(0.41 / 0.35)
    # a failed clapping-fc run: not measured, not met
    rows = _delayed_rows(0.43)
    rows[2]["error"] = "rank 1 exited with 1"
    report.add_comparisons(rows)
    verdict = next(t["verdict"] for t in report.evaluate_targets(rows) if t["target"] == key)
    assert verdict.startswith("not measured")


def test_each_link_lists_its_variants_by_time_to_target():
    import _slow_network_report as report

    # target on 100 Mbit/s 25 ms: uncompressed's final 2.0, reached at step 20 after 24 s
    direct = _row("100 Mbit/s 25 ms", "direct", "direct", 0.5, [2.5, 1.9], 100.0)  # step 20: 20 s
    aq = _row("100 Mbit/s 25 ms", "aqsgd", "aqsgd", 1.0, [2.5, 2.2], 100.0)  # not reached, ends at 2.2
    fu = _row("100 Mbit/s 25 ms", "clapping-fu p=0.5", "clapping-fu", 0.6, [3.0, 2.1], 100.0)  # not reached, 2.1
    rows = _delayed_rows(0.4, (direct, aq, fu))  # clapping-fc: 0.4 s x 20 steps = 8 s
    report.add_comparisons(rows)
    order = report.first_to_target(rows)
    assert list(order) == ["100 Mbit/s 25 ms", "25 Mbit/s 25 ms"]
    assert [(e["variant"], e["time_to_target_s"]) for e in order["100 Mbit/s 25 ms"]] == [
        ("clapping-fc p=0.5", pytest.approx(8.0)), ("direct", pytest.approx(10.0)),
        ("uncompressed", pytest.approx(24.0)), ("clapping-fu p=0.5", None), ("aqsgd", None)]


def test_a_link_check_that_cannot_measure_says_so_instead_of_stopping_the_benchmark():
    import _slow_network_links as links
    import _slow_network_settings as settings
    from _netns import Endpoint, NetnsError

    class BrokenLab:
        def measure(self, src, dst, pings, seconds):
            raise NetnsError("probe server did not start")

        def relay_stats(self):
            return None

    args = argparse.Namespace(burst="8kb", latency="100ms")
    eps = [Endpoint("ns0", "d0", "10.77.1.1"), Endpoint("ns1", "d1", "10.77.1.2")]
    check = links.check_link(BrokenLab(), settings.LinkSpec(100.0, 25.0), eps, args)
    assert check["verdict"] == "FAILED" and "probe server did not start" in check["problems"][0]
    assert check["rtt_ms_median"] is None and check["expected_rtt_ms"] == 50.0
    links.print_link_checks([check])  # prints dashes for what it could not measure


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
    assert not (out / "slow_network.json").exists()  # a delayed run has its own files
    data = json.loads((out / "slow_network_delay.json").read_text())
    [check] = data["links"]
    assert check["link"] == "100 Mbit/s 10 ms" and check["verdict"] == "ok", check["problems"]
    runs = {(r["link"], r["variant"]): r for r in data["runs"]}
    expected = {("loopback", "uncompressed"), ("100 Mbit/s 10 ms", "uncompressed"),
                ("100 Mbit/s 10 ms", "clapping-fc p=0.5")}  # --no-direct --no-aqsgd
    if _has_autotune():
        expected.add(("100 Mbit/s 10 ms", "auto p=0.5"))
    assert set(runs) == expected
    for r in (r for r in data["runs"] if r["link"] != "loopback"):
        assert r["error"] is None and r["link_kind"] == "tun+relay" and r["delay_ms"] == 10.0
        # the ranks' traffic really crossed the relay (the link check above shows that it delays)
        sent = sum(e["strategy_sent_bytes"] for e in r["per_rank"])
        assert r["relay_wire_bytes"] >= sent > 0
        assert r["relay"]["write_errors"] == 0
        loop = runs[("loopback", "uncompressed")]["median_step_s"]
        assert r["delay_floor_step_s"] == pytest.approx(loop + 2 * (2 - 1) * 0.010)  # 2 stages, 10 ms
    assert "links as measured before their runs" in proc.stdout_text
    targets = {t["target"]: t for t in data["targets"]}
    fc = runs[("100 Mbit/s 10 ms", "clapping-fc p=0.5")]
    floor = targets["100 Mbit/s 10 ms: clapping-fc step time <= 1.25x the delay floor (loopback step + 2 x (stages "
                    "- 1) x one-way delay)"]
    assert floor["value"] == pytest.approx(fc["median_step_s"] / fc["delay_floor_step_s"])
    assert floor["verdict"] == ("MET" if floor["value"] <= 1.25 else "NOT MET")
    unc = targets["100 Mbit/s 10 ms: uncompressed step time / delay floor"]
    assert unc["verdict"] == "reported (not a target)" and unc["value"] == pytest.approx(
        runs[("100 Mbit/s 10 ms", "uncompressed")]["x_delay_floor"])
    assert (out / "slow_network_delay.png").stat().st_size > 0


# ------------------------------------------------------------------------------------- mixed cluster: sites, codecs


def _mode_args(links, sites, delay_ms=None, tiny=False):
    import _slow_network_settings as settings

    return argparse.Namespace(tiny=tiny, quick=True, steps=None, val_every=None, val_batches=None, skip=None,
                              seed=None, links=[settings.parse_link(x) for x in links], delay_ms=delay_ms,
                              sites=None if sites is None else settings.parse_sites(sites))


def test_sites_give_one_site_per_stage_on_delayed_links_only():
    import _slow_network_settings as settings

    assert settings.parse_sites("0,0,1,1") == (0, 0, 1, 1) and settings.parse_sites("2, 0") == (2, 0)
    for bad, why in (("", "one site number"), ("0,,1", "one site number"), ("a,b", "one site number"),
                     ("0,-1", "one site number"), ("1,1,1,1", "at least two sites")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            settings.parse_sites(bad)
    mode = settings.make_mode(_mode_args(["25@25", "100@0"], "0,0,1,1"))
    assert [x.sites for x in mode.links] == [(0, 0, 1, 1)] * 2
    assert [(x.rate_mbit, x.delay_ms) for x in mode.links] == [(25.0, 25.0), (100.0, 0.0)]
    assert settings.make_mode(_mode_args(["100"], "0,1,1,1", delay_ms=10)).links[0].sites == (0, 1, 1, 1)
    assert settings.make_mode(_mode_args(["25@25"], None)).links[0].sites is None
    with pytest.raises(SystemExit, match="needs delayed links.*100 Mbit/s"):
        settings.make_mode(_mode_args(["25@25", "100"], "0,0,1,1"))
    with pytest.raises(SystemExit, match="4 stages need 4 site numbers, got 3"):
        settings.make_mode(_mode_args(["25@25"], "0,0,1"))
    assert settings.make_mode(_mode_args(["25@25"], "0,1", tiny=True)).links[0].sites == (0, 1)


def test_a_mixed_link_never_reads_as_a_uniform_one():
    import _slow_network_links as links
    import _slow_network_settings as settings

    uniform = settings.parse_link("25@25")
    mixed = settings.make_mode(_mode_args(["25@25"], "0,0,1,1")).links[0]
    assert mixed.label == "25 Mbit/s 25 ms (sites 0,0,1,1)" and uniform.label == "25 Mbit/s 25 ms"
    assert mixed.key == "25mbit_25ms_sites0-0-1-1" and uniform.key == "25mbit_25ms"
    assert mixed != uniform and mixed.kind == uniform.kind == "tun+relay"
    args = argparse.Namespace(burst="8kb", latency="100ms")
    assert "between sites only" in links.shaping_text(mixed, args)
    assert "sites" not in links.shaping_text(uniform, args)
    for name, stem in (("quick", "slow_network_delay_mixed_quick"), ("full", "slow_network_delay_mixed")):
        mode = settings.Mode(name, links=[mixed])
        assert settings.output_stem(mode, argparse.Namespace(stem=None)) == stem


def test_the_sites_of_the_stages_are_given_to_the_endpoints_that_run_them():
    import _slow_network_links as links

    # endpoint (global rank) i runs stage S - 1 - i: the per-stage list is reversed
    assert links.endpoint_sites((0, 0, 0, 1)) == [1, 0, 0, 0]
    assert links.endpoint_sites(None) is None
    # the link check: neighbouring stages across sites (the slow boundary), and neighbours within a site
    assert links.probe_pairs(None, 4) == ((0, 1), None)
    assert links.probe_pairs((0, 0, 1, 1), 4) == ((1, 2), (0, 1))
    assert links.probe_pairs((0, 0, 0, 1), 4) == ((0, 1), (1, 2))
    assert links.probe_pairs((0, 1), 2) == ((0, 1), None)


def test_the_link_check_of_a_mixed_cluster_measures_across_sites_and_within_one():
    import _slow_network_links as links
    import _slow_network_settings as settings
    from _netns import Endpoint

    class FakeLab:
        def __init__(self, same_rtt):
            self.pairs, self.same_rtt = [], same_rtt

        def measure(self, src, dst, pings, seconds):
            self.pairs.append((src.addr, dst.addr))
            cross = src.ns[-1] != dst.ns[-1]  # the namespace's last letter is its site here
            rtt = 50.5 if cross else self.same_rtt
            return dict(dict.fromkeys(links.MEASURED, None), rtt_ms_min=rtt, rtt_ms_median=rtt,
                        rtt_ms_max=rtt, owd_ms_there_min=rtt / 2, owd_ms_back_min=rtt / 2,
                        steady_mbit_s=24.0 if cross else 900.0, mbit_s=20.0 if cross else 800.0)

        def relay_stats(self):
            return None

    # stages 0,0,1,1 run on endpoints 3,2,1,0: endpoints 0 and 1 are site 1, endpoints 2 and 3 site 0
    eps = [Endpoint(f"ns{i}s{site}", f"d{i}", f"10.77.1.{i + 1}") for i, site in enumerate((1, 1, 0, 0))]
    args = argparse.Namespace(burst="8kb", latency="100ms")
    link = settings.make_mode(_mode_args(["25@25"], "0,0,1,1")).links[0]
    lab = FakeLab(same_rtt=0.4)
    check = links.check_link(lab, link, eps, args)
    assert lab.pairs == [("10.77.1.2", "10.77.1.3"), ("10.77.1.1", "10.77.1.2")]
    assert (check["from_stage"], check["to_stage"], check["rtt_ms_median"]) == (2, 1, 50.5)
    assert check["verdict"] == "ok", check["problems"]
    assert check["sites"] == [0, 0, 1, 1] and check["same_site"]["rtt_ms_median"] == 0.4
    assert (check["same_site"]["from_stage"], check["same_site"]["to_stage"]) == (3, 2)
    slow = links.check_link(FakeLab(same_rtt=50.5), link, eps, args)  # the LAN is shaped too: wrong
    assert slow["verdict"] == "OFF" and "same-site RTT" in slow["problems"][0]
    links.print_link_checks([check, slow])
    # the relay gets the sites in the order of its endpoints, and the queue bound as before
    class RecordingLab:
        def set_delay_links(self, *given, **named):
            self.given = (given, named)

    lab = RecordingLab()
    assert links.configure_link(lab, link, args, [], eps) == eps
    assert lab.given == ((25.0, 25.0, 100.0), {"sites": [1, 1, 0, 0]})
    links.configure_link(lab, settings.parse_link("25@25"), args, [], eps)
    assert lab.given == ((25.0, 25.0, 100.0), {"sites": None})
    # without sites: stage namespaces 0 and 1 as before, nothing within a site
    lab = FakeLab(same_rtt=0.4)
    plain = links.check_link(lab, settings.parse_link("25@25"), eps[:2], args)
    assert lab.pairs == [("10.77.1.1", "10.77.1.2")] and plain["same_site"] is None and plain["sites"] is None


def test_the_delay_floor_of_a_mixed_cluster_counts_the_boundaries_between_sites():
    import _slow_network_report as report

    rows = _delayed_rows(0.4)
    for r in rows[1:3]:
        r["sites"] = [0, 0, 1, 1]  # one boundary crosses sites: 0.2 s + 2 x 1 x 25 ms
    report.add_comparisons(rows)
    assert rows[2]["delay_floor_step_s"] == pytest.approx(0.2 + 2 * 0.025)
    assert rows[4]["delay_floor_step_s"] == pytest.approx(0.2 + 2 * 3 * 0.025)  # no sites: every boundary


def test_a_codec_per_boundary_becomes_the_strategys_map():
    import _slow_network_settings as settings
    from lightning_clapping.codecs import get_codec

    codec_arg = settings.codec_arg
    assert codec_arg("q4", 3) == "q4" and codec_arg("q4", 3, get_codec) == "q4"
    assert codec_arg("-,q4,-", 3, get_codec) == {1: "q4"}
    assert codec_arg("q8, -, topk:0.1+q8", 3, get_codec) == {0: "q8", 2: "topk:0.1+q8"}
    assert codec_arg("-,-,-", 3) == {} and codec_arg("-", 1) == {}
    for bad, why in (("-,q4", "3 boundaries need 3 entries, got 2"), ("-,q4,-,q4", "got 4"),
                     ("-,,q4", "boundary 1 is empty")):
        with pytest.raises(ValueError, match=why):
            codec_arg(bad, 3)
    with pytest.raises(ValueError, match="boundary 1: unknown codec 'q4x'"):
        codec_arg("-,q4x,-", 3, get_codec)
    assert codec_arg("-,q4x,-", 3) == {1: "q4x"}  # the launcher checks only the form: names are the worker's
    # the strategy takes the map: boundary 1 compressed, the others sent uncompressed
    import lightning_clapping

    strategy = lightning_clapping.ClappingStrategy(split_points=["a", "b", "c"], variant="clapping-fc",
                                                   forward_codec=codec_arg("-,q4,-", 3, get_codec),
                                                   backward_codec=codec_arg("-,q8,-", 3, get_codec))
    assert strategy.make_rule(0, "fwd", True).variant == "uncompressed"
    assert strategy.make_rule(1, "fwd", True).codec.name == "q4" and strategy.make_rule(1, "bwd", True).codec.name \
        == "q8"


def test_a_per_boundary_codec_pair_is_a_readable_variant_and_its_length_is_checked():
    import _slow_network_settings as settings

    variants = settings.make_variants(_variant_args(fc_extra=["-,q4,-/-,q8,-"], no_auto=True))
    extra = next(v for v in variants if "," in v.forward_codec)
    assert (extra.label, extra.variant, extra.forward_codec, extra.backward_codec) == (
        "clapping-fc p=0.5 -,q4,-/-,q8,-", "clapping-fc", "-,q4,-", "-,q8,-")
    settings.check_variant_codecs(variants, 3)
    short = settings.make_variants(_variant_args(fc_extra=["-,q4/-,q8,-"], no_auto=True))
    with pytest.raises(SystemExit, match="clapping-fc p=0.5 -,q4/-,q8,-: .*3 boundaries need 3 entries, got 2"):
        settings.check_variant_codecs(short, 3)


def test_a_per_boundary_codec_list_that_starts_uncompressed_is_read_as_a_value_not_an_option():
    import slow_network

    # parsing gets past --fc-extra and --forward-codec, and the run is refused later for its plain link
    argv = ["--fc-extra", "-,q4,-/-,q8,-", "-,-,q4/q8", "--forward-codec", "-,q4,-", "--links", "25", "--sites",
            "0,0,1,1"]
    with pytest.raises(SystemExit, match="--sites needs delayed links"):
        slow_network.main(argv)


def test_loopback_only_runs_every_variant_on_loopback_and_no_shaped_link():
    import _slow_network_settings as settings

    variants = settings.make_variants(_variant_args(no_auto=True))
    loop = settings.loopback_variants(variants, _variant_args(loopback_only=True))
    assert [v.label for v in loop] == [v.label for v in variants]
    # without the flag: uncompressed and the main clapping-fc, as before
    assert len(settings.loopback_variants(variants, _variant_args(loopback_only=False))) == 2


def test_what_autotune_chose_is_recorded_per_boundary_and_direction():
    import _slow_network_worker as worker
    from lightning_clapping.autotune.tune import Choice

    def choice(boundary, fwd, bwd):
        return Choice(boundary, "clapping-fc", fwd, bwd, 0, 0, 0.0, 0.0, 0.0, 0.0, True, True)

    chosen = {1: choice(1, "q4", "uncompressed"), 0: choice(0, "bf16", "q8")}
    assert worker.autotune_choice(chosen) == {"0": {"fwd": "bf16", "bwd": "q8"},
                                                    "1": {"fwd": "q4", "bwd": "uncompressed"}}
    assert worker.autotune_choice(None) is None and worker.autotune_choice({}) is None


def test_a_bottleneck_row_runs_direct_or_under_the_variant_it_names():
    import _slow_network_settings as settings

    rows = {v.label: v for v in settings.make_variants(
        _variant_args(no_auto=True, bottleneck=["8:q8/q8", "8:q4/q8:clapping-fc"]))}
    direct, fc = rows["direct bn8 q8/q8"], rows["clapping-fc p=0.5 bn8 q4/q8"]
    assert (direct.variant, direct.p, direct.bottleneck, direct.forward_codec) == ("direct", 1.0, 8, "q8")
    assert (fc.variant, fc.p, fc.bottleneck, fc.forward_codec, fc.backward_codec) == ("clapping-fc", 0.5, 8, "q4", "q8")
    with pytest.raises(SystemExit, match=r"N:FORWARD/BACKWARD\[:VARIANT"):
        settings.make_variants(_variant_args(no_auto=True, bottleneck=["8:q4/q8:ef21"]))


def test_a_bottleneck_row_may_change_p_from_a_later_step():
    import _slow_network_settings as settings

    rows = {v.label: v for v in settings.make_variants(
        _variant_args(no_auto=True, bottleneck=["8:q4/q8:clapping-fc:1@125"]))}
    late = rows["clapping-fc p=0.5 then 1 from 125 bn8 q4/q8"]
    assert (late.variant, late.p, late.p_later, late.bottleneck) == ("clapping-fc", 0.5, (125, 1.0), 8)
    for bad in ("8:q4/q8:clapping-fc:1.5@125", "8:q4/q8:clapping-fc:1@0", "8:q4/q8:clapping-fc:x@3"):
        with pytest.raises(SystemExit, match="P2@STEP"):
            settings.make_variants(_variant_args(no_auto=True, bottleneck=[bad]))
