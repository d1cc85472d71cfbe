"""Write the table of published quality that autotune's frontier rule reads (package data) from the committed results.

    python benchmarks/frontier_table.py            # rewrites lightning_clapping/autotune/frontier.json
    python benchmarks/frontier_table.py --check    # exit 1 when the packaged table is not what the results give

Source: ``benchmarks/results/quality.json`` (``quality.py``, BENCHMARKS section 1). For every compressed setting
measured there (variant, lazy-sampling p, forward / backward / fresh-step codecs) the table keeps, per task, its
quality deficit against uncompressed training (accuracy points lost, or % added to the validation loss: what
BENCHMARKS calls the deficit), its byte ratio, its number of seeds and whether it lies on that task's frontier. Run it
whenever quality.json changes; tests/autotune/test_autotune.py fails while the two disagree.

``longer_runs`` quotes the runs the table's short tasks do not cover (``LONGER``: Shakespeare at 480 steps, a character
LM of WordNet's glosses at 480 and a vision transformer on Fashion-MNIST at 860; BENCHMARKS "The bottleneck over
longer runs" and "Two tasks the frontier was not tuned on"): every setting measured there, model changes included, its
deficit and byte ratio per task, its worst task, and the cross-task result (the setting with the most bytes saved
within the tolerance on every one of those tasks, and the best model change by its worst task). The frontier rule
also refuses a codec setting that a longer run measured outside the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_clapping.autotune.frontier import DEFAULT_QUALITY_TOLERANCE  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "quality.json"
TABLE = ROOT / "lightning_clapping" / "autotune" / "frontier.json"
FORMAT = 1
#: the tasks whose whole grid of settings was measured. The rule counts a setting only where every task of the table
#: measured it, so a task measured on a few settings (wordnet_minilm: fine-tuning a pretrained model, a subset of the
#: grid) would leave autotune only those; its numbers are in BENCHMARKS section 1, not in the table.
TABLE_TASKS = ("fashion_mnist", "shakespeare")
#: the longer runs' tasks and the results file (under benchmarks/results) that holds each
LONGER = {"shakespeare": "frontier_long/quality.json", "wordnet_glosses": "more_tasks/quality.json",
          "fashion_vit": "more_tasks/quality.json"}
#: the tolerance the cross-task result is judged at (BENCHMARKS' and autotune's default)
TOLERANCE = DEFAULT_QUALITY_TOLERANCE


def load_longer() -> dict[str, dict[str, Any]]:
    """The parsed results files of the longer runs, by their path in ``LONGER``."""
    return {rel: json.loads((RESULTS.parent / rel).read_text()) for rel in sorted(set(LONGER.values()))}


def longer_runs(sources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``longer_runs`` section from the parsed results files ``sources`` (by their path in ``LONGER``)."""
    tasks: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    for task, rel in LONGER.items():
        found = [a for a in sources[rel]["aggregates"] if a["task"] == task]
        if not found:
            continue
        tasks[task] = {"unit": sources[rel]["frontier"][task]["unit"], "steps": found[0]["steps"],
                       "source": f"benchmarks/results/{rel}"}
        for a in found:
            if a["fwd"] is None and a["bwd"] is None and not a.get("model_change"):
                continue  # the reference
            row = rows.setdefault(a["label"], {"config": a["label"], "model_change": bool(a.get("model_change")),
                                               "deficit": {}, "bytes_ratio": {}, "seeds": {}})
            row["deficit"][task] = float(a["deficit_vs_uncompressed"])
            row["bytes_ratio"][task] = float(a["bytes_ratio"])
            row["seeds"][task] = int(a["seeds"])
    over: dict[str, list[float]] = {}  # per setting, its deficits over the tolerance, worst first (to 1e-4: the
    for row in rows.values():          # same deficit measured on another setting must not win by float noise)
        ratio = {t: round(d / TOLERANCE[tasks[t]["unit"]], 4) for t, d in row["deficit"].items()}
        row["worst_task"] = max(sorted(ratio), key=ratio.__getitem__)
        row["within_tolerance"] = max(ratio.values()) <= 1.0
        row["on_every_task"] = set(row["deficit"]) == set(tasks)
        over[row["config"]] = sorted(ratio.values(), reverse=True)
    everywhere = sorted((r for r in rows.values() if r["on_every_task"]), key=lambda r: r["config"])
    kept = [r for r in everywhere if r["within_tolerance"]]
    changes = [r for r in everywhere if r["model_change"]]
    most_saved = max(kept, key=lambda r: (min(r["bytes_ratio"].values()), [-x for x in over[r["config"]]]),
                     default={"config": None})
    # by the worst task, then the next worst, then the fewest bytes
    best_change = min(changes, key=lambda r: (over[r["config"]], -min(r["bytes_ratio"].values())),
                      default={"config": None})
    return {
        "tasks": tasks,
        "tolerance": TOLERANCE,
        "most_saved_within_tolerance_on_every_task": most_saved["config"],
        "best_model_change_by_its_worst_task": best_change["config"],
        "settings": sorted(rows.values(), key=lambda r: r["config"]),
    }


def build(results: dict[str, Any], longer: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The table for ``results`` (the parsed quality.json) and the longer runs' results files (``load_longer()``;
    none: no ``longer_runs`` section): plain JSON values, settings in the results' order."""
    tasks = {}
    for task, front in results["frontier"].items():
        if task not in TABLE_TASKS:
            continue
        settings = results["mode_settings"]["tasks"].get(task, {})
        tasks[task] = {"metric": results["tasks"][task]["metric"], "unit": front["unit"],
                       "steps": settings.get("steps")}
    # autotune chooses fixed codecs, never a model change (a Bottleneck the user inserts) nor a schedule over the
    # run: those runs are left out, and the frontier is that of the fixed codec settings alone
    choosable = [a for a in results["aggregates"]
                 if not a.get("model_change") and not a.get("scheduled") and a["deficit_vs_uncompressed"] is not None
                 and a["bytes_ratio"]]

    def beaten(a: dict[str, Any]) -> bool:
        ra, da = a["bytes_ratio"], a["deficit_vs_uncompressed"]
        return any(b["task"] == a["task"] and b["bytes_ratio"] >= ra and b["deficit_vs_uncompressed"] <= da
                   and (b["bytes_ratio"] > ra or b["deficit_vs_uncompressed"] < da) for b in choosable)

    on_frontier = {(a["task"], a["label"]) for a in choosable if not beaten(a)}
    rows: dict[str, dict[str, Any]] = {}
    for agg in choosable:
        task, config = agg["task"], agg["label"]
        if task not in tasks or (agg["fwd"] is None and agg["bwd"] is None):
            continue  # uncompressed runs are the reference, not a setting to choose
        row = rows.setdefault(config, {"config": config, "variant": agg["variant"], "p": float(agg["p"]),
                                       "fwd": agg["fwd"], "bwd": agg["bwd"], "fresh": agg["fresh"],
                                       "deficit": {}, "bytes_ratio": {}, "seeds": {}, "frontier": []})
        if (row["variant"], row["p"], row["fwd"], row["bwd"], row["fresh"]) != (
                agg["variant"], float(agg["p"]), agg["fwd"], agg["bwd"], agg["fresh"]):
            raise ValueError(f"{config!r} names two different settings in {RESULTS.name}")
        row["deficit"][task] = float(agg["deficit_vs_uncompressed"])
        row["bytes_ratio"][task] = float(agg["bytes_ratio"])
        row["seeds"][task] = int(agg["seeds"])
        if (task, config) in on_frontier:
            row["frontier"].append(task)
    order = {name: i for i, name in enumerate(results.get("config_order", []))}
    extra = {} if longer is None else {"longer_runs": longer_runs(longer)}
    return {
        "format": FORMAT,
        "about": "published quality per setting, read by autotune's frontier rule; written by "
                 "benchmarks/frontier_table.py from benchmarks/results/quality.json",
        "source": "benchmarks/results/quality.json",
        "mode": results["mode"],
        "tasks": tasks,
        "settings": sorted(rows.values(), key=lambda r: (order.get(r["config"], len(order)), r["config"])),
        **extra,
    }


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=TABLE)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the table is stale")
    args = parser.parse_args(argv)
    text = render(build(json.loads(args.results.read_text()), load_longer()))
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'stale: run python benchmarks/frontier_table.py'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(json.loads(text)['settings'])} settings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
