"""The benchmarks' one table printer: ``table`` for the terminal (tabulate's "simple" format), ``markdown_table`` for
tables meant to be pasted into BENCHMARKS.md (tabulate's "pipe" format, GitHub markdown with aligned columns).

A cell is printed as given when it is a string, with its column's format spec when it is a number (``floatfmt``: one
spec for every column or one per column, e.g. ``(None, ".2f", ",")``; ``None`` or ``""`` means ``str``), and as
``missing`` when it is ``None``. Numbers are formatted here, not by tabulate, so a table shows exactly the rounding
the script asks for. Columns of numbers (or of number-like strings such as ``"1.5x"``, ``"12.0%"``, ``"-"``) are
right-aligned and the others left-aligned unless ``colalign`` says otherwise.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tabulate import tabulate

_NUMBER_LIKE = re.compile(r"^[+-]?(\d[\d,]*\.?\d*|\.\d+)(e[+-]?\d+)?\s*[x%]?$|^[-—]$|^$", re.IGNORECASE)


def _cell(value, spec: str | None, missing: str) -> str:
    if value is None:
        return missing
    if isinstance(value, str):
        return value
    return format(value, spec) if spec else str(value)


def _numeric(value) -> bool:
    if isinstance(value, bool):
        return False
    if value is None or isinstance(value, (int, float)):
        return True
    return bool(_NUMBER_LIKE.match(str(value).strip()))


def _layout(rows: Iterable[Sequence], headers: Sequence[str], floatfmt, colalign, missing: str, fmt: str) -> str:
    rows = [list(r) for r in rows]
    width = len(headers)
    specs = [floatfmt] * width if floatfmt is None or isinstance(floatfmt, str) else list(floatfmt)
    cells = [[_cell(v, specs[i] if i < len(specs) else None, missing) for i, v in enumerate(r)] for r in rows]
    if colalign is None:
        colalign = ["right" if rows and all(_numeric(r[i]) for r in rows if i < len(r)) else "left"
                    for i in range(width)]
    return tabulate(cells, headers=list(headers), tablefmt=fmt, colalign=list(colalign), disable_numparse=True)


def table(rows: Iterable[Sequence], headers: Sequence[str], floatfmt: str | Sequence[str | None] | None = None,
          colalign: Sequence[str] | None = None, missing: str = "-") -> str:
    """The rows as a plain-text table (tabulate's "simple" format), one line per row under a dashed header."""
    return _layout(rows, headers, floatfmt, colalign, missing, "simple")


def markdown_table(rows: Iterable[Sequence], headers: Sequence[str],
                   floatfmt: str | Sequence[str | None] | None = None, colalign: Sequence[str] | None = None,
                   missing: str = "-") -> str:
    """The rows as a GitHub markdown table (tabulate's "pipe" format: ``---:`` marks a right-aligned column)."""
    return _layout(rows, headers, floatfmt, colalign, missing, "pipe")
