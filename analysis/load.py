"""Saved results -> tidy DataFrames. Nothing here reruns anything: it reads the results contract
(DESIGN.md) of single runs and the sweep layout of studies:

    <sweep>/sweep.parquet, sweep.json ("experiment", "points", "aggregate")
    <sweep>/points/<point>/   one run's results directory
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np
import pandas as pd

from testbed.metrics.config import MetricsConfig
from testbed.metrics.latency import pooled_itl
from testbed.metrics.summary import measured
from testbed.tracking.results import read_results

FINISHED = ("ok", "skipped")  # a resumed sweep marks points it did not rerun as "skipped"


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
        """Rows of points that produced results (failed or interrupted ones left out)."""
        if "status" not in self.table.columns:  # kv_bandwidth: a benchmark table, no points
            return self.table
        return self.table[self.table["status"].isin(FINISHED)]

    def point_dir(self, point: str) -> Path:
        return self.dir / "points" / point

    def run(self, point: str) -> dict:
        return load_run(self.point_dir(point))

    def knobs(self, point: str) -> dict:
        row = self.table[self.table["point"] == point].iloc[0]
        return {k: row[k] for k in ("point", "label", "mode") if k in row}

    def requests(self, points: Optional[Iterable[str]] = None) -> pd.DataFrame:
        """Every request of the given (default: every finished) point, tagged point/label/mode."""
        names = list(points) if points is not None else list(self.finished()["point"])
        return load_runs([self.point_dir(p) for p in names], [self.knobs(p) for p in names])

    def itls(self, points: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
        """{point: pooled ITLs of its served requests} (what summary itl_* is computed from)."""
        names = list(points) if points is not None else list(self.finished()["point"])
        return {p: point_itls(self.point_dir(p)) for p in names}


def load_sweep(directory) -> Sweep:
    directory = Path(directory)
    body = json.loads((directory / "sweep.json").read_text())
    parquet = directory / "sweep.parquet"
    table = pd.read_parquet(parquet) if parquet.is_file() else pd.DataFrame(body.get("points", []))
    return Sweep(directory, body.get("experiment", directory.name), table, body.get("aggregate") or {})


def load_runs(directories: Iterable, tags: Optional[Iterable[Mapping]] = None,
              only_served: bool = True) -> pd.DataFrame:
    """Per-request rows of several runs, concatenated, each tagged with point (the directory
    name unless a tag says), label and mode. only_served keeps what the summaries count."""
    directories = [Path(d) for d in directories]
    tags = list(tags) if tags is not None else [{} for _ in directories]
    frames = []
    for directory, tag in zip(directories, tags):
        run = read_results(directory)
        config, requests = run["config"], run["requests"]
        if only_served:
            requests = served(requests, config)
        frames.append(requests.assign(point=tag.get("point", directory.name),
                                      label=tag.get("label", label_of(config)),
                                      mode=tag.get("mode", config.get("mode"))))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["point", "label", "mode"])


def point_itls(directory) -> np.ndarray:
    """Pooled inter-token latencies of one run's served requests."""
    run = load_run(directory)
    return pooled_itl(served(run["requests"], run["config"]))


def by_label(samples: Mapping[str, np.ndarray], table: pd.DataFrame) -> dict[str, np.ndarray]:
    """{point: values} -> {label: values} for a table with one point per label (mode_compare)."""
    labels = dict(zip(table["point"], table["label"]))
    return {labels[p]: v for p, v in samples.items()}
