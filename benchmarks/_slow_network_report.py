"""slow_network's report: one run's numbers from its ranks' records (``summarize``), the comparisons between runs
(step time against loopback and uncompressed, time to uncompressed's final validation loss, the delay floor), the
targets, the printed tables, the plot and the results files (``STEM.json``, ``.csv``, ``.png``;
``slow_network_links.json`` for ``--validate-only``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import statistics
import textwrap
from pathlib import Path

from _slow_network_settings import LinkSpec, MiB, Mode, Variant, fp32_message_bytes
from _table import table

# ====================================================================================================================
# One run, and the runs side by side
# ====================================================================================================================


def summarize(raw: dict, mode: Mode, link: LinkSpec | None, variant: Variant, counters: dict | None) -> dict:
    """One run's numbers from the workers' records (rank 0 holds the last stage and the logged metrics)."""
    row = {"link": "loopback" if link is None else link.label, "rate_mbit": None if link is None else link.rate_mbit,
           "delay_ms": None if link is None else link.delay_ms, "link_kind": "loopback" if link is None else link.kind,
           "sites": None if link is None or link.sites is None else list(link.sites),
           "variant": variant.label, "kind": variant.variant, "p": variant.p, "error": raw.get("error"),
           "wall_seconds": raw["wall_seconds"], "other_cores": raw.get("other_cores"), "warning": raw.get("warning")}
    if raw.get("error"):
        return row
    S = mode.stages
    r0 = next(r for r in raw["ranks"] if r["rank"] == 0)
    steps = r0["steps"]
    times = [s["seconds"] for s in steps]
    timed = times[mode.skip:] or times
    cumulative, total = {}, 0.0
    for s in steps:
        total += s["seconds"]
        cumulative[s["step"]] = total

    def med(name: str) -> float | None:
        values = [s[name] for s in steps if name in s]
        return statistics.median(values) if values else None

    fp32 = fp32_message_bytes(mode)
    # exact sums over all steps (the last one included) when the strategy has them; else the mean of the logged steps
    totals = r0.get("byte_totals") or {}
    if totals.get("steps"):
        bytes_per_step = totals["bytes"] / totals["steps"]
    else:
        bytes_per_step = _mean([s.get("clapping/bytes") for s in steps])
    row.update(
        steps=len(steps), median_step_s=statistics.median(timed), mean_step_s=statistics.fmean(timed),
        p10_step_s=_quantile(timed, 0.1), p90_step_s=_quantile(timed, 0.9), first_step_s=times[0],
        train_seconds=total, bytes_per_step=bytes_per_step, byte_totals=totals or None,
        metrics_lag=r0.get("metrics_lag", 0), autotune=r0.get("autotune") or None,
        autotune_choice=r0.get("autotune_choice"), schedule=r0.get("schedule"),
        median_bytes_per_step=med("clapping/bytes"),
        fp32_bytes_per_step=2 * (S - 1) * fp32, logged_ratio=med("clapping/ratio"),
        fwd_bytes_per_boundary=[_mean([s.get(f"clapping/b{m}_fwd_bytes") for s in steps]) for m in range(S - 1)],
        bwd_bytes_per_boundary=[_mean([s.get(f"clapping/b{m}_bwd_bytes") for s in steps]) for m in range(S - 1)],
        min_message_bytes=min((s.get(f"clapping/b{m}_{d}_bytes") or math.inf for s in steps for m in range(S - 1)
                               for d in ("fwd", "bwd")), default=0.0) / mode.microbatches,
        # samples of fresh batches (all batches without lazy sampling); the logged count of the last step is gone
        distinct_samples=(totals["fresh_steps"] * mode.batch if totals.get("steps")
                          else steps[-1].get("clapping/distinct_samples", len(steps) * mode.batch)),
        final_train_loss=steps[-1].get("train_loss"),
        vals=[dict(v, train_seconds=cumulative.get(v["step"])) for v in r0["vals"]],
        setup_seconds=max(r["setup_seconds"] for r in raw["ranks"]),
        step_times=times,
        bytes_per_step_series=[s.get("clapping/bytes") for s in steps],
    )
    row["final_val_loss"] = row["vals"][-1]["val_loss"] if row["vals"] else None
    row["fewer_bytes_x"] = row["fp32_bytes_per_step"] / row["bytes_per_step"] if row["bytes_per_step"] else None
    row["per_rank"] = _per_rank(raw["ranks"], steps, S, link)
    if link is not None:
        _add_link_numbers(row, link, counters, len(steps))
    return row


def _per_rank(ranks: list[dict], steps: list[dict], S: int, link: LinkSpec | None) -> list[dict]:
    """Per rank: what the strategy says it sent in the training steps, against what left its interface meanwhile;
    both over the steps whose per-boundary numbers are known (with the logged numbers a step late: all but the
    last). ``steps``: rank 0's records, which hold the logged metrics."""
    known = {s["step"] for s in steps if "clapping/bytes" in s}
    per_rank = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        stage = S - 1 - r["rank"]
        sent = 0.0
        for s in steps:
            if stage < S - 1:
                sent += s.get(f"clapping/b{stage}_fwd_bytes", 0.0)
            if stage > 0:
                sent += s.get(f"clapping/b{stage - 1}_bwd_bytes", 0.0)
        entry = {"rank": r["rank"], "stage": stage, "ifname": r["ifname"], "strategy_sent_bytes": sent}
        if link is not None:  # on loopback every rank shares `lo`: its counters say nothing per rank
            tx_known = sum(s["tx"] for s in r["steps"] if s["step"] in known)
            entry.update(veth_tx_in_steps=r["train_tx"], veth_rx_in_steps=r["train_rx"],
                         veth_tx_in_validation=r["val_tx"], veth_tx_in_known_steps=tx_known,
                         veth_over_strategy=tx_known / sent if sent else None)
        per_rank.append(entry)
    return per_rank


def _add_link_numbers(row: dict, link: LinkSpec, counters: dict | None, n_steps: int) -> None:
    """A shaped run's wire numbers: the busiest interface's wire time per step, interface bytes against the
    strategy's, and the shaper's counters over the whole run (tbf, or the relay's)."""
    per_rank = row["per_rank"]
    row["counters_whole_run"] = counters
    busiest = max(per_rank, key=lambda e: e["veth_tx_in_steps"])
    # the wire time of the busiest interface alone, per step: a floor under the step time at this rate
    row["wire_floor_step_s"] = busiest["veth_tx_in_steps"] * 8 / (link.rate_mbit * 1e6) / n_steps
    row["veth_over_strategy"] = (sum(e["veth_tx_in_known_steps"] for e in per_rank)
                                 / max(1.0, sum(e["strategy_sent_bytes"] for e in per_rank)))
    if counters:
        row["tbf_overlimits"] = sum(c.get("qdisc_overlimits", 0) for c in counters.values())
        row["tbf_drops"] = sum(c.get("qdisc_drops", 0) for c in counters.values())
        if link.delay_ms is not None:
            row["relay_queue_drops"] = sum(c.get("relay_queue_drops", 0) for c in counters.values())
            row["relay_wire_bytes"] = sum(c.get("relay_wire_bytes", 0) for c in counters.values())


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def time_to_target(row: dict, target: float | None) -> tuple[float | None, int | None]:
    """The training time and step of the run's first validation at or below ``target``; (None, None) if none."""
    if target is None or row.get("error"):
        return None, None
    for v in row["vals"]:
        if v["val_loss"] is not None and v["val_loss"] <= target:
            return v["train_seconds"], v["step"]
    return None, None


def add_comparisons(rows: list[dict]) -> None:
    """Ratios measured side by side: step time over the loopback step time, time-to-target against uncompressed."""
    loop = next((r for r in rows if r["rate_mbit"] is None and r["kind"] == "uncompressed" and not r["error"]), None)
    for r in rows:
        if r["error"]:
            continue
        r["x_loopback_step"] = r["median_step_s"] / loop["median_step_s"] if loop else None
        base = next((b for b in rows if b["link"] == r["link"] and b["kind"] == "uncompressed" and not b["error"]),
                    None)
        r["target_val_loss"] = base["final_val_loss"] if base else None
        r["time_to_target_s"], r["target_step"] = time_to_target(r, r["target_val_loss"])
        base_ttt = time_to_target(base, r["target_val_loss"])[0] if base else None
        r["ttt_speedup"] = (base_ttt / r["time_to_target_s"]) if base_ttt and r["time_to_target_s"] else None
        r["step_speedup"] = base["median_step_s"] / r["median_step_s"] if base else None
        r["mean_step_speedup"] = base["mean_step_s"] / r["mean_step_s"] if base else None
        if r.get("delay_ms") is not None and loop:
            # fill and drain: every step waits at least once for each boundary forward and once backward (with
            # sites: each boundary between two sites; within a site there is no delay)
            sites = r.get("sites") or range(len(r["per_rank"]))
            slow = sum(x != y for x, y in zip(sites, sites[1:]))
            r["delay_floor_step_s"] = loop["median_step_s"] + 2 * slow * r["delay_ms"] / 1000
            r["x_delay_floor"] = r["median_step_s"] / r["delay_floor_step_s"]


#: on a delayed 100 Mbit/s link, clapping-fc's step may be at most this many times the delay floor
DELAY_FLOOR_BOUND = 1.25


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The project's targets on every link of rate 100 or 25 Mbit/s (each delay its own link, named by its label)."""

    def find(link, kind):
        return next((r for r in rows if r["link"] == link and r["kind"] == kind and not r["error"]), None)

    def fc_specs(rate: float, link: str, row: dict | None, name: str, delayed: bool) -> list[tuple]:
        if rate == 100.0:
            specs = [(f"{link}: {name} step time <= 1.15x loopback step time", row, "x_loopback_step", 1.15, "<="),
                     (f"{link}: {name} time-to-target >= 2x shorter than uncompressed", row, "ttt_speedup", 2.0,
                      ">=")]
            if delayed:  # the physical limit of a synchronous pipeline on a link with delay
                specs.append((f"{link}: {name} step time <= {DELAY_FLOOR_BOUND:g}x the delay floor (loopback step "
                              "+ 2 x (stages - 1) x one-way delay)", row, "x_delay_floor", DELAY_FLOOR_BOUND, "<="))
            return specs
        return [(f"{link}: {name} time-to-target >= 4x shorter than uncompressed", row, "ttt_speedup", 4.0, ">=")]

    out, specs = [], []
    for rate in (100.0, 25.0):
        links = list(dict.fromkeys(r["link"] for r in rows if r["rate_mbit"] == rate)) or [f"{rate:g} Mbit/s"]
        for link in links:
            delayed = any((r.get("delay_ms") or 0) > 0 for r in rows if r["link"] == link)
            # the first clapping-fc run of a link is the main one; the others (--fc-extra, auto) are named by their
            # label
            main = find(link, "clapping-fc")
            specs += fc_specs(rate, link, main, "clapping-fc", delayed)
            for extra in (r for r in rows if r["link"] == link and r["kind"] == "clapping-fc" and not r["error"]
                          and r is not main):
                specs += fc_specs(rate, link, extra, extra["variant"], delayed)
            if delayed and rate == 100.0:  # how far uncompressed is from the same limit: to read, not a target
                specs.append((f"{link}: uncompressed step time / delay floor", find(link, "uncompressed"),
                              "x_delay_floor", None, "report"))
    for text, row, key, bound, op in specs:
        value = row.get(key) if row else None
        if row is None:
            verdict = "not measured (link not in this run or the run failed)"
        elif value is None:
            verdict = "NOT MET (target loss not reached)" if key == "ttt_speedup" else "not measured"
        elif op == "report":
            verdict = "reported (not a target)"
        else:
            ok = value <= bound if op == "<=" else value >= bound
            verdict = "MET" if ok else "NOT MET"
        out.append({"target": text, "value": value, "bound": bound, "verdict": verdict})
    return out


def first_to_target(rows: list[dict]) -> dict[str, list[dict]]:
    """Per shaped link, every variant ordered by its time to the link's target (training time, validation excluded;
    those that did not reach it last, by their final validation loss): which setting gets there first."""
    out: dict[str, list[dict]] = {}
    for link in dict.fromkeys(r["link"] for r in rows if r["rate_mbit"] is not None):
        mine = [r for r in rows if r["link"] == link and not r["error"]]
        ranked = sorted(mine, key=lambda r: (r.get("time_to_target_s") is None, r.get("time_to_target_s") or 0.0,
                                             r.get("final_val_loss") if r.get("final_val_loss") is not None
                                             else math.inf))
        out[link] = [{"variant": r["variant"], "time_to_target_s": r.get("time_to_target_s"),
                      "target_step": r.get("target_step"), "final_val_loss": r.get("final_val_loss"),
                      "median_step_s": r["median_step_s"]} for r in ranked]
    return out


# ====================================================================================================================
# Printed tables
# ====================================================================================================================


def _fmt(x, spec=".3f", none="-") -> str:
    """A number for a table, or ``none`` (a dash) for one that was not measured."""
    return none if x is None else format(x, spec)


TABLE_LEGEND = (
    "step s / mean s: median / mean wall time of a training step on rank 0 (first steps left out); x loop: / the "
    "loopback uncompressed step time; x unc (first): uncompressed step time / this one, same link; MiB/step: bytes "
    "the strategy sent over all boundaries per step (its exact totals / steps: headers and the step results that "
    "ride on the gradient messages included); fewer: fp32 bytes / those bytes; veth/str: bytes that left the stage "
    "interfaces during training steps / bytes the strategy counted, over the steps whose per-boundary numbers are "
    "known (all but the last: they are logged a step late; TCP/IP headers, ACKs and the asynchronous gather of the "
    "byte numbers make it > 1); floor s: busiest interface's bytes per step / link rate; x floor: step / delay floor "
    "(loopback step + 2 x (stages - 1) x one-way delay, delayed links only); val loss: at the last "
    "step; target: uncompressed final val loss on that link; to target s: cumulative training time to the first "
    "validation <= target (@ step); x unc (last): uncompressed time-to-target / this one; other: CPU cores that "
    "other processes on the machine used on average during the run (> 0 means the timings were disturbed)."
)


def print_table(rows: list[dict]) -> None:
    """The table of runs, one line each (``TABLE_LEGEND`` says what the columns hold)."""
    body, failed = [], []
    for r in rows:
        if r["error"]:
            body.append((r["link"], r["variant"], "FAILED") + ("",) * 13)
            failed.append(f"{r['link']} {r['variant']} FAILED: {r['error']}")
            continue
        ttt = (f"{r['time_to_target_s']:.1f} @{r['target_step']}" if r.get("time_to_target_s") is not None
               else "not reached")
        body.append((r["link"], r["variant"], r["median_step_s"], r["mean_step_s"], r.get("x_loopback_step"),
                     r.get("step_speedup"), r.get("x_delay_floor"),
                     r["bytes_per_step"] / MiB if r["bytes_per_step"] is not None else None, r.get("fewer_bytes_x"),
                     r.get("veth_over_strategy"), r.get("wire_floor_step_s"), r["final_val_loss"],
                     r.get("target_val_loss"), ttt, r.get("ttt_speedup"), r.get("other_cores")))
    print(table(body, ["link", "variant", "step s", "mean s", "x loop", "x unc", "x floor", "MiB/step", "fewer",
                       "veth/str", "floor s", "val loss", "target", "to target s", "x unc", "other"],
                floatfmt=(None, None, ".3f", ".3f", ".2f", ".2f", ".2f", ".3f", ".1f", ".3f", ".3f", ".4f", ".4f", None,
                          ".2f", ".2f"), colalign=("left", "left") + ("right",) * 14))
    for line in failed:
        print(line)
    print()
    print(textwrap.fill(TABLE_LEGEND, width=118))



def print_run(row: dict, raw: dict) -> None:
    """The end of a run's progress line: its step time, bytes and final loss, or why it failed and its ranks' logs."""
    if row["error"]:
        print(f"FAILED ({row['error']})\n{raw.get('log_tail', '')}")
    else:
        print(f"{row['median_step_s']:.3f} s/step, {row['bytes_per_step'] / MiB:.3f} MiB/step, final val "
              f"{row['final_val_loss']:.4f}, {raw['wall_seconds']:.0f} s wall, other jobs used "
              f"{row['other_cores']:.2f} of {os.cpu_count()} cores meanwhile"
              + (f"; WARNING: {row['warning']}" if row["warning"] else ""))


def print_report(rows: list[dict], targets: list[dict], ranking: dict[str, list[dict]], mode: Mode,
                 burst: str) -> None:
    """Everything printed after the runs but the link checks: the table of runs, the shaping check, the bytes per
    boundary, the targets, who reached the target first, and a warning for runs that other jobs disturbed."""
    print_table(rows)
    print_shaping_check(rows, burst)
    print_boundary_bytes(rows, mode)
    print_targets(targets, mode.name)
    print_first_to_target(ranking, rows)
    warn_if_disturbed(rows)


def print_shaping_check(rows: list[dict], burst: str) -> None:
    """Per shaped run: what the shaper did (tbf overlimits and drops, or the relay's drops, lateness and CPU), the
    smallest message, each rank's interface bytes against the strategy's, and the step against the delay floor."""
    print(f"\nshaping check (tbf burst {burst}; overlimits/drops: whole run, all stage veths; relay: queue drops, "
          "and how late it delivered, p99 of the worst link / max, ms; veth/strategy: bytes out of each rank's "
          "interface during its training steps / bytes the strategy counted for that rank):")
    for r in (r for r in rows if r["rate_mbit"] is not None and not r["error"]):
        ratios = ", ".join(_fmt(e.get("veth_over_strategy"), ".3f") for e in r["per_rank"])
        relay = r.get("relay")
        if relay:
            shaped = (f"relay {relay['queue_drops']:>5} drops, late {_fmt(relay['late_ms_p99_worst_link'], '.2f')}/"
                      f"{_fmt(relay['late_ms_max'], '.1f')} ms, {relay['cpu_s']:.1f} s CPU")
        else:
            shaped = f"{r.get('tbf_overlimits', 0):>8} overlimits {r.get('tbf_drops', 0):>4} drops"
        floor = (f"; step {r['x_delay_floor']:.2f}x the delay floor {r['delay_floor_step_s']:.3f} s"
                 if r.get("x_delay_floor") else "")
        print(f"  {r['link']:<16} {r['variant']:<24} {shaped}; smallest message "
              f"{r['min_message_bytes'] / 1024:6.1f} KiB; veth/strategy per rank {ratios}{floor}")


def print_boundary_bytes(rows: list[dict], mode: Mode) -> None:
    """Each run's bytes per step at every boundary and direction, on the first link of the mode."""
    print("\nbytes per step and boundary from the strategy's logged clapping/b{m}_fwd_bytes / _bwd_bytes (mean over "
          "the steps they describe: all but the last, as they are logged a step late; MiB; fp32 payload "
          f"{fp32_message_bytes(mode) / MiB:.3f} MiB):")
    for r in (r for r in rows if not r["error"] and r["link"] == (mode.links[0].label if mode.links else None)):
        pairs = "  ".join(f"b{m} {f / MiB:.3f}/{b / MiB:.3f}" for m, (f, b) in
                          enumerate(zip(r["fwd_bytes_per_boundary"], r["bwd_bytes_per_boundary"])) if f and b)
        print(f"  {r['variant']:<24} fwd/bwd: {pairs}")


def print_targets(targets: list[dict], mode_name: str) -> None:
    """Each target's verdict and measured value (in tiny mode only to exercise the code)."""
    print("\ntargets (char-LM):" if mode_name != "tiny" else "\ntargets (tiny model: not meaningful, printed to test "
                                                             "the code path):")
    for t in targets:
        print(f"  {t['verdict']:<8} {t['target']} (measured {_fmt(t['value'], '.2f')})")


def print_first_to_target(ranking: dict[str, list[dict]], rows: list[dict]) -> None:
    """Per link, the variants in the order they reached the target; then how clapping-fu compares to uncompressed."""
    print("\nfirst to the target (uncompressed's final val loss on the link), per link:")
    for link, order in ranking.items():
        reached = [f"{e['variant']} {e['time_to_target_s']:.1f} s" for e in order if e["time_to_target_s"] is not None]
        missed = [e["variant"] for e in order if e["time_to_target_s"] is None]
        print(f"  {link}: {', then '.join(reached) or 'nobody'}" + (f"; not reached: {', '.join(missed)}"
                                                                      if missed else ""))
    for r in rows:
        if r["kind"] == "clapping-fu" and not r["error"]:
            ttt = (f"time-to-target {r['ttt_speedup']:.2f}x shorter" if r.get("ttt_speedup")
                   else "target loss not reached")
            print(f"  clapping-fu p={r['p']:g} on {r['link']}: median step {_fmt(r.get('step_speedup'), '.2f')}x and "
                  f"mean step {_fmt(r.get('mean_step_speedup'), '.2f')}x faster "
                  f"than uncompressed, {ttt}")


def warn_if_disturbed(rows: list[dict]) -> None:
    """Timings only mean something on an otherwise idle machine: name the runs during which others used the CPU."""
    busy = [r for r in rows if (r.get("other_cores") or 0) > 0.2]
    if busy:
        print(f"\nWARNING: other processes used more than 0.2 CPU cores during {len(busy)} run(s) "
              f"({', '.join(r['link'] + ' ' + r['variant'] for r in busy)}): their timings are slowed down; "
              "re-run on a quiet machine before quoting them.")


# ====================================================================================================================
# Plot and results files
# ====================================================================================================================


def plot(rows: list[dict], links: list[LinkSpec], shaping: dict[str, str], path: Path) -> None:
    """The step time of every variant on every link (first panel), and each shaped link's validation loss against
    training time (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["error"]]
    groups = ["loopback"] + [x.label for x in links]
    # the variants in the order of a shaped link's runs (loopback has only some), one colour each in every panel
    labels = list(dict.fromkeys([r["variant"] for r in ok if r["link"] != "loopback"]
                                + [r["variant"] for r in ok]))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {label: cycle[j % len(cycle)] for j, label in enumerate(labels)}
    fig, axes = plt.subplots(1, 1 + len(links), figsize=(5.5 * (1 + len(links)), 4.3), squeeze=False)
    axes = axes[0]  # one row; also an array with the loopback panel alone (--loopback-only)
    ax = axes[0]
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs, means, medians = [], [], []
        for g, name in enumerate(groups):
            r = next((r for r in ok if r["link"] == name and r["variant"] == label), None)
            if r is not None:
                xs.append(g + (j - (len(labels) - 1) / 2) * width)
                means.append(r["mean_step_s"])
                medians.append(r["median_step_s"])
        ax.bar(xs, means, width, label=label, color=colour[label])
        ax.plot(xs, medians, "k.", ms=5, label="median" if j == 0 else None)
    floor_label = "delay floor"
    for g, name in enumerate(groups):  # the delay floor of a delayed link, across its group of bars
        floor = next((r["delay_floor_step_s"] for r in ok if r["link"] == name and r.get("delay_floor_step_s")), None)
        if floor is not None:
            ax.hlines(floor, g - 0.45, g + 0.45, colors="red", linestyles="--", lw=1, label=floor_label)
            floor_label = None
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("step time (s): bar mean, dot median")
    ax.set_title("step time per link (rank 0, warm-up left out)")
    ax.legend(fontsize=8)
    for ax, link in zip(axes[1:], links):
        name = link.label
        target = None
        for r in ok:
            if r["link"] != name:
                continue
            target = r.get("target_val_loss", target)
            pts = [(v["train_seconds"], v["val_loss"]) for v in r["vals"] if v["val_loss"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=r["variant"], color=colour[r["variant"]])
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=1, label="target (uncompressed final)")
        ax.set_xlabel("training wall time (s, validation excluded)")
        ax.set_ylabel("validation loss")
        ax.set_title(textwrap.fill(f"{name}: {shaping[name]}", width=60), fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    """The machine and the versions the runs used, and the load average at the start."""
    from importlib.metadata import version  # no torch import in the launcher: it only waits for the ranks

    from _machine import cpu_model

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "torch": version("torch"),
            "lightning": version("lightning"), "python": platform.python_version(), "kernel": platform.release(),
            "load_average_at_start": list(os.getloadavg())}


CSV_FIELDS = [
    "link", "delay_ms", "link_kind", "variant", "kind", "p", "error", "steps", "median_step_s", "mean_step_s",
    "p10_step_s", "p90_step_s", "x_loopback_step", "step_speedup", "mean_step_speedup", "bytes_per_step",
    "median_bytes_per_step", "fp32_bytes_per_step", "fewer_bytes_x", "veth_over_strategy", "wire_floor_step_s",
    "delay_floor_step_s", "x_delay_floor", "tbf_overlimits", "tbf_drops", "relay_queue_drops", "final_val_loss",
    "target_val_loss", "time_to_target_s", "target_step", "ttt_speedup", "train_seconds", "distinct_samples",
    "other_cores", "relay_cores", "other_cores_with_relay", "load_before", "load_after", "wall_seconds", "warning",
]



def write_results(out: Path, stem: str, results: dict, links: list[LinkSpec]) -> None:
    """``STEM.json`` (``results``: machine, settings, links, runs, targets, first_to_target), ``STEM.csv`` (one row
    per run, ``CSV_FIELDS``) and ``STEM.png`` (unless matplotlib is missing) under ``out``."""
    rows = results["runs"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, links, results["settings"]["shaping"], out / f"{stem}.png")
        plotted = f" and {out / f'{stem}.png'}"
    except ImportError:
        plotted = " (no plot: matplotlib is not installed)"
    print(f"\nwrote {out / f'{stem}.json'}, {out / f'{stem}.csv'}{plotted} "
          f"({results['machine']['total_wall_seconds']:.0f} s in all)")


def write_link_checks(out: Path, settings: dict, checks: list[dict], seconds: float) -> None:
    """``slow_network_links.json`` under ``out`` (``--validate-only``): the machine, the link settings, the checks."""
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    (out / "slow_network_links.json").write_text(json.dumps(
        {"machine": {"kernel": platform.release(), "logical_cpus": os.cpu_count(), "load_average_at_end": list(load)},
         "settings": settings, "links": checks}, indent=1))
    print(f"\nwrote {out / 'slow_network_links.json'} ({seconds:.0f} s; load average "
          f"{', '.join(f'{x:.2f}' for x in load)})")
