"""replica_sync_slow's results: time to target per setting and link (combine), the printed table, the plot and the
files (split from the script to keep each file small)."""

from __future__ import annotations

import json
from pathlib import Path

from _slow_network_report import _fmt
from _table import markdown_table
from time_to_target import steps_to_target

BASELINE = "every-step"
LAYOUT_TEXT = {"sites": "site A = replica 0 (ranks 0, 1), site B = replica 1 (ranks 2, 3); fast within a site",
               "all-slow": "every rank its own site: pipeline and replica sync cross the slow link"}


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")[:40]


# ====================================================================================================================
# Combining, the report, the files
# ====================================================================================================================


def combine(timing: list[dict], trajectory: list[dict], target: float | None, args) -> list[dict]:
    """Per layout, link and setting: mean step there x steps to target on loopback, and every-step's time over it."""
    traj = {r["setting"]: r for r in trajectory}
    out = []
    for t in timing:
        tr = traj.get(t["setting"])
        row = {k: t.get(k) for k in ("layout", "link", "rate_mbit", "delay_ms", "setting", "mean_step_s",
                                     "median_step_s", "sync_step_s", "first_sync_step_s", "replica_bytes_per_step",
                                     "relay_wire_bytes_per_step", "relay_lan_bytes_per_step", "other_cores")}
        row.update(loopback_step_s=tr.get("mean_step_s") if tr else None, target_val_loss=target,
                   steps_to_target=None, time_to_target_s=None, budget_steps=tr.get("budget_steps") if tr else None)
        if t["error"]:
            row["status"] = f"timing run failed: {t['error']}"
        elif tr is None or tr["error"]:
            row["status"] = "no loopback trajectory" + (f" ({tr['error']})" if tr else "")
        elif target is None:
            row["status"] = "no target (every-step's loopback run failed)"
        else:
            row["steps_to_target"] = steps_to_target(tr["vals"], target)
            if row["steps_to_target"] is None:
                row["status"] = f"not reached in {tr['global_step']} steps"
            else:
                row["status"] = "reached"
                row["time_to_target_s"] = row["steps_to_target"] * t["mean_step_s"]
        out.append(row)
    for r in out:
        base = next((b for b in out if (b["layout"], b["link"], b["setting"]) == (r["layout"], r["link"], BASELINE)),
                    None)
        ok = base and base["time_to_target_s"] and r["time_to_target_s"]
        r["x_every_step"] = base["time_to_target_s"] / r["time_to_target_s"] if ok else None
        r["step_x_loopback"] = (r["mean_step_s"] / r["loopback_step_s"] if r["mean_step_s"] and r["loopback_step_s"]
                                else None)
    for key in dict.fromkeys((r["layout"], r["link"]) for r in out):
        mine = [r for r in out if (r["layout"], r["link"]) == key and r["time_to_target_s"] is not None]
        best = min(mine, key=lambda r: r["time_to_target_s"])["setting"] if mine else None
        for r in out:
            if (r["layout"], r["link"]) == key:
                r["first"] = r["setting"] == best
    return out


LEGEND = (
    "mean step s: mean training step of rank 0 on the link over the steps after the skipped ones (2 x H steps: two "
    "DiLoCo syncs); sync step s: the mean of DiLoCo's outer-step steps alone; loopback s: the same setting's mean "
    "step on loopback (compute only); first sync s: the step of the first outer step (one-time costs, not in the "
    "time to target); steps: first validation at or below the target in the setting's loopback run; "
    "to target s: steps x mean step; x every-step: every-step's time to target / this one (> 1: faster); cross kB: "
    "what crossed between sites per step of the timing run (relay counters, IP bytes, all ranks; the whole run: "
    "warm-up steps and its one validation batch included)."
)


def print_table(rows: list[dict], target: float | None) -> None:
    print(f"target: validation loss {_fmt(target, '.4f')} (every-step on loopback at its last step)\n")
    print(markdown_table(
        [(r["layout"], r["link"], f"{r['setting']}{' **first**' if r.get('first') else ''}", r["mean_step_s"],
          r["sync_step_s"], r["first_sync_step_s"], r["loopback_step_s"],
          None if r["relay_wire_bytes_per_step"] is None else r["relay_wire_bytes_per_step"] / 1e3,
          str(r["steps_to_target"]) if r["steps_to_target"] is not None else r["status"], r["time_to_target_s"],
          r["x_every_step"]) for r in rows],
        ["layout", "link", "setting", "mean step s", "sync step s", "first sync s", "loopback s", "cross kB/step",
         "steps to target", "time to target s", "x every-step"],
        floatfmt=(None, None, None, ".3f", ".3f", ".2f", ".3f", ".1f", None, ".1f", ".2f"),
        colalign=("left",) * 3 + ("right",) * 8))
    print(f"\n{LEGEND}")


#: --task -> the plot's name for it
TASK_TITLES = {"shakespeare": "Shakespeare char-LM", "wordnet_minilm": "MiniLM-L6 fine-tuned on WordNet supersenses"}


def plot(rows: list[dict], path: Path, task: str = "shakespeare") -> None:
    """Time to target against the link rate, one panel per layout, one line per setting; "not reached" as an x at
    the top of its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {s: cycle[i % len(cycle)] for i, s in enumerate(settings)}
    fig, axes = plt.subplots(1, len(layouts), figsize=(6.5 * len(layouts), 4.5), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        mine = [r for r in rows if r["layout"] == layout]
        rates = sorted({r["rate_mbit"] for r in mine})
        ax.set_xscale("log")
        ax.set_xlim(rates[0] / 1.3, rates[-1] * 1.3)
        for s in settings:
            pts = sorted((r["rate_mbit"], r["time_to_target_s"]) for r in mine
                         if r["setting"] == s and r["time_to_target_s"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s, color=colour[s])
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 2.5)  # room above the lines for the "not reached" marks
        top = ax.get_xaxis_transform()
        for s in settings:
            missed = [r["rate_mbit"] for r in mine if r["setting"] == s and r["status"].startswith("not reached")]
            if missed:
                ax.plot(missed, [0.95] * len(missed), "x", color=colour[s], ms=9, mew=2, transform=top)
        ax.set_xticks(rates, [f"{x:g}" for x in rates])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())
        low, high = ax.get_ylim()  # minor labels only where the panel spans less than a decade (else they crowd)
        ax.yaxis.set_minor_formatter(ScalarFormatter() if high / low < 10 else NullFormatter())
        delays = sorted({r["delay_ms"] for r in mine})
        ax.set_xlabel(f"link rate between sites, Mbit/s ({', '.join(f'{d:g}' for d in delays)} ms one-way)")
        ax.set_ylabel("time to target, s (steps x mean step)")
        ax.set_title(f"{layout}: {LAYOUT_TEXT[layout]}", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"2 replicas x 2 stages, {TASK_TITLES.get(task, task)}:\ntime to every-step's final loss "
                 "(x: not reached)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(result: dict, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    if any(r["time_to_target_s"] is not None or r["status"].startswith("not reached") for r in result["rows"]):
        try:
            plot(result["rows"], out / f"{stem}.png", result["settings"].get("task", "shakespeare"))
            paths.append(out / f"{stem}.png")
        except ImportError:
            print("no plot: matplotlib is not installed")
    return paths


# ====================================================================================================================
# Main
# ====================================================================================================================


