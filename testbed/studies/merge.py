"""Draw another engine's run beside a study's own configurations.

`add_point(sweep_dir, run, label=...)` imports a run (a vLLM or SGLang result file, or a testbed
results directory) as one more point of a saved study sweep, `points/<label>` (rate studies:
`points/<label>_rate<R>`), appends its row to sweep.parquet / sweep.json with the same flattened
summary columns as the sweep's own points, recomputes intervals.parquet and the study's
aggregate with the runner's own functions, and redraws the study's figures: in rate_sweep and
ratio_sweep the label is one more line (and goodput bar), in mode_compare one more bar and CDF.
Its summary is recomputed under the sweep's SLOs and warm-up rule, so every figure compares like
with like. Adding the same label (and rate) again replaces that point.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Optional

import pandas as pd

from testbed.config import Config, config_from_dict, upgraded
from testbed.interop.exchange import import_run
from testbed.interop.table import InteropError
from testbed.metrics.results_dir import read_config, write_parquet
from testbed.metrics.slo import tenant_slos
from testbed.studies.aggregates import finished
from testbed.studies.catalog import BY_NAME, STUDIES
from testbed.studies.figures import study_figures
from testbed.studies.runner import cell_table
from testbed.studies.study import Study
from testbed.studies.sweep import EXTERNAL, Sweep, flatten

# Studies whose aggregate groups points by label alone (Study.mergeable); the others need knobs
# (chunk, burstiness, prefill length, hand-off) or engine steps an outside run does not have.
MERGEABLE = tuple(s.name for s in STUDIES if s.mergeable)


def add_point(
    sweep_dir,
    run,
    *,
    label: str,
    knobs: Optional[dict] = None,
    fmt: Optional[str] = None,
    trace=None,
    slowdown: float = 1.0,
    run_index: int = -1,
    figures: bool = True,
) -> dict:
    """Add `run` to the sweep in sweep_dir as label's point. knobs: `rate` (needed by rate
    studies when the run does not say it), `num_gpus` (default 1: per-GPU goodput divides by
    it) and any other column to show. Returns {"point", "dir", "row", "aggregate", "figures"}."""
    sweep_dir, knobs = Path(sweep_dir), dict(knobs or {})
    name, table = load_table(sweep_dir)
    if name not in MERGEABLE:
        raise InteropError(
            f"{sweep_dir}: study {name!r} cannot draw an outside run; add works for {', '.join(MERGEABLE)}"
        )
    _check_label(table, label)
    cfg = sweep_config(sweep_dir, table)
    num_gpus = int(knobs.pop("num_gpus", 1))
    stage = sweep_dir / "points" / f".adding-{slug(label)}"
    shutil.rmtree(stage, ignore_errors=True)
    try:  # into a hidden directory first: a failed import leaves the sweep as it was
        imported = import_run(
            run,
            stage,
            fmt=fmt,
            slo=cfg.slo,
            metrics=cfg.metrics,
            num_gpus=num_gpus,
            label=label,
            run=run_index,
            trace=trace,
            slowdown=slowdown,
            tenants=tenant_slos(cfg.workload.tenants, cfg.slo),
        )
        rate = float(knobs.pop("rate", imported["rate"]))
        point = _point_name(BY_NAME[name], label, rate, imported["rate"], table, run)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(sweep_dir / "points" / point, ignore_errors=True)  # this label's earlier import
    stage.rename(sweep_dir / "points" / point)
    row = {
        "point": point,
        "label": label,
        "mode": EXTERNAL,
        "rate": rate,
        "num_gpus": num_gpus,
        "error": "",
        "cell": point,
        "repeat": 0,
        "seed": cfg.seed,
        **knobs,
        "status": "ok",
        **flatten(imported["summary"]),
    }
    table = pd.concat([table[table["point"] != point], pd.DataFrame([row])], ignore_index=True)
    aggregate = rewrite(sweep_dir, name, table, cfg)
    drawn = []
    if figures:
        drawn = study_figures(name, sweep_dir)
    return {"point": point, "dir": sweep_dir / "points" / point, "row": row, "aggregate": aggregate, "figures": drawn}


def _point_name(study: Study, label: str, rate: float, recorded, table: pd.DataFrame, run) -> str:
    """points/<label> (rate studies: <label>_rate<R>, as the runner names its points); never one
    of the sweep's own points."""
    if study.rate_axis and not (math.isfinite(rate) and rate > 0):
        raise InteropError(
            f"{run}: its request rate is not known (request_rate={recorded}); {study.name} needs "
            f"the rate it was offered: pass --rate R"
        )
    point = f"{slug(label)}_rate{rate:g}" if study.rate_axis else slug(label)
    own = table[table["mode"] != EXTERNAL] if "mode" in table.columns else table
    if point in set(own["point"]):
        raise InteropError(f"--label {label!r}: its point {point!r} is one of the sweep's own; choose another label")
    return point


def load_table(sweep_dir: Path) -> tuple[str, pd.DataFrame]:
    """(the study's name, its sweep table) of a saved sweep."""
    body_path, parquet = sweep_dir / "sweep.json", sweep_dir / "sweep.parquet"
    if not body_path.is_file():
        raise InteropError(f"{sweep_dir}: not a study sweep (no sweep.json)")
    body = json.loads(body_path.read_text())
    table = pd.read_parquet(parquet) if parquet.is_file() else pd.DataFrame(body.get("points", []))
    if table.empty or "point" not in table.columns:
        raise InteropError(f"{sweep_dir}: the sweep has no points to draw beside")
    return body.get("experiment", ""), table


def sweep_config(sweep_dir: Path, table: pd.DataFrame) -> Config:
    """The sweep's configuration (SLOs, warm-up, seed, study settings), from its first finished
    point of repeat 0: a point's config is the sweep's with that point's overrides."""
    rows = finished(table)
    rows = rows[rows["mode"] != EXTERNAL] if "mode" in rows.columns else rows
    if "repeat" in rows.columns:
        rows = rows.sort_values("repeat", kind="stable")
    for point in rows["point"]:
        path = sweep_dir / "points" / str(point) / "config.yaml"
        if path.is_file():
            return config_from_dict(upgraded(read_config(path)))
    raise InteropError(f"{sweep_dir}: no finished point of the sweep has a config.yaml to take its SLOs from")


# a summary-only point's cell carries the file's own figures (no interval: the requests are not there)
SUMMARY_FIGURES = [
    f"{m}_{p}" for m in ("ttft", "tpot", "itl", "e2e") for p in ("mean", "p50", "p90", "p95", "p99", "max")
]


def summary_only(table: pd.DataFrame) -> pd.Series:
    """Rows of points imported from result files without per-request lists (testbed/interop/summary.py)."""
    if "summary_only" not in table.columns:
        return pd.Series(False, index=table.index)
    return table["summary_only"].fillna(0).astype(float) > 0


def rewrite(sweep_dir: Path, name: str, table: pd.DataFrame, cfg: Config) -> dict:
    """intervals.parquet, the aggregate and sweep.parquet / sweep.json, as the runner writes them.
    Summary-only points keep their own figures in their cells and stay out of aggregates that need
    SLO attainment or requests (Study.needs_requests; the aggregate's `left_out` names them)."""
    study, only = BY_NAME[name], summary_only(table)
    write_parquet(sweep_dir / "intervals.parquet", _summary_cells(cell_table(table, cfg, sweep_dir), table[only]))
    aggregated = table[~only] if study.needs_requests else table
    aggregate = study.aggregate(aggregated, cfg, sweep_dir)
    if only.any() and study.needs_requests:
        aggregate = {
            **aggregate,
            "left_out": {
                "points": sorted(table.loc[only, "point"]),
                "why": "summary-only imports (result files without per-request lists): no SLO attainment, goodput or "
                "interval without the requests; their latency and throughput figures are in the table",
            },
        }
    writer = Sweep(cfg, [], sweep_dir, None, None)
    writer.name, writer.size = name, _saved_size(sweep_dir, writer.size)
    writer.rows = table.to_dict(orient="records")
    writer.write(aggregate)
    return aggregate


def _summary_cells(cells: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Each summary-only point's cell with the file's own figures (the cell table computes them
    from requests, which such a point does not have), their intervals left empty."""
    if rows.empty or cells.empty or "cell" not in cells.columns:
        return cells
    cells = cells.copy()
    for _, row in rows.iterrows():
        at = cells["cell"] == row.get("cell", row["point"])
        for figure in [*SUMMARY_FIGURES, "throughput_requests_per_s", "throughput_output_tokens_per_s"]:
            if figure in row and figure in cells.columns:
                cells.loc[at, figure] = row[figure]
            if f"{figure}_note" in cells.columns:
                cells.loc[at, f"{figure}_note"] = "summary only: the file's own figure, no interval"
    return cells


def _saved_size(sweep_dir: Path, default: str) -> str:
    path = sweep_dir / "sweep.json"
    return json.loads(path.read_text()).get("size") or default if path.is_file() else default


def _check_label(table: pd.DataFrame, label: str) -> None:
    if not label or not label.strip():
        raise InteropError("--label: give the outside run a name (e.g. vllm or sglang-0.5)")
    own = table[table["mode"] != EXTERNAL] if "mode" in table.columns else table
    if label in set(own.get("label", pd.Series(dtype=object))):
        labels = ", ".join(sorted(map(str, set(own["label"]))))
        raise InteropError(f"--label {label!r} is one of the sweep's own configurations ({labels}); choose another")


def slug(label: str) -> str:
    """The label as a directory name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label.strip()).strip("._") or "external"
