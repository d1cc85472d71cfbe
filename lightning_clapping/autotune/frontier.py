"""The published quality of compression settings, and which of them autotune's frontier rule may use.

``frontier.json`` (package data, next to this module) is written by ``benchmarks/frontier_table.py`` from the
committed ``benchmarks/results/quality.json`` (BENCHMARKS section 1; a test checks that the two agree). For every
compressed setting measured there (variant, lazy-sampling p, forward / backward / fresh-step codecs) it holds, per
task, the quality deficit against uncompressed training: accuracy points lost (unit ``"points"``) or per cent added
to the validation loss (unit ``"%"``); negative is better.

:func:`admissible` gives the settings a run may switch to: those of the run's variant and lazy-sampling p, measured
on every task of the table, whose deficit on each task is within the tolerance for its unit (default
:data:`DEFAULT_QUALITY_TOLERANCE`: 1 accuracy point, 2 % validation loss, BENCHMARKS' tolerance), and which none
of the longer runs quoted in the table's ``longer_runs`` (more steps, tasks the table does not hold) measured outside
it; a setting's ``worst`` counts those runs too.
Autotune (:func:`lightning_clapping.autotune.choose.choose`, ``frontier=``) prices them with its timing model, and
:func:`frontier_rule` takes one only when the links need it (the rule is stated in
:mod:`lightning_clapping.autotune.choose`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from lightning_clapping.autotune.messages import UNCOMPRESSED

Key = tuple[int, str]  # (boundary, direction)
TABLE = Path(__file__).with_name("frontier.json")
#: deficit allowed per unit of the table: accuracy points, and per cent of validation loss
DEFAULT_QUALITY_TOLERANCE: dict[str, float] = {"points": 1.0, "%": 2.0}


@dataclass(frozen=True)
class FrontierSetting:
    """One published setting: its codecs and its worst deficit relative to the tolerance (``worst``: 1.0 = just
    at the tolerance on some task; smaller is better)."""

    config: str  #: its name in BENCHMARKS / quality.json, e.g. "clapping-fu p=0.5 randk fresh-q4"
    variant: str
    p: float
    forward: str
    backward: str
    fresh: str | None  #: the fresh-step codec (fresh_codec), None: none
    worst: float

    def setting(self, direction: str) -> str:
        return self.forward if direction == "fwd" else self.backward


@lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict[str, Any]:
    """The parsed table (the packaged one unless ``path`` is given)."""
    table = json.loads((TABLE if path is None else Path(path)).read_text())
    if table.get("format") != 1 or not isinstance(table.get("settings"), list):
        raise ValueError(f"{path or TABLE} is not a frontier table of format 1: regenerate it with "
                         "python benchmarks/frontier_table.py")
    return table


def check_tolerance(tolerance: Mapping[str, float] | None, table: Mapping[str, Any] | None = None) -> dict[str, float]:
    """``tolerance`` completed with the defaults; every unit must be one of the table's, every value a number >= 0."""
    table = load_table() if table is None else table
    units = {t["unit"] for t in table["tasks"].values()}
    out = {**DEFAULT_QUALITY_TOLERANCE, **(tolerance or {})}
    for unit, value in out.items():
        if unit not in units | set(DEFAULT_QUALITY_TOLERANCE):
            raise ValueError(f"quality tolerance for unknown unit {unit!r}: the published deficits are in "
                             f"{sorted(units)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"quality tolerance {unit!r} must be a number >= 0, got {value!r}")
    return {u: float(v) for u, v in out.items()}


def admissible(variant: str, p: float, tolerance: Mapping[str, float] | None = None,
               table: Mapping[str, Any] | None = None) -> list[FrontierSetting]:
    """The published settings of ``variant`` at lazy-sampling ``p`` (1.0 without lazy sampling) whose deficit on
    every task of the table is within ``tolerance`` (``{unit: allowed deficit}``, completed from
    :data:`DEFAULT_QUALITY_TOLERANCE`), in the table's order."""
    table = load_table() if table is None else table
    tol = check_tolerance(tolerance, table)
    units = {task: info["unit"] for task, info in table["tasks"].items()}
    longer = table.get("longer_runs", {"tasks": {}, "settings": []})
    longer_units = {task: info["unit"] for task, info in longer["tasks"].items()}
    measured_longer = {row["config"]: row["deficit"] for row in longer["settings"]}

    def over(deficit: float, unit: str) -> float:
        """The deficit as a multiple of its tolerance (a tolerance of 0 allows no loss)."""
        return deficit / tol[unit] if tol[unit] > 0 else (math.inf if deficit > 0 else 0.0)

    out = []
    for row in table["settings"]:
        if row["variant"] != variant or not math.isclose(row["p"], p, abs_tol=1e-9) or None in (row["fwd"],
                                                                                              row["bwd"]):
            continue
        if set(row["deficit"]) != set(units):
            continue  # not measured on every task: its quality is not known well enough
        later = measured_longer.get(row["config"], {})
        worst = max([over(row["deficit"][task], unit) for task, unit in units.items()]
                    + [over(d, longer_units[task]) for task, d in later.items()])
        if worst <= 1.0:
            out.append(FrontierSetting(row["config"], row["variant"], row["p"], row["fwd"], row["bwd"],
                                       row["fresh"], worst))
    return out


def frontier_rule(ladder_plan: dict[Key, Any], ladders: Mapping[Key, tuple[str, ...]],
                  settings: Sequence[FrontierSetting], fresh_of: Callable[[FrontierSetting], Mapping[str, Any]],
                  price: Callable[[Key, str, Any], Any], predict: Callable[[Mapping[Key, Any]], float],
                  tolerance: float) -> tuple[dict[Key, Any], str]:
    """The frontier rule (:mod:`lightning_clapping.autotune.choose`): ``(plan, the published setting's name or "")``.

    ``ladder_plan``: the step rule's choice, ``{(boundary, direction): priced setting}``; ``ladders``: each key's
    ladder (a key whose ladder is only "uncompressed" stays so); ``price(key, setting, fresh form)`` prices a
    setting, ``predict(plan)`` a plan's step; ``fresh_of(setting)``: the fresh forms of a published setting."""
    ladder_step = predict(ladder_plan)
    plans = []
    for n, s in enumerate(settings):
        fresh = fresh_of(s)
        plan = {k: p if ladders[k] == (UNCOMPRESSED,) else price(k, s.setting(k[1]), fresh[k[1]])
                for k, p in ladder_plan.items()}
        plans.append((s.worst, predict(plan), n, plan, s))
    bound = (1 + tolerance) * min([ladder_step, *(p[1] for p in plans)])
    if ladder_step <= bound:
        return ladder_plan, ""
    *_, plan, s = min(p for p in plans if p[1] <= bound)  # the smallest published deficit, then the faster
    while True:  # back to the ladders' setting where the link does not need the published one, cheapest first
        moves = [(predict({**plan, k: ladder_plan[k]}), n, k) for n, k in enumerate(plan) if plan[k] != ladder_plan[k]]
        allowed = [m for m in moves if m[0] <= bound]
        if not allowed:
            return plan, s.config
        _, _, k = min(allowed)
        plan[k] = ladder_plan[k]
