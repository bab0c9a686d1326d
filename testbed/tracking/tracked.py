"""What a tracker is handed, built from the results: a flattened summary, sampled tables, history
rows charted against the request rate or the run's clock, and the files of a results artifact.
Pure functions over the tables (no wandb), so they are tested without it."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd

TABLE_SAMPLE_SEED = 0  # the same rows every time a table is logged
# What the sweep's run charts against the request rate, one key per configuration (label).
RATE_CHARTS = ("slo_attainment", "goodput_requests_per_s", "throughput_requests_per_s", "ttft_p99", "tpot_p99")


def flatten_summary(summary: dict, prefix: str = "") -> dict[str, Any]:
    """{"ttft": {"p99": 1.0}, "n": 3, "x": None} -> {"ttft/p99": 1.0, "n": 3}; None values dropped."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_summary(value, prefix=f"{name}/"))
        elif value is not None:
            flat[name] = value
    return flat


def table_sample(df: pd.DataFrame, max_rows: int) -> pd.DataFrame:
    """At most max_rows rows (a seeded sample, in the original order), without list-valued
    columns: W&B tables cannot chart lists, and the parquet files keep them anyway."""
    if len(df) > max_rows:
        df = df.sample(n=max_rows, random_state=TABLE_SAMPLE_SEED).sort_index()
    keep = [c for c in df.columns if not _holds_sequences(df[c])]
    table = df[keep].reset_index(drop=True).astype(object)
    return table.where(table.notna(), None)  # pandas' NA (nullable ints) is not JSON: W&B wants None


def _holds_sequences(column: pd.Series) -> bool:
    if column.dtype != object:
        return False
    return any(isinstance(v, (list, tuple, np.ndarray)) for v in column.dropna())


def series_rows(name: str, df: pd.DataFrame, time: str, by: str, max_rows: int) -> list[dict]:
    """One history row per sample, {"<name>/<time>": t, "<name>/<by><k>/<column>": v, ...}, in time
    order: numeric columns only, NaN readings left out (a gap in the chart, not a zero). Beyond
    max_rows rows, every k-th sample of each `by` value (each GPU keeps its whole time span)."""
    every = max(1, math.ceil(len(df) / max_rows))
    df = df[df.groupby(by).cumcount() % every == 0].sort_values(time, kind="stable")
    columns = [c for c in df.select_dtypes("number").columns if c not in (time, by)]
    rows = []
    for record in df.to_dict("records"):
        prefix = f"{name}/{by}{record[by]}/"
        values = {f"{prefix}{c}": float(record[c]) for c in columns if pd.notna(record[c])}
        rows.append({f"{name}/{time}": float(record[time]), **values})
    return rows


def rate_history(table: pd.DataFrame) -> list[dict]:
    """One row per finished point of a sweep table, {"rate": r, "<metric>/<label>": v}, sorted by
    label then rate: with rate as their step metric, W&B draws each configuration's attainment,
    goodput, ... against the request rate. Empty when the sweep has no rate column."""
    if table.empty or not {"rate", "status"} <= set(table.columns):
        return []
    rate = pd.to_numeric(table["rate"], errors="coerce")
    done = table[table["status"].isin(["ok", "skipped"]) & np.isfinite(rate)]
    done = done.assign(
        label=done["label"] if "label" in done else done["point"], goodput_requests_per_s=point_goodput(done)
    ).sort_values(["label", "rate"], kind="stable")
    rows = []
    for row in done.to_dict("records"):
        values = {f"{m}/{row['label']}": float(row[m]) for m in RATE_CHARTS if _finite(row.get(m))}
        rows.append({"rate": float(row["rate"]), **values})
    return rows


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def point_goodput(table: pd.DataFrame) -> pd.Series:
    """Requests meeting their SLOs per second (vLLM's request_goodput): attainment times the
    requests it counts (all but the overlength filter's), over the point's throughput span."""
    needed = ("slo_attainment", "num_requests_total", "num_requests_rejected", "throughput_duration_s")
    if any(c not in table for c in needed):
        return pd.Series(np.nan, index=table.index)
    served = table["num_requests_total"] - table["num_requests_rejected"]
    return table["slo_attainment"] * served / table["throughput_duration_s"].where(table["throughput_duration_s"] > 0)


def files_under(root: Path, exclude: tuple[str, ...]) -> Iterator[Path]:
    """Every file under root except logs (Hydra's is still being written), Hydra's own record
    (.hydra/ holds the command line as typed, secrets included: config.yaml has them masked) and
    what lies under its top-level entries named in exclude (W&B's own run folders; a sweep's
    points/, each point having its own artifact)."""
    for top in sorted(Path(root).iterdir()):
        if top.name in exclude or top.name == ".hydra":
            continue
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        yield from (p for p in files if p.suffix != ".log")


def roles_by_file(profiles: Mapping[str, Path]) -> dict[Path, list[str]]:
    """{file: the roles that ran on it}: P and D on one profile log it once."""
    out: dict[Path, list[str]] = {}
    for role, path in sorted(profiles.items()):
        out.setdefault(Path(path), []).append(role)
    return out


def artifact_name(name: str) -> str:
    """W&B artifact names allow letters, digits, '-', '_' and '.' only, 128 at most."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:128]


def profile_files(cfg, roles) -> dict[str, Path]:
    """{role: the profile file it was simulated on} (SimConfig.profile_file: a GPU of the analytical
    table or an in-situ run:<dir> has none; the point's summary["sim"]["profiles"] labels say what it was)."""
    files = {role: cfg.sim.profile_file(role, cfg.model.name) for role in roles}
    return {role: path for role, path in files.items() if path is not None}
