"""The goodput search of a goodput study (Study.searches_goodput): after the grid, each
configuration and repeat adds rates until its 90%-attainment crossing is bracketed tightly
(testbed/metrics/rate_search.py decides each next rate; this module only runs them).

A search point is the grid point of its configuration and repeat at another rate, named like the
grid's (`<label>_rate<r>[_r<i>]`) with the knob stage=search: its cell holds the repeats that
happened to try that rate, and figures keep the grid alone (aggregates.on_grid).
"""

from __future__ import annotations

import pandas as pd

from testbed.metrics.rate_search import RateSearch, next_rate
from testbed.studies.sweep import Point, Sweep


def rate_search(cfg) -> RateSearch:
    e = cfg.experiment
    rates = list(e.rates) or [cfg.workload.rate]
    return RateSearch(
        budget=e.search_points,
        tolerance=e.search_tolerance,
        floor=min(rates) / e.search_span,
        cap=max(rates) * e.search_span,
    )


def search_goodput(sweep: Sweep, cfg) -> pd.DataFrame:
    """Run rounds of search points (one per configuration and repeat still searching) until
    every search has ended; the sweep's table after them."""
    if cfg.experiment.search_points == 0 or cfg.executor == "http":
        return sweep.table()
    search, grid = rate_search(cfg), [p for p in sweep.points if "rate" in p.knobs]
    for round_ in range(cfg.experiment.search_points):
        points = proposals(sweep.table(), grid, search, {p.name for p in sweep.points})
        if not points:
            break
        sweep.extend(points, f"goodput search {round_ + 1}")
    return sweep.table()


def proposals(table: pd.DataFrame, grid: list[Point], search: RateSearch, taken: set[str]) -> list[Point]:
    """One new point per (configuration, repeat) whose search goes on."""
    from testbed.studies.aggregates import finished, requests_counted

    done = finished(table)
    out = []
    # repeat by repeat, the configurations side by side: drift of a shared host over time falls on
    # every configuration of a seed alike instead of lining up with one configuration
    for (repeat, label), rows in done.groupby(["repeat", "label"]) if len(done) else []:
        used = int((rows["stage"] == "search").sum()) if "stage" in rows.columns else 0
        rate = next_rate(
            rows["rate"].tolist(), rows["slo_attainment"].tolist(), search, used, weights=requests_counted(rows)
        )
        base = next((p for p in grid if p.knobs["label"] == label and p.knobs.get("repeat") == repeat), None)
        if rate is None or base is None:
            continue
        point = at_rate(base, rate)
        if point.name not in taken:
            out.append(point)
    return out


def at_rate(base: Point, rate: float) -> Point:
    """The grid point `base` moved to `rate`: same configuration, seed and repeat."""
    label, repeat = base.knobs["label"], base.knobs.get("repeat", 0)
    cell = f"{label}_rate{rate:g}"
    name = base.name.replace(base.knobs["cell"], cell, 1) if base.knobs.get("cell") else cell
    return Point(
        name,
        {**base.overrides, "workload.rate": rate},
        {**base.knobs, "rate": rate, "cell": cell, "repeat": repeat, "stage": "search"},
    )
