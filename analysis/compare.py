"""python -m analysis compare RUN_A RUN_B: how run B differs from run A, per configuration.

Each of RUN_A and RUN_B is a study's directory (sweep.json, points/<point>/) or one run's
(summary.json). Configurations are matched by their key: a study's cell (its point without the
repeat suffix, `chunked_rate20` for `chunked_rate20_r1`), a single run's label (`chunked`, `1P1D`),
and a goodput study's configuration label for goodput per GPU. For each figure, B - A is:

- paired: the mean over the seeds both runs ran of the per-seed difference, with Student's t
  over those seeds (common random numbers: seed s gives both runs the same arrivals and lengths,
  so the workload's variation cancels), where two or more seeds are shared;
- otherwise the difference of the two runs' estimates, its interval combined from the two runs'
  own intervals as independent (MOVER: Zou and Donner 2008; a side's interval is its cell's
  interval over the runs, or over batches of one run, see docs/statistics.md).

What each run was is printed beside it: the code version (meta.json's git commit, `+dirty` with
uncommitted changes), the host, and its load (the points' `host_load_1m`). The comparison is
written to `<out>/compare.json` and drawn in `<out>/compare.pdf|png` (differences with their
intervals, one panel per figure).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from analysis.load import FINISHED, is_run, is_sweep, label_of, load_sweep
from testbed.metrics.comparisons import paired
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.rate_search import ABOVE, BELOW, Goodput
from testbed.metrics.results_dir import ResultsError, read_results
from testbed.metrics.slo import tenant_slos
from testbed.metrics.summary import measured
from testbed.metrics.uncertainty import ONE_RUN, Interval, mean_interval, point_intervals
from testbed.studies.report import is_latency, title
from testbed.studies.sweep import flatten

FIGURES = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99", "slo_attainment", "throughput_requests_per_s")
GOODPUT = "goodput_per_gpu"
PAIRED, INTERVALS, NONE = "paired", "intervals", "no interval"


@dataclass
class Side:
    """One run as the comparison reads it: one row per run of a configuration (key, seed, figures),
    each key's interval per figure where the results have one, goodput per GPU per label and seed."""

    dir: Path
    experiment: str
    rows: pd.DataFrame
    intervals: dict = field(default_factory=dict)  # {(key, figure): Interval}
    goodput: dict = field(default_factory=dict)  # {label: {seed: Goodput per GPU}}
    goodput_intervals: dict = field(default_factory=dict)  # {label: Interval}, censored ones left out
    versions: list = field(default_factory=list)  # "commit[+dirty]" of its runs, each once
    host: dict = field(default_factory=dict)

    def describe(self) -> str:
        load = self.host.get("load_1m")
        where = f"host {self.host.get('hostname', '?')} ({self.host.get('cpu_count', '?')} CPUs)"
        state = (
            f"load 1m {load['mean']:.2f} (range {load['min']:.2f}-{load['max']:.2f} over {load['points']} points)"
            if load
            else "load not recorded"
        )
        contended = self.host.get("contended")
        if contended and contended["points"]:
            worst = f"stretch up to x{contended['stretch_max']:.2f}"
            state += f"; CONTENDED: {contended['points']} of {contended['of']} points ({worst})"
        elif contended:
            state += "; not contended"
        seeds = sorted({int(s) for s in self.rows["seed"]}) if len(self.rows) else []
        return (
            f"{self.dir} ({self.experiment}; code {', '.join(self.versions) or 'unrecorded'}; {where}, {state}; "
            f"seeds {', '.join(map(str, seeds)) or '-'})"
        )


def version_of(meta: dict) -> str:
    commit = meta.get("git_commit") or "unknown"
    return f"{commit[:10]}{'+dirty' if meta.get('git_dirty') else ''}"


def load_side(directory) -> Side:
    directory = Path(directory)
    if is_sweep(directory):
        return sweep_side(directory)
    if is_run(directory):
        return run_side(directory)
    raise ResultsError(f"{directory} is neither a study's directory (sweep.json) nor a run's (summary.json)")


def sweep_side(directory: Path) -> Side:
    sweep = load_sweep(directory)
    rows = sweep.finished()  # the grid's points; a goodput search's rates differ per run
    if "status" not in sweep.table.columns:
        raise ResultsError(f"{directory}: a benchmark table ({sweep.experiment}), not a sweep of points")
    key = rows["cell"] if "cell" in rows.columns else rows["point"]
    seed = rows["seed"] if "seed" in rows.columns else pd.Series(0, index=rows.index)
    table = pd.DataFrame({"key": key, "seed": seed.astype(int), "point": rows["point"]})
    for figure in FIGURES:
        table[figure] = rows[figure] if figure in rows.columns else math.nan
    metas = [json.loads(p.read_text()) for p in (directory / "points" / name / "meta.json" for name in rows["point"])
             if p.is_file()]  # fmt: skip
    side = Side(directory, sweep.experiment, table.reset_index(drop=True), versions=versions(metas))
    side.host = host_of(metas, sweep.table[sweep.table["status"].isin(FINISHED)])
    cells = sweep.cells()
    for row in cells.to_dict(orient="records"):
        for figure in FIGURES:
            if f"{figure}_low" in row:
                low, high, note = row[f"{figure}_low"], row[f"{figure}_high"], row.get(f"{figure}_note")
                estimate = _num(row[figure])
                side.intervals[(row["cell"], figure)] = Interval(estimate, _num(low), _num(high), note=note or "")
    for label, g in (sweep.aggregate.get("goodput") or {}).items():
        gpus, n = g.get("num_gpus", 1), len(g.get("goodput_per_repeat", []))
        seeds, censoring = g.get("seeds", range(n)), g.get("censoring_per_repeat", [""] * n)
        errors = g.get("error_per_repeat", [0.0] * n)
        side.goodput[label] = {
            int(s): Goodput(v / gpus, c, e / gpus)
            for s, v, c, e in zip(seeds, g.get("goodput_per_repeat", []), censoring, errors)
        }
        if not g.get("goodput_censored"):
            low, high = g.get("goodput_per_gpu_low", math.nan), g.get("goodput_per_gpu_high", math.nan)
            side.goodput_intervals[label] = Interval(g["goodput_per_gpu"], _num(low), _num(high))
    return side


def run_side(directory: Path) -> Side:
    run = read_results(directory)
    config, meta = run["config"], run["meta"]
    key = label_of(config)
    flat = flatten(run["summary"])
    seed = int(meta.get("seed", config.get("seed", 0)) or 0)
    table = pd.DataFrame([{"key": key, "seed": seed, "point": directory.name, **{f: flat.get(f) for f in FIGURES}}])
    side = Side(directory, "serve", table, versions=versions([meta]), host=host_of([meta], None))
    slo = SLOConfig(**{k: v for k, v in (config.get("slo") or {}).items() if k in ("ttft_s", "tpot_s")})
    tenants = (config.get("workload") or {}).get("tenants") or []
    metrics = config.get("metrics") or {}
    warmup = MetricsConfig(**{k: metrics[k] for k in ("warmup_requests", "warmup_s") if k in metrics})
    requests = measured(run["requests"], warmup)
    if len(requests):  # a single run's intervals: over batches of its requests, as a one-repeat cell's
        named = tenant_slos([SimpleNamespace(**t) for t in tenants], slo)
        for figure, interval in point_intervals(requests, slo, named).items():
            side.intervals[(key, figure)] = interval
    return side


def versions(metas: list[dict]) -> list[str]:
    return list(dict.fromkeys(version_of(m) for m in metas))


def host_of(metas: list[dict], rows: pd.DataFrame | None) -> dict:
    host = {}
    if metas:
        host = {"hostname": metas[0].get("hostname", "?"), "cpu_count": metas[0].get("cpu_count", "?")}
    if rows is not None and "host_load_1m" in rows.columns:
        load = rows[[c for c in ("host_load_1m", "host_load_1m_end") if c in rows.columns]].to_numpy(float).ravel()
        load = load[~np.isnan(load)]
        if load.size:
            host["load_1m"] = {"mean": float(load.mean()), "min": float(load.min()), "max": float(load.max()),
                               "points": int(len(rows))}  # fmt: skip
    if rows is not None and "host_contended" in rows.columns:
        flags = rows["host_contended"].dropna().astype(bool)
        stretch = rows.loc[flags[flags].index, "host_stretch"] if "host_stretch" in rows.columns else pd.Series([])
        host["contended"] = {"points": int(flags.sum()), "of": int(len(flags)), "stretch_max": _num(stretch.max())}
    return host


def _num(x) -> float:
    return math.nan if x is None else float(x)


# -- the differences -------------------------------------------------------------------------------
def difference_of_intervals(a: Interval, b: Interval) -> Interval:
    """b - a from two independent intervals (MOVER): each side of the difference's interval adds
    the two sides' distances to their bounds in quadrature."""
    d = b.estimate - a.estimate
    if not (a.known and b.known):
        return Interval(d)
    low = d - math.hypot(b.estimate - b.low, a.high - a.estimate)
    high = d + math.hypot(b.high - b.estimate, a.estimate - a.low)
    return Interval(d, low, high)


def side_estimate(side: Side, key: str, figure: str) -> Interval:
    """A side's figure for a key: its cell's interval where it has one, else the mean over its
    repeats with Student's t (an interval from two repeats on)."""
    if (key, figure) in side.intervals:
        return side.intervals[(key, figure)]
    values = side.rows.loc[side.rows["key"] == key, figure].to_numpy(float)
    values = values[~np.isnan(values)]
    if values.size > 1:
        return mean_interval(values)
    return Interval(float(values[0]) if values.size else math.nan)


def per_seed(side: Side, key: str, figure: str) -> dict[int, float]:
    rows = side.rows[side.rows["key"] == key]
    return {int(s): float(v) for s, v in zip(rows["seed"], rows[figure]) if v is not None and v == v}


def compare_figure(a: Side, b: Side, key: str, figure: str) -> dict:
    va, vb = per_seed(a, key, figure), per_seed(b, key, figure)
    shared = sorted(set(va) & set(vb))
    if len(shared) >= 2:  # A and B as the means over the shared seeds, whose difference is B - A
        diff = mean_interval([vb[s] - va[s] for s in shared])
        mean_a, mean_b = (float(np.mean([v[s] for s in shared])) for v in (va, vb))
        return row_of(key, figure, mean_a, mean_b, diff, PAIRED, len(shared))
    ea, eb = side_estimate(a, key, figure), side_estimate(b, key, figure)
    diff = difference_of_intervals(ea, eb)
    method = INTERVALS if diff.known else NONE
    if diff.known and any(e.note.startswith(ONE_RUN) for e in (ea, eb)):
        method = f"{INTERVALS} ({ONE_RUN})"  # over batches of a run's requests, not over runs: narrower
    return row_of(key, figure, ea.estimate, eb.estimate, diff, method, len(shared))


def compare_goodput(a: Side, b: Side, label: str) -> dict:
    ga, gb = a.goodput[label], b.goodput[label]
    shared = sorted(set(ga) & set(gb))
    over = shared if len(shared) >= 2 else None  # paired: both means over the shared seeds
    mean_a, mean_b = (float(np.mean([g.value for s, g in v.items() if over is None or s in over])) for v in (ga, gb))
    censored = any(g.censored for g in (*ga.values(), *gb.values()))
    if len(shared) >= 2:
        diff, _, _ = paired(gb, ga)  # widened by both sides' search errors
        method = PAIRED
    else:
        ia, ib = a.goodput_intervals.get(label), b.goodput_intervals.get(label)
        diff = difference_of_intervals(ia, ib) if ia and ib else Interval(mean_b - mean_a)
        method = INTERVALS if diff.known else NONE
    row = row_of(label, GOODPUT, mean_a, mean_b, diff, method, len(shared))
    row.update(a_bound=bound_of(ga.values()), b_bound=bound_of(gb.values()))
    if censored:  # a bound took part: the difference is no number to read, whichever way
        row.update(difference=math.nan, low=math.nan, high=math.nan, change=math.nan, method=NONE,
                   verdict="a censored goodput (a bound) took part")  # fmt: skip
    return row


def bound_of(values) -> str:
    """The sign of a bound where the repeats' mean is one (a repeat censored one way), "?" both ways."""
    kinds = {g.censored for g in values if g.censored}
    return "?" if len(kinds) > 1 else {ABOVE: ">=", BELOW: "<"}.get(kinds.pop(), "") if kinds else ""


def row_of(key: str, figure: str, a: float, b: float, diff: Interval, method: str, shared: int) -> dict:
    if abs(diff.estimate) <= 1e-9 * max(abs(a), abs(b)):  # the same figure, up to rounding
        diff = Interval(0.0, diff.low, diff.high)
    if not diff.known:
        verdict = "no interval"
    elif diff.low > 0 or diff.high < 0:
        verdict = f"B {'higher' if diff.estimate > 0 else 'lower'}"
    else:
        verdict = "not separated"
    return {
        "key": key,
        "figure": figure,
        "a": a,
        "b": b,
        "difference": diff.estimate,
        "low": diff.low,
        "high": diff.high,
        "change": diff.estimate / a if a else math.nan,
        "method": method,
        "seeds_shared": shared,
        "verdict": verdict,
        "a_bound": "",
        "b_bound": "",
    }


def compare(a: Side, b: Side, figures=FIGURES) -> pd.DataFrame:
    """One row per configuration and figure both runs have: A, B, B - A with its 95% interval, how
    it was formed (paired over shared seeds, or from the two intervals) and whether it excludes 0."""
    keys = [k for k in dict.fromkeys(a.rows["key"]) if k in set(b.rows["key"])]
    labels = [k for k in a.goodput if k in b.goodput]
    if not keys and not labels:
        raise ResultsError(
            f"nothing to compare: A has {sorted(set(a.rows['key']))}, B has {sorted(set(b.rows['key']))}"
        )
    rows = [compare_goodput(a, b, label) for label in labels]
    rows += [compare_figure(a, b, key, f) for key in keys for f in figures]
    table = pd.DataFrame(rows)
    return table[table["a"].notna() | table["b"].notna()].reset_index(drop=True)


# -- what is printed and written -------------------------------------------------------------------
def _shown(x: float, scale: float, bound: str = "") -> str:
    return "-" if x is None or x != x else f"{bound + ' ' if bound else ''}{scale * x:.4g}"


def table_lines(table: pd.DataFrame) -> list[str]:
    shown = []
    for r in table.to_dict(orient="records"):
        scale = 1000.0 if is_latency(r["figure"]) else 1.0
        interval = f" [{_shown(r['low'], scale)}, {_shown(r['high'], scale)}]" if r["low"] == r["low"] else ""
        shown.append(
            {
                "configuration": r["key"],
                "figure": "goodput req/s per GPU" if r["figure"] == GOODPUT else title(r["figure"]),
                "A": _shown(r["a"], scale, r["a_bound"]),
                "B": _shown(r["b"], scale, r["b_bound"]),
                "B - A [95% interval]": _shown(r["difference"], scale) + interval,
                "change": "-" if r["change"] != r["change"] else f"{r['change']:+.1%}",
                "from": f"{r['method']} ({r['seeds_shared']} seeds)" if r["method"] == PAIRED else r["method"],
                "verdict": r["verdict"],
            }
        )
    return [pd.DataFrame(shown).to_string(index=False)]


def header_lines(a: Side, b: Side) -> list[str]:
    lines = [f"A: {a.describe()}", f"B: {b.describe()}"]
    if a.versions != b.versions:
        lines.append(f"code: A ran {', '.join(a.versions)}, B ran {', '.join(b.versions)}")
    if a.experiment != b.experiment:
        lines.append(f"note: different studies ({a.experiment} and {b.experiment}): keys matched by name")
    shared = set(a.rows["seed"]) & set(b.rows["seed"])
    if len(shared) < 2:
        lines.append(
            "seeds: fewer than two shared, so no pairing: each difference comes from the two runs' "
            "own intervals taken as independent"
        )
    return lines


def figure_of(table: pd.DataFrame, out: Path) -> list[Path]:
    """One panel per figure: B - A per configuration with its interval, and the zero line. The
    cells' panels share their rows (named in the first column); goodput's, last, names its own on
    the right."""
    from analysis import style

    figures = sorted(dict.fromkeys(table["figure"]), key=lambda f: f == GOODPUT)
    cols = min(4, len(figures))
    rows = math.ceil(len(figures) / cols)
    most = max(table.groupby("figure")["key"].nunique())
    with style.paper():
        fig, axes = style.figure("double", rows, cols, height_in=max(2.2, 0.16 * most + 1.0) * rows)
        axes = np.atleast_1d(axes)
        for i, (ax, figure) in enumerate(zip(axes, figures)):
            part = table[table["figure"] == figure]
            keys = list(part["key"])  # goodput's configurations, or the cells
            scale = 1000.0 if is_latency(figure) else 1.0
            at = np.arange(len(keys))
            d = scale * part["difference"].to_numpy(float)
            low, high = scale * part["low"].to_numpy(float), scale * part["high"].to_numpy(float)
            known = ~np.isnan(low)
            ax.axvline(0.0, color="0.5", lw=0.8)
            ax.errorbar(d[known], at[known], xerr=[d[known] - low[known], high[known] - d[known]],
                        fmt="none", ecolor="0.3", elinewidth=0.8, capsize=2)  # fmt: skip
            ax.scatter(d, at, c=[style.colour(k.split("_")[0]) for k in keys], s=12, zorder=3)
            for y in at[np.isnan(d)]:  # a censored goodput took part: a bound, no difference to draw
                ax.text(0.0, y, " bound", fontsize="x-small", va="center", color="0.3")
            if figure == GOODPUT:
                ax.yaxis.tick_right()
            ax.set_yticks(at, keys if figure == GOODPUT or i % cols == 0 else [""] * len(keys))
            ax.set_ylim(len(keys) - 0.5, -0.5)
            ax.set_title("goodput req/s per GPU" if figure == GOODPUT else title(figure), fontsize="small")
            ax.set_xlabel("B - A")
        for ax in axes[len(figures) :]:
            ax.set_visible(False)
    caption = (
        "B - A per configuration and figure with its 95% interval (paired over the seeds both runs "
        "ran, or from the two runs' own intervals); a point without a bar has no interval, 'bound' "
        "marks a goodput that one run only bounds."
    )
    return style.save(fig, out / "compare", caption)


def write(table: pd.DataFrame, a: Side, b: Side, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    body = {
        "a": {"dir": str(a.dir), "experiment": a.experiment, "code": a.versions, "host": a.host},
        "b": {"dir": str(b.dir), "experiment": b.experiment, "code": b.versions, "host": b.host},
        "rows": json.loads(table.to_json(orient="records")),
    }
    (out / "compare.json").write_text(json.dumps(body, indent=1) + "\n")
    return [out / "compare.json", *figure_of(table, out)]


def main(run_a: Path, run_b: Path, out: Path, figures=FIGURES) -> list[str]:
    """The lines to print; the files written under `out`."""
    a, b = load_side(run_a), load_side(run_b)
    table = compare(a, b, figures)
    paths = write(table, a, b, out)
    return header_lines(a, b) + table_lines(table) + [f"figure: {p}" for p in paths[1:]] + [f"table: {paths[0]}"]
