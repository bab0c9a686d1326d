"""Repeats: every point of a study runs `experiment.repeats` times with seeds seed, seed+1, ...;
the repeats of one point form a cell, and a cell's figures come with 95% intervals.

    points/<point>_r<i>/   one repeat (the results contract of one run)
    intervals.parquet      one row per cell: its knobs, each figure's mean over the repeats and
                           its interval (`<figure>_low`, `<figure>_high`): a bootstrap over the
                           pooled requests for latency percentiles and attainment
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.config import Config
from testbed.experiments.sweep import Point
from testbed.metrics.slo import tenant_slos
from testbed.metrics.uncertainty import point_intervals, repeat_interval

OTHER_REPEATS = "{other_repeats}"  # in an override: a glob of every repeat suffix but the point's own

def with_repeats(points: list[Point], cfg: Config) -> list[Point]:
    """Each point once per repeat, the seed advanced; the cell knob names the point it repeats.
    OTHER_REPEATS in an override becomes a glob of every repeat suffix but this one's."""
    n = cfg.experiment.repeats
    out = []
    for point in points:
        if not point.repeat:
            out.append(Point(point.name, point.overrides, {**point.knobs, "cell": point.name, "repeat": 0,
                                                             "seed": point.overrides.get("seed", cfg.seed)}, False))
            continue
        for i in range(n):
            name = point.name if n == 1 else f"{point.name}_r{i}"
            seed = cfg.seed + i
            knobs = {**point.knobs, "cell": point.name, "repeat": i, "seed": seed}
            out.append(Point(name, {**_other_repeats(point.overrides, i), "seed": seed}, knobs))
    return out


def _other_repeats(overrides: dict, repeat: int) -> dict:
    return {k: v.replace(OTHER_REPEATS, f"[!{repeat}]") if isinstance(v, str) else v for k, v in overrides.items()}


KNOBS = ("label", "mode", "executor", "rate", "burstiness", "chunk", "prefill_len", "dispatch", "handoff", "num_gpus")


def cell_knobs(table: pd.DataFrame) -> list[str]:
    """The columns that identify a cell (its label, mode, rate, ...): the point's knobs."""
    return [c for c in KNOBS if c in table.columns]


def intervals(table: pd.DataFrame, cfg: Config, out_dir: Path, requests_of) -> pd.DataFrame:
    """One row per cell of the finished points: knobs, the mean over repeats of every numeric
    column, the repeats' count, and for latency percentiles and attainment the pooled figure
    with its bootstrap interval (see point_intervals).

    `requests_of(point)`: a point's requests without its warm-up."""
    rows = []
    knobs = cell_knobs(table)
    tenants = tenant_slos(cfg.workload.tenants, cfg.slo)
    for cell, group in table.groupby("cell", sort=False):
        row = {"cell": cell, **{k: group[k].iloc[0] for k in knobs}, "repeats": int(len(group))}
        for column in group.select_dtypes("number").columns:
            if column not in knobs and column not in ("repeat", "seed"):
                row[column] = float(group[column].mean())
        pooled = pd.concat([requests_of(p) for p in group["point"]], ignore_index=True)
        # a latency percentile of the pooled requests, beside its interval (not a mean of percentiles)
        for figure, (estimate, low, high) in point_intervals(pooled, cfg.slo, tenants, seed=cfg.seed).items():
            row[figure], row[f"{figure}_low"], row[f"{figure}_high"] = estimate, low, high
        rows.append(row)
    return pd.DataFrame(rows)


def goodput_interval(values: list[float], highest: float = float("inf")) -> dict:
    """{"mean", "low", "high", "values"}: one goodput per repeat, Student's t across them,
    within [0, the highest swept rate]."""
    mean, low, high = repeat_interval(values, bounds=(0.0, highest))
    return {"mean": mean, "low": low, "high": high, "values": [float(v) for v in values]}


def per_repeat(group: pd.DataFrame) -> list[pd.DataFrame]:
    """The rows of one configuration split by repeat (each a sweep over the study's axis)."""
    return [rows for _, rows in group.groupby("repeat", sort=True)] if "repeat" in group else [group]
