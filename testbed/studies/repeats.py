"""Repeats: every point of a study runs `experiment.repeats` times with seeds seed, seed+1, ...;
the repeats of one point form a cell, and a cell's figures come with 95% intervals.

    points/<point>_r<i>/   one repeat (the results contract of one run)
    intervals.parquet      one row per cell: its knobs, each numeric column's mean over the
                           repeats, and for latency percentiles and attainment the figure of the
                           pooled requests with its interval over the runs (`<figure>_low`,
                           `<figure>_high`, `<figure>_note`: see testbed/metrics/uncertainty.py)
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.config import Config
from testbed.metrics.comparisons import widened
from testbed.metrics.rate_search import Goodput
from testbed.metrics.slo import tenant_slos
from testbed.metrics.uncertainty import mean_interval, point_intervals
from testbed.studies.sweep import Point

OTHER_REPEATS = "{other_repeats}"  # in an override: a glob of every repeat suffix but the point's own


def with_repeats(points: list[Point], cfg: Config) -> list[Point]:
    """Each point once per repeat, the seed advanced; the cell knob names the point it repeats.
    OTHER_REPEATS in an override becomes a glob of every repeat suffix but this one's.

    The order runs repeat by repeat (every configuration of seed s, then of seed s+1, ...): on a
    shared host, drift over time then falls on all configurations of a seed alike, where blocks
    of one configuration would line it up with the configuration. A study whose points read other
    points' results ("{points}") keeps the order its builder gave."""
    n = cfg.experiment.repeats
    runs = {p.name: [_repeat(p, i, n, cfg.seed) for i in range(n)] if p.repeat else [_once(p, cfg)] for p in points}
    if any("{points}" in str(v) for p in points for v in p.overrides.values()):
        return [q for p in points for q in runs[p.name]]
    once = [runs[p.name][0] for p in points if not p.repeat]
    return once + [runs[p.name][i] for i in range(n) for p in points if p.repeat]


def _once(point: Point, cfg: Config) -> Point:
    return Point(
        point.name,
        point.overrides,
        {**point.knobs, "cell": point.name, "repeat": 0, "seed": point.overrides.get("seed", cfg.seed)},
        False,
    )


def _repeat(point: Point, i: int, n: int, first_seed: int) -> Point:
    name = point.name if n == 1 else f"{point.name}_r{i}"
    seed = first_seed + i
    knobs = {**point.knobs, "cell": point.name, "repeat": i, "seed": seed}
    return Point(name, {**_other_repeats(point.overrides, i), "seed": seed}, knobs)


def _other_repeats(overrides: dict, repeat: int) -> dict:
    return {k: v.replace(OTHER_REPEATS, f"[!{repeat}]") if isinstance(v, str) else v for k, v in overrides.items()}


KNOBS = (
    "label",
    "mode",
    "executor",
    "rate",
    "concurrency",
    "burstiness",
    "chunk",
    "prefill_len",
    "dispatch",
    "handoff",
    "num_gpus",
)


def cell_knobs(table: pd.DataFrame) -> list[str]:
    """The columns that identify a cell (its label, mode, rate, ...): the point's knobs."""
    return [c for c in KNOBS if c in table.columns]


def intervals(table: pd.DataFrame, cfg: Config, out_dir: Path, requests_of) -> pd.DataFrame:
    """One row per cell of the finished points: knobs, the mean over repeats of every numeric
    column, the repeats' count, and for latency percentiles and attainment the pooled figure
    with its interval over the runs (see point_intervals).

    `requests_of(point)`: a point's requests without its warm-up."""
    rows = []
    knobs = cell_knobs(table)
    tenants = tenant_slos(cfg.workload.tenants, cfg.slo)
    for cell, group in table.groupby("cell", sort=False):
        row = {"cell": cell, **{k: group[k].iloc[0] for k in knobs}, "repeats": int(len(group))}
        for column in group.select_dtypes("number").columns:
            if column not in knobs and column not in ("repeat", "seed"):
                row[column] = float(group[column].mean())
        pooled = pd.concat([requests_of(p).assign(point=p) for p in group["point"]], ignore_index=True)
        # a latency percentile of the pooled requests, beside its interval (not a mean of percentiles)
        for figure, interval in point_intervals(pooled, cfg.slo, tenants).items():
            row[figure], row[f"{figure}_low"], row[f"{figure}_high"] = interval
            row[f"{figure}_note"] = interval.note
        rows.append(row)
    return pd.DataFrame(rows)


def goodput_interval(values: list[Goodput], highest: float = float("inf")) -> dict:
    """{"mean", "low", "high", "censored", "error", "values"}: one goodput per repeat, Student's t
    across them widened by their mean interpolation error, within [0, the highest rate tried].
    Any censored repeat makes the mean a bound (`censored`: above / below) with no interval."""
    censored = {g.censored for g in values if g.censored}
    interval = mean_interval([g.value for g in values], bounds=(0.0, highest))
    error = float(sum(g.error for g in values) / len(values)) if values else 0.0
    if len(censored) == 1:
        interval = type(interval)(interval.estimate, units=interval.units)
    elif censored:  # bounds both ways: nothing is known of the mean
        interval = type(interval)(float("nan"), units=interval.units)
    else:
        interval = widened(interval, error, (0.0, highest))
    return {
        "mean": interval.estimate,
        "low": interval.low,
        "high": interval.high,
        "censored": censored.pop() if len(censored) == 1 else "",
        "error": error,
        "values": [float(g.value) for g in values],
        "censoring": [g.censored for g in values],
        "errors": [float(g.error) for g in values],
        "monotone": [bool(g.monotone) for g in values],
    }


def per_repeat(group: pd.DataFrame) -> list[pd.DataFrame]:
    """The rows of one configuration split by repeat (each a sweep over the study's axis)."""
    return [rows for _, rows in group.groupby("repeat", sort=True)] if "repeat" in group else [group]
