"""Drawing a figure's uncertainty: error bars and shaded bands from the bounds of its 95%
interval, and the bounds of a cells table's column.

Error bars are drawn from the bounds themselves, not as +/- around the estimate: a percentile
bootstrap interval need not be centred on its estimate. Every artist drawn here carries the gid
"interval:<name>", so a test (or a reader of the figure) can find the interval it drew.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

BAND_ALPHA = 0.18  # light enough that overlapping bands of two configurations stay readable
NAN = float("nan")


def column_bounds(table: pd.DataFrame, column: str, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of a column's interval (`<column>_low`, `<column>_high`) scaled like the
    column; NaN where the table has none (a sweep saved without intervals)."""

    def side(name: str) -> np.ndarray:
        if name not in table.columns:
            return np.full(len(table), np.nan)
        return pd.to_numeric(table[name], errors="coerce").to_numpy(dtype=float) * scale

    return side(f"{column}_low"), side(f"{column}_high")


def as_float(value) -> float:
    """A bound from a JSON aggregate (None where there is none) as a float (NaN)."""
    return NAN if value is None else float(value)


def _known(*arrays: np.ndarray) -> np.ndarray:
    return np.logical_and.reduce([np.isfinite(np.asarray(a, dtype=float)) for a in arrays])


def error_bars(ax, at, low, high, colour: str, name: str, horizontal: bool = False):
    """A line from low to high at each position `at` (vertical, or horizontal at heights `at`);
    positions without both bounds get none. Returns the LineCollection, or None."""
    at, low, high = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (at, low, high))
    keep = _known(at, low, high)
    if not keep.any():
        return None
    draw = ax.hlines if horizontal else ax.vlines
    lines = draw(at[keep], low[keep], high[keep], colors=colour, linewidth=0.9, zorder=3)
    lines.set_gid(f"interval:{name}")
    return lines


def band(ax, x, low, high, colour: str, name: str):
    """A shaded band between the bounds along a line; gaps where a bound is unknown. Returns the
    collection, or None when no bound is known."""
    x, low, high = (np.asarray(v, dtype=float) for v in (x, low, high))
    keep = _known(x, low, high)
    if not keep.any():
        return None
    shade = ax.fill_between(x, low, high, where=keep, color=colour, alpha=BAND_ALPHA, linewidth=0, zorder=1)
    shade.set_gid(f"interval:{name}")
    return shade


def span(ax, low: float, high: float, colour: str, name: str) -> Optional[object]:
    """A horizontal band across the axes (a baseline drawn as a line, with its interval)."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return None
    shade = ax.axhspan(low, high, color=colour, alpha=BAND_ALPHA, linewidth=0, zorder=1)
    shade.set_gid(f"interval:{name}")
    return shade


def drawn(ax, name: str) -> list:
    """The interval artists drawn for `name` on ax."""
    gid = f"interval:{name}"
    return [a for a in (*ax.collections, *ax.patches) if a.get_gid() == gid]
