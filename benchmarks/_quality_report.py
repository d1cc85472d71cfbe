"""Aggregation, targets, table, CSV/JSON and plots for ``benchmarks/quality.py`` (runs on rank 0 only)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from _machine import describe

from _quality_tasks import TASKS

#: tolerances of the targets, per task: (clapping-fu, clapping-fc at >= 16x); accuracy in points, loss in percent
TOLERANCE = {"fashion_mnist": (1.0, 2.0), "shakespeare": (2.0, 4.0)}
FC_MIN_RATIO = 16.0

#: message shapes of one micro-batch per boundary (forward and backward carry the same shape), for the codec bound
MESSAGE_SHAPES = {
    "fashion_mnist": [(32, 512), (32, 256), (32, 128)],
    "shakespeare": [(4, 128, 128)] * 3,
}


# --------------------------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def deficit(task: str, value: float, reference: float) -> float:
    """How much worse ``value`` is than ``reference``: accuracy points, or percent of the reference loss."""
    if TASKS[task].higher_is_better:
        return (reference - value) * 100.0
    return (value - reference) / reference * 100.0


def deficit_unit(task: str) -> str:
    return "points" if TASKS[task].higher_is_better else "%"


def aggregate(records: list[dict], order: list[str] | None = None) -> list[dict]:
    rank = {label: i for i, label in enumerate(order or [])}
    tasks = list(OrderedDict.fromkeys(r["task"] for r in records))
    records = sorted(records, key=lambda r: (tasks.index(r["task"]), rank.get(r["label"], len(rank)), r["seed"]))
    groups: "OrderedDict[tuple, list[dict]]" = OrderedDict()
    for r in records:
        groups.setdefault((r["task"], r["label"], r["steps"]), []).append(r)
    aggs = []
    for (task, label, steps), runs in groups.items():
        first = runs[0]
        metrics = [r["final_metric"] for r in runs]
        # curves: the same validation steps in every seed
        by_step: "OrderedDict[int, list[dict]]" = OrderedDict()
        for r in runs:
            for point in r["curve"]:
                by_step.setdefault(point["step"], []).append(point)
        curve = [{
            "step": step,
            "metric_mean": _mean([p["metric"] for p in pts]),
            "metric_min": min(p["metric"] for p in pts),
            "metric_max": max(p["metric"] for p in pts),
            "cum_bytes_mean": _mean([p["cum_bytes"] for p in pts]),
            "samples_drawn_mean": _mean([p["samples_drawn"] for p in pts]),
        } for step, pts in by_step.items()]
        aggs.append({
            "task": task, "label": label, "variant": first["variant"], "p": first["p"], "setting": first["setting"],
            "fwd": first["fwd"], "bwd": first["bwd"], "steps": steps, "seeds": len(runs),
            "eval_samples": first["eval_samples"],
            "metric_mean": _mean(metrics), "metric_std": _std(metrics),
            "metric_min": min(metrics), "metric_max": max(metrics),
            "val_loss_mean": _mean([r["final_val_loss"] for r in runs]),
            "total_bytes_mean": _mean([r["total_bytes"] for r in runs]),
            "total_bytes_std": _std([r["total_bytes"] for r in runs]),
            "samples_drawn_mean": _mean([r["samples_drawn"] for r in runs]),
            "train_size": first["train_size"],
            "fresh_fraction": _mean([r["fresh_steps"] / max(r["steps_done"], 1) for r in runs]),
            "feedback_bytes_final_mean": _mean([r["feedback_bytes_final"] for r in runs]),
            "feedback_bytes_min": min(r["feedback_bytes_min"] for r in runs),
            "feedback_bytes_max": max(r["feedback_bytes_max"] for r in runs),
            "wall_seconds_mean": _mean([r["wall_seconds"] for r in runs]),
            "fit_seconds_mean": _mean([r["fit_seconds"] for r in runs]),
            "curve": curve,
        })
    # ratios and deficits against the uncompressed run of the same task and step count
    ref = {(a["task"], a["steps"]): a for a in aggs if a["variant"] == "uncompressed" and a["p"] == 1.0}
    for a in aggs:
        base = ref.get((a["task"], a["steps"]))
        a["bytes_ratio"] = base["total_bytes_mean"] / a["total_bytes_mean"] if base and a["total_bytes_mean"] else None
        a["deficit_vs_uncompressed"] = deficit(a["task"], a["metric_mean"], base["metric_mean"]) if base else None
    return aggs


# --------------------------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------------------------


def codec_bound(task: str, fwd: str, bwd: str) -> float:
    """fp32 bytes over payload bytes when every message is compressed (headers and warm starts left out)."""
    from lightning_clapping.codecs import get_codec

    raw = sent = 0
    for shape in MESSAGE_SHAPES[task]:
        raw += 2 * math.prod(shape) * 4
        for spec in (fwd, bwd):
            sent += get_codec(spec).payload_nbytes(shape, torch.float32)
    return raw / sent


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _spread_note(a: dict, b: dict) -> str:
    gap = abs(a["metric_mean"] - b["metric_mean"])
    spread = max(a["metric_std"], b["metric_std"])
    if a["seeds"] < 2 or b["seeds"] < 2:
        return "1 seed: no spread estimate"
    return "beyond the seed spread" if gap > 2 * spread else "within 2x the seed spread"


def _lazy_note(lazy: dict | None, unit: str) -> str:
    if lazy is None:
        return ""
    return (f"; lazy sampling alone at this p (no compression): deficit {lazy['deficit_vs_uncompressed']:+.2f} "
            f"{unit}")


def evaluate_targets(aggs: list[dict]) -> list[dict]:
    out: list[dict] = []
    tasks = list(OrderedDict.fromkeys(a["task"] for a in aggs))
    for task in tasks:
        mine = [a for a in aggs if a["task"] == task]
        unc = next((a for a in mine if a["variant"] == "uncompressed" and a["p"] == 1.0), None)
        lazy_only = {a["p"]: a for a in mine if a["variant"] == "uncompressed" and a["p"] < 1.0}
        unit = deficit_unit(task)
        tol_fu, tol_fc = TOLERANCE[task]
        if unc is None:
            out.append({"task": task, "target": "all", "met": None, "measured": "",
                        "why": "no uncompressed run to compare with"})
            continue

        # 1. clapping-fu within tolerance of uncompressed at equal steps
        for a in (a for a in mine if a["variant"] == "clapping-fu"):
            d = a["deficit_vs_uncompressed"]
            out.append({
                "task": task, "target": f"clapping-fu within {tol_fu:g} {unit} of uncompressed", "config": a["label"],
                "met": d <= tol_fu,
                "measured": f"{a['metric_mean']:.4f} vs {unc['metric_mean']:.4f}: deficit {d:+.2f} {unit}",
                "why": f"{_spread_note(a, unc)}; {a['fresh_fraction']:.0%} of steps drew a fresh batch, "
                       f"{a['samples_drawn_mean']:.0f} samples drawn vs {unc['samples_drawn_mean']:.0f}"
                       + _lazy_note(lazy_only.get(a["p"]), unit),
            })

        # 2. clapping-fc at >= 16x fewer bytes within the looser tolerance
        for a in (a for a in mine if a["variant"] == "clapping-fc"):
            d, ratio = a["deficit_vs_uncompressed"], a["bytes_ratio"]
            bound = codec_bound(task, a["fwd"], a["bwd"])
            why = [_spread_note(a, unc)]
            if bound < FC_MIN_RATIO:
                why.append(f"{a['fwd']}/{a['bwd']} cannot reach {FC_MIN_RATIO:g}x on these messages: at most "
                           f"{bound:.1f}x when every message is compressed (per-channel fp32 scales included)")
            out.append({
                "task": task, "target": f"clapping-fc >= {FC_MIN_RATIO:g}x fewer bytes, within {tol_fc:g} {unit}",
                "config": a["label"], "met": ratio >= FC_MIN_RATIO and d <= tol_fc,
                "measured": f"{ratio:.1f}x fewer bytes, deficit {d:+.2f} {unit} against uncompressed",
                "why": "; ".join(why),
            })

        # 3. aggressive setting: both clapping variants beat direct with the same codec
        direct = next((a for a in mine if a["variant"] == "direct" and a["setting"] == "aggressive"), None)
        for a in (a for a in mine if a["variant"].startswith("clapping") and a["setting"] == "aggressive"):
            if direct is None:
                continue
            d = deficit(task, a["metric_mean"], direct["metric_mean"])
            out.append({
                "task": task, "target": "aggressive: clapping beats direct (same codec)", "config": a["label"],
                "met": d < 0,
                "measured": f"{a['metric_mean']:.4f} vs direct {direct['metric_mean']:.4f} ({-d:+.2f} {unit} better)",
                "why": _spread_note(a, direct),
            })

        # 4. memory: clapping's buffers constant over the run; AQ-SGD's store against them
        clap = [a for a in mine if a["variant"].startswith("clapping")]
        if clap:
            sizes = {a["feedback_bytes_min"] for a in clap} | {a["feedback_bytes_max"] for a in clap}
            constant = len(sizes) == 1
            clap_bytes = max(sizes)
            measured = (f"clapping buffers {_fmt_bytes(clap_bytes)} in every step of every clapping run "
                        if constant else f"clapping buffers vary: {sorted(_fmt_bytes(s) for s in sizes)} ")
            why = ["one buffer per micro-batch slot and direction, both ends of 3 boundaries: O(batch x width)"]
            for aq in (a for a in mine if a["variant"] == "aqsgd"):
                seen = min(aq["samples_drawn_mean"], aq["train_size"])
                per_sample = aq["feedback_bytes_final_mean"] / seen if seen else math.nan
                full = per_sample * aq["train_size"]
                why.append(
                    f"AQ-SGD ({aq['setting']}) store {_fmt_bytes(aq['feedback_bytes_final_mean'])} after "
                    f"{seen:.0f} samples = {aq['feedback_bytes_final_mean'] / clap_bytes:.1f}x clapping; "
                    f"{_fmt_bytes(full)} = {full / clap_bytes:.0f}x once all {aq['train_size']} training samples "
                    f"were seen (it grows with the data set, clapping's does not)")
            out.append({"task": task, "target": "clapping feedback memory independent of data set size",
                        "config": "all clapping runs", "met": constant, "measured": measured.strip(),
                        "why": "; ".join(why)})
    return out


def sanity_checks(records: list[dict]) -> list[dict]:
    """Plain-data runs get their sample count from the loader's arithmetic: check it against the runs that log it."""
    out = []
    for r in records:
        if r["lazy"] and r["p"] == 1.0:
            out.append({"run": r["key"], "check": "samples drawn: logged by LazySamplingDataModule(p=1) == computed "
                        "for a plain loader", "ok": r["samples_drawn"] == r["samples_drawn_plain_check"],
                        "values": [r["samples_drawn"], r["samples_drawn_plain_check"]]})
    return out


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def machine() -> dict:
    return describe()


def _metric_str(a: dict) -> str:
    spread = f" ± {a['metric_std']:.4f}" if a["seeds"] > 1 else ""
    return f"{a['metric_mean']:.4f}{spread}"


def table(aggs: list[dict]) -> str:
    lines = []
    for task in OrderedDict.fromkeys(a["task"] for a in aggs):
        mine = [a for a in aggs if a["task"] == task]
        t = TASKS[task]
        held = mine[0]["eval_samples"]
        lines.append(f"\n{t.title}: {t.metric_label}{'' if held is None else f' ({held} samples spread over it)'}, "
                     f"{mine[0]['steps']} steps, {mine[0]['seeds']} seed(s) (mean ± std), bytes summed over all "
                     f"steps, boundaries and directions; 'train s': seconds of training and evaluation per run "
                     f"(set-up excluded; a shared machine's times drift)")
        head = (f"{'configuration':30} {t.metric:>18} {'vs unc.':>9} {'sent':>10} {'x fewer':>8} "
                f"{'samples drawn':>13} {'feedback mem':>12} {'train s':>7}")
        lines += [head, "-" * len(head)]
        for a in mine:
            dv = a["deficit_vs_uncompressed"]
            dv_s = ""
            if dv is not None and not (a["variant"] == "uncompressed" and a["p"] == 1.0):
                dv_s = f"{-dv:+.2f}pt" if t.higher_is_better else f"{dv:+.2f}%"
            ratio = f"{a['bytes_ratio']:.1f}" if a["bytes_ratio"] else ""
            lines.append(
                f"{a['label']:30} {_metric_str(a):>18} {dv_s:>9} {_fmt_bytes(a['total_bytes_mean']):>10} "
                f"{ratio:>8} {a['samples_drawn_mean']:>13.0f} {_fmt_bytes(a['feedback_bytes_final_mean']):>12} "
                f"{a['fit_seconds_mean']:>7.1f}")
        lines.append("('vs unc.': accuracy points against uncompressed, negative is worse)" if t.higher_is_better
                     else "('vs unc.': change of the validation loss against uncompressed in %, positive is worse)")
    return "\n".join(lines)


def targets_text(targets: list[dict]) -> str:
    lines = ["\nTargets:"]
    for t in targets:
        verdict = {True: "MET    ", False: "NOT MET", None: "n/a    "}[t["met"]]
        lines.append(f"  [{verdict}] {t['task']}: {t['target']} -- {t.get('config', '')}: {t['measured']}"
                     + (f" ({t['why']})" if t["why"] else ""))
    return "\n".join(lines)


_COLORS = {"uncompressed": "black", "direct": "tab:red", "ef21": "tab:orange", "aqsgd": "tab:purple",
           "clapping-fc": "tab:blue", "clapping-fu": "tab:green"}


def plot(aggs: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    files = []
    for task in OrderedDict.fromkeys(a["task"] for a in aggs):
        t = TASKS[task]
        mine = [a for a in aggs if a["task"] == task]
        settings = [s for s in OrderedDict.fromkeys(a["setting"] for a in mine) if s is not None] or [None]
        fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 9), squeeze=False)
        for col, setting in enumerate(settings):
            for a in mine:
                if a["setting"] not in (setting, None):
                    continue
                c = a["curve"]
                steps = [p["step"] for p in c]
                mean = [p["metric_mean"] for p in c]
                lo, hi = [p["metric_min"] for p in c], [p["metric_max"] for p in c]
                mbytes = [p["cum_bytes_mean"] / 2**20 for p in c]
                style = {"color": _COLORS.get(a["variant"], "gray"), "marker": "o", "markersize": 3,
                         "linestyle": ":" if a["variant"] == "uncompressed" and a["p"] < 1 else
                         "--" if a["variant"].startswith("clapping") and a["p"] < 0.5 else "-",
                         "label": a["label"].replace(f" {setting}", "") if setting else a["label"]}
                for row, xs in ((0, steps), (1, mbytes)):
                    ax = axes[row][col]
                    ax.plot(xs, mean, **style)
                    if a["seeds"] > 1:
                        ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.12)
            fwd_bwd = next((f"{a['fwd']} fwd / {a['bwd']} bwd" for a in mine if a["setting"] == setting), "")
            axes[0][col].set_title(f"{setting or ''} ({fwd_bwd})")
            axes[0][col].set_xlabel("optimizer step")
            axes[1][col].set_xlabel("cumulative MiB sent between stages (log)")
            axes[1][col].set_xscale("log")
            axes[1][col].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            for row in (0, 1):
                axes[row][col].set_ylabel(t.metric_label)
                axes[row][col].grid(alpha=0.3)
            axes[0][col].legend(fontsize=8)
        fig.suptitle(f"{t.title} (mean over {mine[0]['seeds']} seed(s), band: min-max)")
        fig.tight_layout()
        path = out / f"quality_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def _flat(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "curve"}


def write_csv(path: Path, records: list[dict], aggs: list[dict]) -> None:
    rows = [{"row": "run", **_flat(r)} for r in records] + [{"row": "aggregate", **_flat(a)} for a in aggs]
    fields = list(OrderedDict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def report(records: list[dict], args: Any, skipped: dict[str, str], meta: dict) -> dict:
    """Writes quality.json/.csv and the plots under ``args.out`` and prints the table and the targets."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    aggs = aggregate(records, meta.get("config_order"))
    targets = evaluate_targets(aggs)
    checks = sanity_checks(records)
    pngs = plot(aggs, out) if aggs else []
    result = {
        "benchmark": "quality vs bytes through a 4-stage pipeline (benchmarks/quality.py)",
        "mode": args.mode,
        **meta,
        "tasks": {name: {"title": TASKS[name].title, "metric": TASKS[name].metric_label,
                         "batch_size": TASKS[name].batch_size, "microbatches": TASKS[name].microbatches,
                         "split_points": TASKS[name].split_points} for name in OrderedDict.fromkeys(
                             r["task"] for r in records)},
        "skipped_tasks": skipped,
        "machine": machine(),
        "runs": records,
        "aggregates": aggs,
        "targets": targets,
        "checks": checks,
        "plots": pngs,
    }
    (out / "quality.json").write_text(json.dumps(result, indent=1))
    write_csv(out / "quality.csv", records, aggs)
    print(table(aggs))
    print(targets_text(targets))
    for c in checks:
        if not c["ok"]:
            print(f"  CHECK FAILED: {c['run']}: {c['check']}: {c['values']}")
    print(f"\nwrote {out / 'quality.json'}, {out / 'quality.csv'}" + "".join(f", {p}" for p in pngs), flush=True)
    return result
