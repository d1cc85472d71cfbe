"""Time to target against bandwidth: which setting reaches the target loss first on each link.

    python benchmarks/time_to_target.py [--links 10@25 25@25 50@25 100@25 200@25] [--out benchmarks/results]  (root)
    python benchmarks/time_to_target.py --from-json STEPS.json TRAJECTORIES.json      (re-combine, runs nothing)
    python benchmarks/time_to_target.py --tiny                                          (smoke test, a few minutes)

Settings: uncompressed, direct (4-bit forward / 8-bit backward, no error feedback, no lazy sampling), clapping-fc
p=0.5 (q4/q8), clapping-fu p=0.5 (q4/q8) and auto (clapping-fc p=0.5 with ``autotune=True``), all with GPipe unless
``--schedule`` says otherwise, on the 4-stage char-LM pipeline of ``benchmarks/slow_network.py``;
``--bottleneck 8:q8/q8`` adds the model with a trainable Bottleneck of width d/8 at every cut and q8 on its code
(direct), ``8:q4/q8:clapping-fc`` the same model under Clapping-FC at ``--p``.

Training every setting to the target on every link would take hours here (uncompressed at 10 Mbit/s needs about 5 s a
step), but the arithmetic of a run does not depend on the link (slow_network's runs reach identical losses on every
link), so the time to target splits into two measurements, both taken by slow_network itself (run as a subprocess):

1. step times: a short run of every setting on every link (``--timing-steps`` steps, the mean step time over the steps
   after the first ``--skip``; the mean, not the median: Clapping-FU's fresh steps are slower than its reuse steps,
   and the time to target pays for both). These runs also record what auto chose on each link (per boundary and
   direction, after its second step).
2. steps to target: one full-length run of each setting on loopback (uncompressed ``--steps`` steps, the compressed
   settings up to ``--budget`` times that; validation every ``--val-every`` steps on ``--val-batches`` fixed batches).
   Auto's trajectory depends on its choice, so each distinct choice it made across the links runs as a fixed
   clapping-fc with those codecs (``--fc-extra FWD/BWD``; a choice that differs per boundary, or leaves one
   uncompressed, as per-boundary strings such as ``-,q4,-``, ``-`` meaning uncompressed). The fixed run uses that
   choice from its first step; auto used q4/q8 for its first two steps.

Then, per link and setting: time to target = steps to target (the first validation at or below the target; the
target is the validation loss uncompressed reaches at its last step) x mean step time on that link; auto takes the
steps of its own choice on that link. A setting that never reaches the target within its budget is reported as "not
reached", never as a number. The report gives the speed-up over uncompressed and the first setting on each link.

Defaults and their cost on a 2-core machine (4 ranks, one thread each; the script prints its estimate at start):
25 timing steps (mean over steps 6-25, one validation on one batch) on 5 links x 5 settings, about 22 minutes
(uncompressed at 10 Mbit/s alone about 2.5, every run ~20 s of start-up, a link check per link); 250 full-length
steps (compressed up to 1.6 x 250 = 400) on loopback, validation every 10 steps on 4 batches, about 11-17 minutes (4
to 6 runs: one more per distinct choice of auto other than q4/q8). 33-39 minutes together. The 250 steps and the
budget are those of slow_network's earlier full run, where clapping-fc reached uncompressed's final loss within 400.

Results under ``--out``: ``STEM.json`` (every number, the commands, the machine, the link checks slow_network made
before the timing runs), ``STEM.csv`` (one row per link and setting), ``STEM.png`` (time to target against bandwidth,
log axes, one line per setting, "not reached" marked at the top); slow_network's own files ``STEM_steps.*`` and
``STEM_trajectories.*``, which ``--from-json`` re-combines.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_NETWORK = ROOT / "benchmarks" / "slow_network.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _slow_network_report import _fmt  # noqa: E402
from _table import markdown_table  # noqa: E402
from _slow_network_settings import Mode, fp32_message_bytes, parse_link  # noqa: E402

DEFAULT_LINKS = ["10@25", "25@25", "50@25", "100@25", "200@25"]
UNCOMPRESSED = "uncompressed"
NO_CODEC = "-"  # a boundary sent uncompressed, in per-boundary codec strings


# ====================================================================================================================
# Commands: slow_network does every run
# ====================================================================================================================


def common_flags(args: argparse.Namespace) -> list[str]:
    """The settings both phases share: the same variants (AQ-SGD left out), codecs, p and schedule."""
    flags = ["--no-aqsgd", "--p", f"{args.p:g}", "--forward-codec", args.forward_codec, "--backward-codec",
             args.backward_codec, "--schedule", args.schedule]
    if args.bottleneck:
        flags += ["--bottleneck", *args.bottleneck]
    return flags + ["--fu-p", *([] if args.no_fu else [f"{args.p:g}"])] + (["--tiny"] if args.tiny else [])


def timing_command(args: argparse.Namespace) -> list[str]:
    """Short runs of every setting on every link: step times, and what auto chooses on each link. One validation on
    one batch (slow_network validates the last step); clapping-fc on loopback is left out (not used here)."""
    n = args.timing_steps
    return [sys.executable, str(SLOW_NETWORK), *common_flags(args), "--links", *args.links, "--steps", str(n),
            "--val-every", str(n), "--val-batches", "1", "--skip", str(args.skip),
            "--fc-extra", "--no-loopback-fc", *(["--no-auto"] if args.no_auto else []), "--out", str(args.out),
            "--stem", f"{args.stem}_steps"]


def trajectory_command(args: argparse.Namespace, extra_pairs: list[str]) -> list[str]:
    """Full-length runs on loopback: every fixed setting, plus a fixed clapping-fc for each of auto's choices."""
    return [sys.executable, str(SLOW_NETWORK), *common_flags(args), "--loopback-only", "--no-auto",
            "--steps", str(args.steps), "--val-every", str(args.val_every), "--val-batches", str(args.val_batches),
            "--skip", str(args.skip), "--budget", f"{args.budget:g}",
            "--fc-extra", *extra_pairs, "--out", str(args.out), "--stem", f"{args.stem}_trajectories"]


def shown(cmd: list[str]) -> str:
    """A command as a user types it from the repository root."""
    rel = [os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd]
    return " ".join(["python", *rel[1:]]) if rel and rel[0] == sys.executable else " ".join(rel)


def run_slow_network(cmd: list[str]) -> int:
    """Run one phase; its output goes straight to ours (links checked, every run's line, its tables)."""
    print(f"\n$ {shown(cmd)}\n", flush=True)
    return subprocess.run(cmd, cwd=str(ROOT)).returncode


# ====================================================================================================================
# Auto's choices as fixed settings
# ====================================================================================================================


def codec_string(choice: dict, direction: str) -> str:
    """One direction of auto's choice as slow_network's codec argument: a single codec when every boundary has the
    same compressed one, else one entry per boundary (``-`` for uncompressed), e.g. ``-,q4,-``."""
    settings = [choice[b][direction] for b in sorted(choice, key=int)]
    if len(set(settings)) == 1 and settings[0] != UNCOMPRESSED:
        return settings[0]
    return ",".join(NO_CODEC if s == UNCOMPRESSED else s for s in settings)


def choice_pair(choice: dict) -> str:
    """Auto's whole choice as an ``--fc-extra`` pair FWD/BWD."""
    return f"{codec_string(choice, 'fwd')}/{codec_string(choice, 'bwd')}"


def fixed_label(pair: str, args: argparse.Namespace) -> str:
    """slow_network's label of the clapping-fc run with these codecs: the main one for the default codecs, else
    the ``--fc-extra`` row."""
    main = f"clapping-fc p={args.p:g}"
    return main if pair == f"{args.forward_codec}/{args.backward_codec}" else f"{main} {pair}"


def auto_pairs(step_runs: list[dict], args: argparse.Namespace) -> list[str]:
    """The distinct choices auto made on the links, in link order, that are not the main clapping-fc already."""
    pairs = [choice_pair(r["autotune_choice"]) for r in step_runs if is_auto(r) and r.get("autotune_choice")]
    main = f"{args.forward_codec}/{args.backward_codec}"
    return [p for p in dict.fromkeys(pairs) if p != main]


def is_auto(row: dict) -> bool:
    return row["variant"].startswith("auto")


# ====================================================================================================================
# Combining step times and trajectories
# ====================================================================================================================


def steps_to_target(vals: list[dict], target: float) -> int | None:
    """The step of the first validation at or below the target; None if none got there."""
    for v in vals:
        if v.get("val_loss") is not None and v["val_loss"] <= target:
            return v["step"]
    return None


def target_loss(trajectories: list[dict]) -> float | None:
    """Uncompressed's validation loss at its last step (its full-length run on loopback)."""
    base = next((r for r in trajectories if r["kind"] == UNCOMPRESSED and not r.get("error")), None)
    return base.get("final_val_loss") if base else None


def trajectory_label(row: dict, args: argparse.Namespace) -> str | None:
    """Which full-length run gives this setting's steps: its own, or for auto the fixed run of its choice on this
    link (None when auto recorded no choice)."""
    if not is_auto(row):
        return row["variant"]
    choice = row.get("autotune_choice")
    return fixed_label(choice_pair(choice), args) if choice else None


def combine_one(row: dict, trajectories: dict[str, dict], target: float | None, args: argparse.Namespace) -> dict:
    """One link and setting: its mean step time there, its steps to the target, and their product."""
    label = trajectory_label(row, args)
    traj = trajectories.get(label) if label else None
    out = {"link": row["link"], "rate_mbit": row["rate_mbit"], "delay_ms": row["delay_ms"], "setting": row["variant"],
           "mean_step_s": row.get("mean_step_s"), "median_step_s": row.get("median_step_s"),
           "timing_steps": row.get("steps"), "other_cores": row.get("other_cores"),
           "auto_choice": choice_pair(row["autotune_choice"]) if row.get("autotune_choice") else None,
           "trajectory": label, "trajectory_steps": traj.get("steps") if traj else None,
           "final_val_loss": traj.get("final_val_loss") if traj else None, "target_val_loss": target,
           "steps_to_target": None, "time_to_target_s": None, "status": None}
    if row.get("error"):
        out["status"] = f"step-time run failed: {row['error']}"
    elif label is None:
        out["status"] = "auto recorded no choice"
    elif traj is None or traj.get("error"):
        out["status"] = f"no trajectory ({label}" + (f": {traj['error']})" if traj else " was not run)")
    elif target is None:
        out["status"] = "no target (uncompressed's full-length run failed)"
    else:
        out["steps_to_target"] = steps_to_target(traj["vals"], target)
        if out["steps_to_target"] is None:
            out["status"] = f"not reached in {traj['steps']} steps"
        else:
            out["status"] = "reached"
            out["time_to_target_s"] = out["steps_to_target"] * row["mean_step_s"]
    return out


def add_speedups(rows: list[dict]) -> None:
    """Per link: uncompressed's time to target / each setting's, where both reached it."""
    for r in rows:
        base = next((b for b in rows if b["link"] == r["link"] and b["setting"] == UNCOMPRESSED), None)
        ok = base and base["time_to_target_s"] and r["time_to_target_s"]
        r["x_uncompressed"] = base["time_to_target_s"] / r["time_to_target_s"] if ok else None


def first_per_link(rows: list[dict]) -> dict[str, str | None]:
    """The setting with the shortest time to target on each link (None where nobody reached it)."""
    out = {}
    for link in dict.fromkeys(r["link"] for r in rows):
        reached = [r for r in rows if r["link"] == link and r["time_to_target_s"] is not None]
        out[link] = min(reached, key=lambda r: r["time_to_target_s"])["setting"] if reached else None
    for r in rows:
        r["first"] = out[r["link"]] == r["setting"]
    return out


def combine(step_runs: list[dict], trajectory_runs: list[dict], args: argparse.Namespace) -> dict:
    """Every (shaped link, setting) of the timing runs with the steps of its full-length loopback run."""
    trajectories = {r["variant"]: r for r in trajectory_runs if r["link"] == "loopback"}
    target = target_loss(trajectory_runs)
    rows = [combine_one(r, trajectories, target, args) for r in step_runs if r.get("rate_mbit") is not None]
    add_speedups(rows)
    return {"target_val_loss": target, "rows": rows, "first": first_per_link(rows)}


# ====================================================================================================================
# Estimate, report, files
# ====================================================================================================================

START_UP_S = 20.0  # a slow_network run: process start, rendezvous, data, model
LINK_CHECK_S = 8.0  # per link: relay start, 20 pings, a 2-second TCP transfer
LOOPBACK_STEP_S = 0.35  # 4 ranks on 2 cores, one thread each
WIRE_FACTOR = 1.3  # a step's share of the busiest link's wire time that does not hide (fitted: 10 and 25 Mbit/s)
VALIDATION_BATCH_S = 0.1
#: bytes per step against fp32, roughly (q4 forward, q8 backward; Clapping-FU sends fresh steps in full)
BYTES_SHARE = {"uncompressed": 1.0, "direct": 0.19, "clapping-fc": 0.19, "clapping-fu": 0.6, "auto": 0.19}


def estimate_step_s(share: float, rate_mbit: float, delay_ms: float, stages: int = 4) -> float:
    """A step on a shaped link: loopback compute, fill and drain through the delay, unhidden wire time of the
    busiest interface (it sends a forward and a backward message per step)."""
    wire = 2 * fp32_message_bytes(Mode("full")) * 8 * share / (rate_mbit * 1e6)
    return LOOPBACK_STEP_S + 2 * (stages - 1) * delay_ms / 1e3 + WIRE_FACTOR * wire


def estimate_seconds(args: argparse.Namespace, auto_extra: int = 1) -> tuple[float, float]:
    """(timing phase, trajectory phase) in seconds, from the step times above; ``auto_extra`` further clapping-fc
    runs for auto's choices."""
    links = [parse_link(x) for x in args.links]
    timing = LINK_CHECK_S * len(links) + START_UP_S + args.timing_steps * LOOPBACK_STEP_S  # + loopback uncompressed
    for link in links:
        for share in BYTES_SHARE.values():
            timing += START_UP_S + args.timing_steps * estimate_step_s(share, link.rate_mbit, link.delay_ms or 0.0)
    long_steps = round(args.steps * args.budget)

    def full_run(steps: int) -> float:
        return START_UP_S + steps * (LOOPBACK_STEP_S + args.val_batches * VALIDATION_BATCH_S / args.val_every)

    trajectories = full_run(args.steps) + (3 + auto_extra) * full_run(long_steps)
    return timing, trajectories


TABLE_LEGEND = (
    "mean step s: mean training step time on the link (steps after the warm-up; validation excluded); steps: first "
    "validation at or below the target in the setting's full-length loopback run (auto: the run of its choice on "
    "that link); to target s: steps x mean step; x unc: uncompressed's time to target / this one; first: shortest "
    "time to target on the link."
)


def print_table(result: dict) -> None:
    """Markdown: one row per link and setting."""
    print(f"target: validation loss {_fmt(result['target_val_loss'], '.4f')} (uncompressed at its last step)\n")
    print(markdown_table(
        [(r["link"], r["setting"], r["mean_step_s"],
          str(r["steps_to_target"]) if r["steps_to_target"] is not None else r["status"], r["time_to_target_s"],
          r["x_uncompressed"], "**first**" if r["first"] else "", r["trajectory"] or "-") for r in result["rows"]],
        ["link", "setting", "mean step s", "steps to target", "time to target s", "x unc", "first", "trajectory"],
        floatfmt=(None, None, ".3f", None, ".1f", ".2f"),
        colalign=("left", "left", "right", "right", "right", "right", "center", "left")))
    print()
    for link, setting in result["first"].items():
        print(f"first to the target on {link}: {setting or 'nobody'}")
    print(f"\n{TABLE_LEGEND}")


CSV_FIELDS = ["link", "rate_mbit", "delay_ms", "setting", "mean_step_s", "median_step_s", "timing_steps",
              "auto_choice", "trajectory", "trajectory_steps", "final_val_loss", "target_val_loss", "steps_to_target",
              "time_to_target_s", "x_uncompressed", "first", "status", "other_cores"]


def plot(rows: list[dict], path: Path) -> None:
    """Time to target against bandwidth, one line per setting; where a setting never got there within its budget,
    an x in its colour above the lines. A setting without a measurement (a failed run, no trajectory) is left out
    there; the table says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {s: cycle[j % len(cycle)] for j, s in enumerate(settings)}
    rates = sorted({r["rate_mbit"] for r in rows})
    ax.set_xscale("log")
    ax.set_xlim(rates[0] / 1.3, rates[-1] * 1.3)  # fixed first: also with one link, or only "not reached" marks
    for setting in settings:
        mine = sorted((r for r in rows if r["setting"] == setting), key=lambda r: r["rate_mbit"])
        pts = [(r["rate_mbit"], r["time_to_target_s"]) for r in mine if r["time_to_target_s"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=setting, color=colour[setting])
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 2.5)  # room above the lines for the "not reached" marks
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for setting in settings:
        missed = [r["rate_mbit"] for r in rows if r["setting"] == setting and r["status"].startswith("not reached")]
        if missed:
            ax.plot(missed, [0.95] * len(missed), "x", color=colour[setting], ms=9, mew=2, transform=top,
                    label=f"{setting}: not reached")
    ax.set_xticks(rates, [f"{x:g}" for x in rates])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    delays = sorted({r["delay_ms"] for r in rows if r["delay_ms"] is not None})
    ax.set_xlabel("link rate, Mbit/s" + (f" ({', '.join(f'{d:g}' for d in delays)} ms one-way delay)"
                                         if delays else ""))
    ax.set_ylabel("time to target, s (steps x mean step)")
    ax.set_title("time to the target loss; x at the top: not reached within the step budget", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(result: dict, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    try:
        plot(result["rows"], out / f"{stem}.png")
        paths.append(out / f"{stem}.png")
    except ImportError:
        print("no plot: matplotlib is not installed")
    return paths


def report(steps_json: dict, trajectories_json: dict, args: argparse.Namespace, command: str) -> dict:
    """The combined result with what reproduces it: the commands, the machine, the link checks, disturbed runs."""
    result = combine(steps_json["runs"], trajectories_json["runs"], args)
    busy = [f"{r['link']} {r['variant']}" for j in (steps_json, trajectories_json) for r in j["runs"]
            if (r.get("other_cores") or 0) > 0.2]
    result.update(
        command=command,
        commands={"step_times": steps_json["settings"].get("command"),
                  "trajectories": trajectories_json["settings"].get("command")},
        machine={"step_times": steps_json.get("machine"), "trajectories": trajectories_json.get("machine")},
        link_checks=steps_json.get("links"),
        settings={"p": args.p, "forward_codec": args.forward_codec, "backward_codec": args.backward_codec,
                  "schedule": steps_json["settings"].get("schedule"),
                  "timing_steps": steps_json["settings"].get("steps"),
                  "skip": steps_json["settings"].get("skip"),
                  "full_steps": trajectories_json["settings"].get("steps"),
                  "budget": trajectories_json["settings"].get("budget"),
                  "val_every": trajectories_json["settings"].get("val_every"),
                  "val_batches": trajectories_json["settings"].get("val_batches")},
        disturbed_runs=busy)
    return result


# ====================================================================================================================
# Main
# ====================================================================================================================


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", nargs="+", default=None, metavar="RATE@DELAY",
                    help=f"links as slow_network takes them (default {' '.join(DEFAULT_LINKS)}; --tiny: 100@25)")
    ap.add_argument("--steps", type=int, default=250, help="full-length steps of uncompressed on loopback")
    ap.add_argument("--budget", type=float, default=1.6,
                    help="compressed settings train up to this many times --steps to reach the target")
    ap.add_argument("--timing-steps", type=int, default=25, help="steps of each short run on a link")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the mean step time")
    ap.add_argument("--val-every", type=int, default=10, help="validation spacing of the full-length runs")
    ap.add_argument("--val-batches", type=int, default=4, help="fixed validation batches of the full-length runs")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="gpipe")
    ap.add_argument("--p", type=float, default=0.5, help="lazy-sampling p of clapping-fc, clapping-fu and auto")
    ap.add_argument("--forward-codec", default="q4")
    ap.add_argument("--backward-codec", default="q8")
    ap.add_argument("--bottleneck", nargs="*", default=[], metavar="N:FWD/BWD[:VARIANT]",
                    help="also the model with a trainable Bottleneck of width d/N at every cut, these codecs on its "
                         "code (a model change), direct or under VARIANT (clapping-fc, clapping-fu at --p), e.g. "
                         "8:q8/q8 8:q4/q8:clapping-fc")
    ap.add_argument("--no-fu", action="store_true", help="leave clapping-fu out (both phases)")
    ap.add_argument("--no-auto", action="store_true", help="leave auto out (it runs on the links only)")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: slow_network --tiny (2 stages, tiny model; it runs neither clapping-fu nor "
                         "--fc-extra rows, so auto has no trajectory), a few steps")
    ap.add_argument("--out", type=Path, default=None, help="folder of the results (default benchmarks/results)")
    ap.add_argument("--stem", default="time_to_target", help="file name of the results without extension")
    ap.add_argument("--from-json", nargs=2, type=Path, default=None, metavar=("STEPS", "TRAJECTORIES"),
                    help="combine saved slow_network results (the step-time runs, the loopback trajectories) "
                         "without running anything")
    args = ap.parse_args(argv)
    if args.tiny:  # slow_network's tiny model; steps small enough for a smoke test
        args.links = args.links or ["100@25"]
        args.timing_steps, args.skip, args.steps, args.val_every, args.val_batches = 4, 1, 4, 2, 1
    args.links = args.links or DEFAULT_LINKS
    for text in args.links:
        parse_link(text)  # refuse a malformed link before anything runs
    if args.steps % args.val_every:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --val-every ({args.val_every})")
    args.out = args.out or ROOT / "benchmarks" / "results"
    return args


def run_phase(cmd: list[str], path: Path) -> tuple[int, dict | None]:
    """One slow_network invocation and the JSON it wrote (None if it wrote none; an older file is removed first, so
    a failed run is never mistaken for a finished one)."""
    path.unlink(missing_ok=True)
    rc = run_slow_network(cmd)
    return rc, json.loads(path.read_text()) if path.exists() else None


def runnable_pairs(pairs: list[str]) -> list[str]:
    """The pairs a slow_network without per-boundary codec strings still takes as separate arguments: argparse
    reads a value that begins with ``-`` (``-,q4,-/...``) as an unknown option."""
    return [p for p in pairs if not p.startswith(NO_CODEC)]


def run_phases(args: argparse.Namespace) -> tuple[int, dict | None, dict | None]:
    """Step times on every link first (they say what auto chose), then the loopback trajectories."""
    timing, trajectories = estimate_seconds(args)
    print(f"estimated duration: step times {timing / 60:.0f} min, full-length loopback runs "
          f"{trajectories / 60:.0f} min (one extra run per distinct choice of auto beyond the first), "
          f"{(timing + trajectories) / 60:.0f} min in all; timings need an otherwise idle machine", flush=True)
    t0 = time.monotonic()
    rc, steps_json = run_phase(timing_command(args), args.out / f"{args.stem}_steps.json")
    if steps_json is None:
        return rc or 2, None, None
    pairs = auto_pairs(steps_json["runs"], args)
    print("\nauto chose per link: " + "; ".join(
        f"{r['link']}: {choice_pair(r['autotune_choice']) if r.get('autotune_choice') else 'nothing recorded'}"
        for r in steps_json["runs"] if is_auto(r)) + (f"; extra fixed runs: {', '.join(pairs)}" if pairs else ""))
    path = args.out / f"{args.stem}_trajectories.json"
    rc2, trajectories_json = run_phase(trajectory_command(args, pairs), path)
    kept = runnable_pairs(pairs)
    if trajectories_json is None and kept != pairs:
        print(f"time_to_target: slow_network refused {', '.join(p for p in pairs if p not in kept)}; running "
              "without (auto on those links: no trajectory)", file=sys.stderr)
        rc2, trajectories_json = run_phase(trajectory_command(args, kept), path)
    print(f"\nboth phases: {(time.monotonic() - t0) / 60:.1f} min")
    rc = max(rc, rc2)
    return (rc if trajectories_json is not None else rc or 2), steps_json, trajectories_json


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["python", "benchmarks/time_to_target.py", *(sys.argv[1:] if argv is None else argv)])
    if args.from_json:
        rc = 0
        steps_json, trajectories_json = (json.loads(p.read_text()) for p in args.from_json)
    else:
        rc, steps_json, trajectories_json = run_phases(args)
        if steps_json is None or trajectories_json is None:
            print(f"time_to_target: slow_network wrote no {'step-time' if steps_json is None else 'trajectory'} "
                  f"results under {args.out}", file=sys.stderr)
            return rc
    result = report(steps_json, trajectories_json, args, command)
    print()
    print_table(result)
    if result["disturbed_runs"]:
        print(f"\nWARNING: other processes used more than 0.2 CPU cores during {', '.join(result['disturbed_runs'])}:"
              " re-run on a quiet machine before quoting those times.")
    paths = write_results(result, args.out, args.stem)
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
