"""What a study computes across its points, from the sweep table and the points' request tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.metrics.comparisons import verdict
from testbed.metrics.rate_search import ABOVE, BELOW, Goodput, goodput_of
from testbed.metrics.slo import capacity
from testbed.metrics.summary import measured
from testbed.studies.repeats import goodput_interval, per_repeat

# what a goodput sweep over modes and rates (ratio_sweep, rate_sweep) is: its Study flags, once
GOODPUT_SWEEP = dict(
    searches_goodput=True, over_http=True, mergeable=True, rate_axis=True, needs_requests=True, on_vllm=True
)

# the figures of a sweep's printed table, and what the by-label aggregates tabulate
TABLE = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99", "slo_attainment", "throughput_requests_per_s"]


def finished(table: pd.DataFrame) -> pd.DataFrame:
    """The points that count: run (or found finished), and paced at the emulated device's speed
    (a point whose CPU could not keep the modelled pace is kept in the table, out of every verdict)."""
    if not len(table):
        return table
    done = table["status"].isin(["ok", "skipped"])
    if "overrun" in table.columns:
        done &= ~table["overrun"].fillna(False).astype(bool)
    return table[done]


def on_grid(table: pd.DataFrame) -> pd.DataFrame:
    """The study's own grid, without the rates a goodput search added (figures keep the grid)."""
    return table[table["stage"].fillna("grid") != "search"] if "stage" in table.columns else table


def point_requests(out_dir: Path, point: str, cfg: Config) -> pd.DataFrame:
    """A point's requests without its warm-up: the same filter as its summary.json."""
    return measured(pd.read_parquet(out_dir / "points" / point / "requests.parquet"), cfg.metrics)


def cells(out_dir: Path) -> pd.DataFrame:
    """The sweep's cells (a point's repeats together) with their intervals: intervals.parquet."""
    path = out_dir / "intervals.parquet"
    frame = pd.read_parquet(path) if path.is_file() else pd.DataFrame()
    # no cell (every point failed): no rows, but the columns aggregates group and select by
    return frame if len(frame.columns) else pd.DataFrame(columns=["cell", "label", "executor", "rate"])


def requests_counted(rows: pd.DataFrame):
    """Each point's requests that count for attainment (the fit's weights), or None."""
    if "num_requests_total" not in rows.columns:
        return None
    rejected = rows["num_requests_rejected"] if "num_requests_rejected" in rows.columns else 0
    return (rows["num_requests_total"] - rejected).tolist()


def goodput_by_label(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict:
    """Per configuration: goodput (90% attainment, DistServe) in total and per GPU, and capacity
    (p99 ITL under slo.tpot_s, Sarathi-Serve), over every rate a repeat tried (its grid and its
    search); one value per repeat, a bound where censored, their mean and 95% interval."""
    out = {}
    for label, group in finished(table).groupby("label"):
        gpus = int(group["num_gpus"].iloc[0])
        totals, capacities = {}, []
        for rows in per_repeat(group):
            seed = int(rows["seed"].iloc[0]) if "seed" in rows.columns else len(totals)
            totals[seed] = goodput_of(rows["rate"], rows["slo_attainment"], weights=requests_counted(rows))
            capacities.append(capacity_of(rows["rate"], rows["itl_p99"], cfg.slo.tpot_s))
        highest = float(group["rate"].max())
        total = goodput_interval(list(totals.values()), highest)
        cap = goodput_interval(capacities, highest)
        cap_censored = {c.censored for c in capacities if c.censored}
        per_gpu = goodput_interval([per_device(g, gpus) for g in totals.values()], highest / gpus)
        curve = on_grid(group).groupby("rate")["slo_attainment"].mean()
        out[label] = {
            "goodput": total["mean"],
            "goodput_low": total["low"],
            "goodput_high": total["high"],
            "goodput_censored": total["censored"],
            "goodput_error": total["error"],
            "goodput_per_gpu": per_gpu["mean"],
            "goodput_per_gpu_low": per_gpu["low"],
            "goodput_per_gpu_high": per_gpu["high"],
            "goodput_per_repeat": total["values"],
            "censoring_per_repeat": total["censoring"],
            "error_per_repeat": total["errors"],
            "goodput_per_gpu_error": per_gpu["error"],
            "monotone_per_repeat": total["monotone"],
            "seeds": list(totals),
            "num_gpus": gpus,
            "repeats": len(totals),
            # the mean of capacity()'s values (0.0 where no rate passes); a bound where censored
            "capacity": float(np.mean([0.0 if c.censored == BELOW else c.value for c in capacities])),
            "capacity_low": cap["low"],
            "capacity_high": cap["high"],
            "capacity_censored": "both" if len(cap_censored) > 1 else "".join(cap_censored),
            "capacity_bound": cap["mean"],  # the mean with a repeat that no rate passed at its lowest rate
            "rates_tried": int(group["rate"].nunique()),
            "rates": curve.index.tolist(),
            "attainment": curve.tolist(),
        }
    return out


def capacity_of(rates, p99_itl, itl_slo: float) -> Goodput:
    """One repeat's capacity (metrics.slo.capacity), a bound where the rates tried do not bracket
    it: above when the highest rate keeps p99 ITL under the SLO, below (the lowest rate) when none does."""
    rates, p99_itl = np.asarray(rates, dtype=np.float64), np.asarray(p99_itl, dtype=np.float64)
    if not (p99_itl <= itl_slo).any():  # NaN fails
        return Goodput(float(rates.min()), BELOW)
    value = capacity(rates, p99_itl, itl_slo)
    return Goodput(value, ABOVE if value >= rates.max() else "")


def per_device(g: Goodput, gpus: int) -> Goodput:
    return Goodput(g.value / gpus, g.censored, g.error / gpus)


def per_seed(goodputs: dict) -> dict[str, dict[int, Goodput]]:
    """{label: {seed: goodput per GPU}} from goodput_by_label's output (paired comparisons)."""
    out = {}
    for label, g in goodputs.items():
        gpus = g["num_gpus"]
        n = len(g["goodput_per_repeat"])
        values = zip(
            g.get("seeds", range(n)),
            g["goodput_per_repeat"],
            g.get("censoring_per_repeat", [""] * n),
            g.get("error_per_repeat", [0.0] * n),
        )  # a sweep.json written before errors were kept
        # each repeat keeps its search error: the paired verdict is widened by both sides' errors
        out[label] = {int(s): Goodput(v / gpus, c, e / gpus) for s, v, c, e in values}
    return out


def best_of(goodputs: dict) -> dict:
    """The leader by mean goodput per GPU, `separated` only when its paired per-seed lead over
    every other configuration excludes zero; `line` says which (metrics/comparisons.py)."""
    if not goodputs:
        return {}
    chosen = verdict(per_seed(goodputs))
    return {**chosen, "goodput_per_gpu": goodputs[chosen["label"]]["goodput_per_gpu"] if chosen["label"] else None}


def goodput_study(table, cfg, out_dir) -> dict:
    """ratio_sweep and rate_sweep: goodput per configuration and the paired verdict (none named
    from points that ran on a contended host)."""
    goodputs = goodput_by_label(table, cfg, out_dir)
    best = refused_on_contention(best_of(goodputs), table)
    return {"goodput": goodputs, "best": best, "repeats": cfg.experiment.repeats}


def contended(table: pd.DataFrame) -> pd.DataFrame:
    """The points that count but ran on a contended host (summary.json's host.contended)."""
    rows = finished(table)
    if "host_contended" not in rows.columns:
        return rows.iloc[0:0]
    return rows[rows["host_contended"].fillna(0).astype(bool)]


def refused_on_contention(best: dict, table: pd.DataFrame) -> dict:
    """The verdict, or where points that ran on a contended host took part, no winner: their
    figures measure the host's other work as much as the configurations (the paired comparisons
    stay, under `comparisons`; `contended_points` names the points)."""
    hit = contended(table)
    if not best or hit.empty:
        return best
    worst = float(hit["host_stretch"].max()) if "host_stretch" in hit.columns else float("nan")
    threshold = float(hit["host_threshold"].iloc[0]) if "host_threshold" in hit.columns else float("nan")
    line = (
        f"no winner named: {len(hit)} of {len(finished(table))} points ran on a contended host (waiting for a "
        f"core stretched their processes' CPU time up to x{worst:.2f}, over metrics.contended_stretch={threshold:g}); "
        f"rerun on a quiet host. On these points: {best['line']}"
    )
    return {**best, "separated": False, "line": line, "contended_points": list(hit["point"])}


def point_steps(out_dir: Path, point: str) -> pd.DataFrame:
    """A point's steps.parquet (empty where its engine's steps were not measured)."""
    steps = out_dir / "points" / point / "steps.parquet"
    return pd.read_parquet(steps) if steps.is_file() else pd.DataFrame()


def cell_requests(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict[str, pd.DataFrame]:
    """{cell: the requests of its finished repeats, pooled, each tagged with its point}."""
    return {
        cell: pd.concat([point_requests(out_dir, p, cfg).assign(point=p) for p in points], ignore_index=True)
        for cell, points in cell_points(table).items()
    }


def cell_points(table: pd.DataFrame) -> dict[str, list[str]]:
    """{cell: its finished repeats' points}."""
    rows = finished(table)
    key = "cell" if "cell" in rows.columns else "point"
    return {cell: list(group["point"]) for cell, group in rows.groupby(key, sort=False)}


def by_label(columns: list[str]) -> callable:
    """An aggregate that tabulates a few figures per cell, with their intervals where the cell
    table has them (mode_compare, chunk_sweep, input_buckets)."""

    def aggregate(table, cfg, out_dir) -> dict:
        rows = cells(out_dir)
        if rows.empty:
            return {"points": {}}
        keep = [c for c in columns if c in rows.columns]
        keep += [f"{c}_{b}" for c in keep for b in ("low", "high") if f"{c}_{b}" in rows.columns]
        return {"points": rows.set_index("cell")[keep].to_dict(orient="index")}

    return aggregate
