"""Quality against everything a rank sends, for every replica sync setting: the plot of ``replica_sync.json``.

    python benchmarks/replica_sync_plot.py [--results benchmarks/results/replica_sync.json] [--out PNG]

One panel per task (three to a row): x is how many times fewer bytes a replica's ranks sent per optimizer step than uncompressed
every-step training (pipeline messages, tied sum and replica sync together; log scale), y is the held-out metric's
change against every-step averaging (accuracy points, or the validation loss in %, drawn so that up is better), each
point the mean of the row's seeds. The band is the tolerance (1 point / 2 %). Colours group the settings by mode.
Reads the rows ``replica_sync.py`` saved; draws nothing new from runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = {"points": 1.0, "%": 2.0}


def family(config: str) -> str:
    if config == "every-step":
        return "every-step"
    if config.startswith("lag"):
        return "LAG"
    if "+ diloco" in config:
        return "Clapping-FC + DiLoCo"
    return "DiLoCo, compressed" if any(c in config for c in ("q4", "q8", "topk")) else "DiLoCo"


COLOURS = {"every-step": "black", "LAG": "tab:red", "DiLoCo": "tab:blue", "DiLoCo, compressed": "tab:cyan",
           "Clapping-FC + DiLoCo": "tab:green"}


def draw(rows: list[dict], out: Path) -> dict[str, int]:
    """Saves the figure to ``out``; returns the points drawn per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cols = min(3, len(tasks))
    grid = -(-len(tasks) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(5.2 * cols, 4.2 * grid), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    drawn: dict[str, int] = {}
    for ax, task in zip(axes.flat, tasks):
        mine = [r for r in rows if r["task"] == task]
        unit = mine[0]["delta_unit"]
        sign = 1.0 if unit == "points" else -1.0  # a higher loss is worse: drawn downwards
        tol = TOLERANCE[unit]
        ax.axhspan(-tol, max(tol, 0.0) if sign < 0 else 10 * tol, color="0.92", zorder=0)
        ax.axhline(0.0, color="0.6", lw=0.8)
        seen = set()
        best = {}  # per mode, the setting within tolerance that sends least: the one labelled among the crowd
        for r in mine:
            if r["within_tolerance"] and r["fewer_bytes"] > best.get(family(r["config"]), (0, ""))[0]:
                best[family(r["config"])] = (r["fewer_bytes"], r["config"])
        labelled = {config for _, config in best.values()}
        for r in mine:
            fam = family(r["config"])
            y = sign * r["delta"]
            ax.scatter(r["fewer_bytes"], max(y, -12 * tol), color=COLOURS[fam], s=28, zorder=3,
                       marker="o" if r["within_tolerance"] else "x", label=None if fam in seen else fam)
            drawn[task] = drawn.get(task, 0) + 1
            seen.add(fam)
            if r["within_tolerance"] and r["config"] not in labelled:
                continue
            clipped = " (off the scale)" if y < -12 * tol else ""
            ax.annotate(r["config"].replace("clapping-fc q4/q8 + ", "FC + ") + clipped,
                        (r["fewer_bytes"], max(y, -12 * tol)), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xscale("log")
        # one x range for every panel (a panel of few settings would otherwise get crowded minor-tick labels)
        ax.set_xlim(0.8, 1.6 * max(r["fewer_bytes"] for r in rows))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(-12.5 * tol, 3 * tol)
        ax.set_xlabel("x fewer bytes than uncompressed every-step\n(everything a rank sends)", fontsize=8)
        ax.set_ylabel("accuracy change, points" if unit == "points" else "validation loss change, % (down: worse)",
                      fontsize=8)
        ax.set_title(f"{task} ({mine[0]['seeds']} seeds); x: outside tolerance")
        ax.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return drawn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "results" / "replica_sync.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = json.loads(args.results.read_text())["rows"]
    out = args.out or args.results.with_suffix(".png")
    drawn = draw(rows, out)
    print(f"saved {out}: " + ", ".join(f"{task} {n} settings" for task, n in drawn.items()))


if __name__ == "__main__":
    main()
