"""Saved results -> tidy DataFrames. Nothing here reruns anything: it reads the results contract
(docs/design.md) of single runs and the sweep layout of studies:

    <sweep>/sweep.parquet, sweep.json ("experiment", "points", "aggregate"): one row per point
    <sweep>/intervals.parquet one row per cell (a point's repeats together) with 95% intervals
    <sweep>/points/<point>/   one run's results directory
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np
import pandas as pd

from testbed.metrics.config import MetricsConfig
from testbed.metrics.latency import BUCKETS, pooled_itl, ttft_by_bucket
from testbed.metrics.results_dir import read_results
from testbed.metrics.summary import measured
from testbed.metrics.uncertainty import request_units, sample_interval
from testbed.studies.repeats import KNOBS as CELL_KNOBS

FINISHED = ("ok", "skipped")  # a resumed sweep marks points it did not rerun as "skipped"
# The columns that say what a cell is (those a study's points vary), in reading order.
KNOBS = ("cell", *CELL_KNOBS, "repeats")


RESULTS_ENV = "TESTBED_RESULTS_DIR"  # a notebook's results directory, over its default


def latest_results(study: str, start=None) -> Path:
    """The results a study's notebook reads: TESTBED_RESULTS_DIR when set, else the newest run of
    the study (by its sweep.json's last write) where the command writes it: Hydra's run directory
    outputs/<study>/<date>/<time>/, or experiments/<study>/results/ (the study's README command),
    in the first of the working directory and its parents that holds one (a notebook runs in
    analysis/notebooks/, the command in the repository)."""
    override = os.environ.get(RESULTS_ENV)
    if override:
        return Path(override)
    here = Path(start or Path.cwd()).resolve()
    for root in (here, *here.parents):
        found = [p.parent for p in root.glob(f"outputs/{study}/*/*/sweep.json")]
        found += [p.parent for p in root.glob(f"experiments/{study}/results/sweep.json")]
        if found:
            return max(found, key=lambda d: (d / "sweep.json").stat().st_mtime)
    raise FileNotFoundError(
        f"no results of {study} in outputs/{study}/ or experiments/{study}/results/ from {here} up: run "
        f"python -m testbed +experiment={study} in the repository (it writes outputs/{study}/<date>/<time>/), "
        f"or set {RESULTS_ENV} to a results directory"
    )


def is_sweep(directory) -> bool:
    return (Path(directory) / "sweep.json").is_file()


def is_run(directory) -> bool:
    return (Path(directory) / "summary.json").is_file()


def load_run(directory) -> dict:
    """One run: {"config", "meta", "summary", "requests", "steps", "kv_transfers", "telemetry"
    (None without NVML), "dir", "label"}."""
    run = read_results(directory)
    run["dir"] = Path(directory)
    run["label"] = label_of(run["config"])
    return run


def label_of(config: Mapping) -> str:
    """The configuration label the studies use: the mode, or pPdD for a disaggregated split."""
    mode = config.get("mode", "?")
    if mode == "disagg":
        cluster = config.get("cluster", {})
        return f"{cluster.get('num_prefill')}P{cluster.get('num_decode')}D"
    return mode


def served(requests: pd.DataFrame, config: Optional[Mapping] = None) -> pd.DataFrame:
    """The requests the summaries count: status ok and not warm-up (same rule as summarize), so
    a distribution drawn from them matches summary.json exactly."""
    metrics = (config or {}).get("metrics") or {}
    known = {k: metrics[k] for k in ("warmup_requests", "warmup_s") if k in metrics}
    kept = measured(requests, MetricsConfig(**known))
    return kept[kept["status"] == "ok"]


@dataclass(frozen=True)
class Sweep:
    """A study's saved sweep: the table of point summaries, the study's aggregate, and access to
    each point's own results directory."""

    dir: Path
    experiment: str
    table: pd.DataFrame
    aggregate: dict = field(default_factory=dict)

    def finished(self) -> pd.DataFrame:
        """Rows of the study's grid points that produced results (failed or interrupted ones, the
        rates a goodput search added, and emulated points that overran their pace left out)."""
        if "status" not in self.table.columns:  # kv_bandwidth: a benchmark table, no points
            return self.table
        rows = self.table[self.table["status"].isin(FINISHED)]
        if "stage" in rows.columns:
            rows = rows[rows["stage"].fillna("grid") != "search"]
        if "overrun" in rows.columns:
            rows = rows[~rows["overrun"].fillna(False).astype(bool)]
        return rows

    def searched(self) -> pd.DataFrame:
        """Every finished point a goodput study ran, its search's rates included (the attainment
        curve goes through them all); overrun emulated points left out."""
        if "status" not in self.table.columns:
            return self.table.iloc[0:0]
        rows = self.table[self.table["status"].isin(FINISHED)]
        if "overrun" in rows.columns:
            rows = rows[~rows["overrun"].fillna(False).astype(bool)]
        return rows

    def slo(self) -> dict:
        """The sweep's SLOs ({"ttft_s", "tpot_s"}) as its points' summaries recorded them."""
        columns = {k: f"slo_{k}" for k in ("ttft_s", "tpot_s")}
        rows = self.table
        return {k: float(rows[c].dropna().iloc[0]) for k, c in columns.items() if c in rows and rows[c].notna().any()}

    def cells(self) -> pd.DataFrame:
        """One row per cell (a point's repeats together): intervals.parquet, each figure with its
        `<figure>_low` / `<figure>_high` where the sweep computed one. A sweep saved without it
        (written before repeats, or interrupted before its end): the finished rows, a cell's
        repeats averaged, with no intervals."""
        path = self.dir / "intervals.parquet"
        if path.is_file():
            return pd.read_parquet(path)
        return rows_as_cells(self.finished())

    def summary(self, *figures: str) -> pd.DataFrame:
        """The cells' knobs beside the given figures, each followed by its interval's bounds where
        the sweep has them (a notebook's first table)."""
        cells = self.cells()
        wanted = [*KNOBS, *(f"{f}{side}" for f in figures for side in ("", "_low", "_high"))]
        return cells[[c for c in wanted if c in cells.columns]]

    def point_dir(self, point: str) -> Path:
        return self.dir / "points" / point

    def run(self, point: str) -> dict:
        return load_run(self.point_dir(point))

    def knobs(self, point: str) -> dict:
        row = self.table[self.table["point"] == point].iloc[0]
        return {k: row[k] for k in ("point", "cell", "label", "mode") if k in row}

    def requests(self, points: Optional[Iterable[str]] = None) -> pd.DataFrame:
        """Every request of the given (default: every finished) point, tagged point/label/mode."""
        names = list(points) if points is not None else list(self.finished()["point"])
        return load_runs([self.point_dir(p) for p in names], [self.knobs(p) for p in names])

    def itls(self, points: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
        """{point: pooled ITLs of its served requests} (what summary itl_* is computed from)."""
        names = list(points) if points is not None else list(self.finished()["point"])
        return {p: point_itls(self.point_dir(p)) for p in names}

    def ttft_buckets(self) -> pd.DataFrame:
        """TTFT per cell and input-length bucket with 95% intervals (see ttft_buckets)."""
        cells = self.cells()
        if cells.empty:
            return ttft_buckets(pd.DataFrame(columns=["cell", "label", "input_len", "ttft"]))
        finished = self.finished()
        key = "cell" if "cell" in finished.columns else "point"
        points = finished[finished[key].isin(cells["cell"])]["point"]
        requests = self.requests(points)
        if "cell" not in requests.columns:
            requests = requests.assign(cell=requests["point"])
        return ttft_buckets(requests)


def rows_as_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """Sweep rows without intervals as cells: a cell's repeats averaged (numeric columns), the
    first repeat's value of the others; one row per point where the sweep has no `cell`."""
    if rows.empty:
        return rows.assign(cell=[], repeats=[])
    rows = rows.assign(cell=rows["cell"] if "cell" in rows.columns else rows["point"])
    numeric = [c for c in rows.select_dtypes("number").columns if c not in ("repeat", "seed")]
    others = [c for c in rows.columns if c not in numeric and c not in ("cell", "repeat", "seed")]
    grouped = rows.groupby("cell", sort=False)
    cells = pd.concat([grouped[others].first(), grouped[numeric].mean(), grouped.size().rename("repeats")], axis=1)
    order = [c for c in rows.columns if c in cells.columns] + ["repeats"]
    return cells[order].reset_index()


def load_sweep(directory) -> Sweep:
    directory = Path(directory)
    body = json.loads((directory / "sweep.json").read_text())
    parquet = directory / "sweep.parquet"
    table = pd.read_parquet(parquet) if parquet.is_file() else pd.DataFrame(body.get("points", []))
    return Sweep(directory, body.get("experiment", directory.name), table, body.get("aggregate") or {})


def load_runs(
    directories: Iterable, tags: Optional[Iterable[Mapping]] = None, only_served: bool = True
) -> pd.DataFrame:
    """Per-request rows of several runs, concatenated, each tagged with point (the directory
    name unless a tag says), label, mode, and cell where the tags give one. only_served keeps
    what the summaries count."""
    directories = [Path(d) for d in directories]
    tags = list(tags) if tags is not None else [{} for _ in directories]
    frames = []
    for directory, tag in zip(directories, tags):
        run = read_results(directory)
        config, requests = run["config"], run["requests"]
        if only_served:
            requests = served(requests, config)
        cell = {"cell": tag["cell"]} if "cell" in tag else {}  # the point a repeat belongs to
        frames.append(
            requests.assign(
                point=tag.get("point", directory.name),
                label=tag.get("label", label_of(config)),
                mode=tag.get("mode", config.get("mode")),
                **cell,
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["point", "label", "mode"])


def point_itls(directory) -> np.ndarray:
    """Pooled inter-token latencies of one run's served requests."""
    run = load_run(directory)
    return pooled_itl(served(run["requests"], run["config"]))


def by_label(samples: Mapping[str, np.ndarray], table: pd.DataFrame) -> dict[str, np.ndarray]:
    """{point: values} -> {label: the values of its points pooled} (a label's repeats, or its
    points at several rates), in the table's order."""
    labels = dict(zip(table["point"], table["label"]))
    pooled: dict[str, list] = {}
    for point, values in samples.items():
        pooled.setdefault(labels[point], []).append(np.asarray(values, dtype=float))
    return {label: np.concatenate(parts) for label, parts in pooled.items()}


def ttft_buckets(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per cell and non-empty input-length bucket of served requests tagged with cell and
    label (and point: the run): cell, label, bucket, count, and p50 / p99 TTFT (s) over the cell's
    repeats pooled (testbed.metrics.latency.ttft_by_bucket, as in summary.json) with `_low` /
    `_high`: 95% intervals over the runs (testbed.metrics.uncertainty)."""
    rows = []
    for (cell, label), group in requests.groupby(["cell", "label"], sort=False):
        for bucket, figures in ttft_by_bucket(group).items():
            if not figures["count"]:
                continue
            low, high = BUCKETS[bucket]
            inside = group[(group["input_len"] >= low) & (group["input_len"] < high)]
            units = [u["ttft"].to_numpy(float) for u in request_units(inside)]
            row = {"cell": cell, "label": label, "bucket": bucket, "count": figures["count"]}
            for stat in ("p50", "p99"):
                interval = sample_interval(units, stat)
                row.update({stat: figures[stat], f"{stat}_low": interval.low, f"{stat}_high": interval.high})
            rows.append(row)
    columns = ["cell", "label", "bucket", "count", *(f"{s}{b}" for s in ("p50", "p99") for b in ("", "_low", "_high"))]
    return pd.DataFrame(rows, columns=columns)
