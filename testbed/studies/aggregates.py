"""What a study computes across its points, from the sweep table and the points' request tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.metrics.comparisons import verdict
from testbed.metrics.interference import background_gaps, decode_steps, injection_window
from testbed.metrics.rate_search import ABOVE, BELOW, Goodput, goodput_of
from testbed.metrics.slo import attainment_curve, capacity, filtered_out, meets_slo, tenant_slos
from testbed.metrics.summary import decode_itl_samples, measured
from testbed.metrics.uncertainty import ratio_interval, request_units, sample_interval, share_interval
from testbed.studies.machine import num_devices
from testbed.studies.repeats import goodput_interval, per_repeat

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
    return pd.read_parquet(path) if path.is_file() else pd.DataFrame()


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


def slo_scale(table, cfg, out_dir) -> dict:
    """Per configuration, its repeats pooled: attainment with both SLOs (tenant SLOs included)
    scaled, with a 95% interval over the runs at each scale."""
    curves, tenants = {}, tenant_slos(cfg.workload.tenants, cfg.slo)
    for label, group in finished(table).groupby("label"):
        requests = pd.concat(
            [point_requests(out_dir, p, cfg).assign(point=p) for p in group["point"]], ignore_index=True
        )
        units = [u[~filtered_out(u)] for u in request_units(requests)]
        scales = list(cfg.experiment.slo_scales)
        curve = attainment_curve(requests, cfg.slo, scales, tenants)
        bounds = [
            tuple(share_interval([meets_slo(u, cfg.slo, tenants, scale=s).to_numpy(float) for u in units if len(u)]))[
                1:
            ]
            for s in scales
        ]
        curves[label] = {
            "scales": list(curve),
            "attainment": list(curve.values()),
            "low": [b[0] for b in bounds],
            "high": [b[1] for b in bounds],
        }
    return {"curves": curves}


def interference(table, cfg, out_dir) -> dict:
    """Per mode and prefill length (repeats pooled): p99 ITL of background gaps that overlap an
    injected prefill against those that do not, in the same run (`inflation`), and against the
    decode-only baseline point (`inflation_vs_baseline`), with 95% intervals over the runs; decode
    stalls; and the step-level view, decode step time with and without prefill work alongside."""
    out = {}
    for label, group in finished(table).groupby("label"):
        loaded = {
            int(length): [_point_tables(out_dir, p, cfg) for p in _by_repeat(rows)["point"]]
            for length, rows in group.groupby("prefill_len")
        }
        if 0 not in loaded:
            continue
        out[label] = {}
        for length, runs in sorted(loaded.items()):
            windows = [injection_window(requests) for requests, _ in runs]
            window = _widest(windows)
            gaps = [background_gaps(r, s, w) for (r, s), w in zip(runs, windows)]
            steps = pd.concat([decode_steps(r, s, w) for (r, s), w in zip(runs, windows)], ignore_index=True)
            # the baseline over the same period of its own run: the background alone, context grown alike;
            # run i of the baseline shares its seed with run i here (both in repeat order)
            baseline = [background_gaps(r, s, window)["itl"].to_numpy(float) for r, s in loaded[0]]
            itl = np.concatenate(baseline) if baseline else np.array([])
            threshold = cfg.metrics.stall_factor * float(np.median(itl)) if itl.size else np.nan
            out[label][str(length)] = _interference_cell(gaps, steps, baseline, threshold)
    return {"interference": out, "baseline_stall_threshold_factor": cfg.metrics.stall_factor}


def _widest(windows: list) -> tuple[float, float] | None:
    known = [w for w in windows if w is not None]
    return (min(w[0] for w in known), max(w[1] for w in known)) if known else None


def _by_repeat(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.sort_values("repeat") if "repeat" in rows.columns else rows


def _interference_cell(
    gaps: list[pd.DataFrame], steps: pd.DataFrame, baseline: list[np.ndarray], threshold: float
) -> dict:
    """`gaps`: one frame per run; `baseline`: the baseline's gaps, one array per run of the same seeds."""
    exposed = [g.loc[g["exposed"].astype(bool), "itl"].to_numpy(float) for g in gaps]
    quiet = [g.loc[~g["exposed"].astype(bool), "itl"].to_numpy(float) for g in gaps]
    inflation = ratio_interval(exposed, quiet)
    versus_baseline = ratio_interval(exposed, baseline)
    pooled = {
        k: np.concatenate(v) if v else np.array([])
        for k, v in (("exposed", exposed), ("quiet", quiet), ("baseline", baseline))
    }
    p99 = lambda x: float(np.percentile(x, 99)) if x.size else np.nan  # noqa: E731
    # a loaded host can stretch the probes' prefills over the whole window (or the background's
    # start past it): then one side has no gaps, and the note says which, not a figure
    empty = [f"no {side} gaps" for side in ("exposed", "quiet") if not pooled[side].size]
    note = empty[0] if empty else inflation.note
    with_prefill = steps.loc[steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    without = steps.loc[~steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    return {
        "exposed_gaps": int(pooled["exposed"].size),
        "quiet_gaps": int(pooled["quiet"].size),
        "itl_p99_exposed": p99(pooled["exposed"]),
        "itl_p99_quiet": p99(pooled["quiet"]),
        "itl_p99_baseline": p99(pooled["baseline"]),
        "inflation": inflation.estimate,
        "inflation_low": inflation.low,
        "inflation_high": inflation.high,
        "inflation_note": note,
        "inflation_vs_baseline": versus_baseline.estimate,
        "inflation_vs_baseline_low": versus_baseline.low,
        "inflation_vs_baseline_high": versus_baseline.high,
        "stalls": int(np.sum(pooled["exposed"] > threshold)) + int(np.sum(pooled["quiet"] > threshold)),
        "decode_step_s_with_prefill": float(with_prefill.mean()) if with_prefill.size else np.nan,
        "decode_step_s_without_prefill": float(without.mean()) if without.size else np.nan,
        "decode_steps_with_prefill": int(with_prefill.size),
    }


def _point_tables(out_dir: Path, point: str, cfg: Config) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps = out_dir / "points" / point / "steps.parquet"
    return point_requests(out_dir, point, cfg), (pd.read_parquet(steps) if steps.is_file() else pd.DataFrame())


def cell_requests(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict[str, pd.DataFrame]:
    """{cell: the requests of its finished repeats, pooled, each tagged with its point}."""
    return {
        cell: pd.concat([point_requests(out_dir, p, cfg).assign(point=p) for p in points], ignore_index=True)
        for cell, points in _cell_points(table).items()
    }


def multiturn(table, cfg, out_dir) -> dict:
    """Per cell (repeats pooled), each with a 95% interval over the runs: mean TTFT and mean KV
    bytes moved per turn (none moved: 0), and the p99 of the decode workers' per-token step time
    in steps with appends (prefill work beside the decodes) and in decode-only steps."""
    out, itl = {}, {}
    for cell, requests in cell_requests(table, cfg, out_dir).items():
        ok = requests[requests["status"] == "ok"].assign(kv_moved=lambda r: r["kv_bytes"].fillna(0.0))
        out[cell] = {**_mean_by_turn(ok, "ttft"), **_mean_by_turn(ok, "kv_moved", "kv_bytes")}
    for cell, points in _cell_points(table).items():
        frames = [_point_tables(out_dir, p, cfg)[1] for p in points]
        runs = [decode_itl_samples(f) for f in frames if not f.empty]
        runs = [r for r in runs if r is not None]
        if runs:
            itl[cell] = {name: list(sample_interval([r[name] for r in runs], "p99")) for name in runs[0]}
            itl[cell] = {k: [None if np.isnan(v[0]) else v[0], *v[1:]] for k, v in itl[cell].items()}
    return {"turns": out, "decode_itl_p99": itl}


def _mean_by_turn(ok: pd.DataFrame, column: str, name: str = "") -> dict:
    by_turn = {
        str(t): tuple(sample_interval([u[column].to_numpy(float) for u in request_units(g)], "mean"))
        for t, g in ok.groupby("turn")
    }
    key = f"{name or column}_mean_by_turn"
    return {
        key: {t: v[0] for t, v in by_turn.items()},
        f"{key}_low": {t: v[1] for t, v in by_turn.items()},
        f"{key}_high": {t: v[2] for t, v in by_turn.items()},
    }


def _cell_points(table: pd.DataFrame) -> dict[str, list[str]]:
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


def burstiness(table, cfg, out_dir) -> dict:
    """Per configuration: {burstiness: mean attainment over repeats}, and its interval."""
    out = {}
    for label, group in cells(out_dir).groupby("label"):
        group = group.sort_values("burstiness")
        out[label] = dict(zip(group["burstiness"], group["slo_attainment"]))
        out[f"{label}_interval"] = {
            b: [lo, hi]
            for b, lo, hi in zip(group["burstiness"], group["slo_attainment_low"], group["slo_attainment_high"])
        }
    return out


def concurrency_sweep(table, cfg, out_dir) -> dict:
    """Per configuration: {users: mean throughput (req/s) over repeats}, and its p50/p99 TTFT and TPOT."""
    out = {}
    for label, group in cells(out_dir).groupby("label"):
        group = group.sort_values("concurrency")
        users = [int(n) for n in group["concurrency"]]
        out[label] = dict(zip(users, group["throughput_requests_per_s"]))
        out[f"{label}_latency"] = {
            n: {key: row[key] for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
            for n, (_, row) in zip(users, group.iterrows())
        }
    return out


VALIDATED = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


HOST_DELAYS = ("dispatch_s", "step_gap_s", "report_s", "release_s", "report_first_s", "handoff_s")


def sim_validate(table, cfg, out_dir) -> dict:
    """Relative error of the simulation against the real run: per point, and of goodput; and
    the host-side delays the simulation ran with (in situ: measured on the calibration runs)."""
    rows, grid = finished(table), cells(out_dir)
    real = grid[grid["executor"] == "real"].set_index(["label", "rate"])
    sim = grid[grid["executor"] == "sim"].set_index(["label", "rate"])
    errors = []
    for key in real.index.intersection(sim.index):
        row = {"label": key[0], "rate": key[1]}
        row.update({f"{m}_error": _relative(sim.loc[key, m], real.loc[key, m]) for m in VALIDATED})
        # the real cell's own spread: a simulated figure inside its 95% interval is not told apart
        row.update({f"{m}_within_real": _within(sim.loc[key, m], real.loc[key], m) for m in VALIDATED})
        errors.append(row)
    goodputs = {ex: goodput_by_label(rows[rows["executor"] == ex], cfg, out_dir) for ex in ("real", "sim")}
    goodput_errors = {
        label: _relative(goodputs["sim"][label]["goodput"], g["goodput"])
        for label, g in goodputs["real"].items()
        if label in goodputs["sim"]
    }
    table_errors = pd.DataFrame(errors)
    if len(table_errors):
        from testbed.metrics.results_dir import write_parquet

        write_parquet(out_dir / "validation.parquet", table_errors)
    worst = {m: float(table_errors[f"{m}_error"].abs().max()) if len(table_errors) else np.nan for m in VALIDATED}
    within = {m: int(table_errors[f"{m}_within_real"].sum()) if len(table_errors) else 0 for m in VALIDATED}
    return {
        "errors": errors,
        "disagg_sign": disagg_signs(real, sim),
        "goodput_by_executor": goodputs,
        "goodput_error": goodput_errors,
        "worst_abs_error": worst,
        "within_real_interval": within,
        "points_compared": len(errors),
        "host_delays": _host_delays(rows),
    }


def disagg_signs(real: pd.DataFrame, sim: pd.DataFrame) -> dict:
    """Per rate and figure, whether the simulation gives the disaggregated split's difference from
    colocated the sign the real runs gave ({"1P1D - colocated @1": {"ttft_p50": true, ...}})."""
    out = {}
    labels = set(real.index.get_level_values(0)) if len(real) else set()
    splits = sorted(label for label in labels if label[:1].isdigit() and "P" in label)
    for split in splits if "colocated" in labels else []:
        for rate in sorted(set(real.loc[split].index) & set(real.loc["colocated"].index)):
            if (split, rate) not in sim.index or ("colocated", rate) not in sim.index:
                continue
            row = {}
            for m in VALIDATED:
                diff_real = real.loc[(split, rate), m] - real.loc[("colocated", rate), m]
                diff_sim = sim.loc[(split, rate), m] - sim.loc[("colocated", rate), m]
                row[m] = bool(np.sign(diff_real) == np.sign(diff_sim))
            out[f"{split} - colocated @{rate:g}"] = row
    return out


def _host_delays(rows: pd.DataFrame) -> dict:
    """Per configuration, the host delays its simulated points ran with (seconds)."""
    sim = rows[rows["executor"] == "sim"] if len(rows) else rows
    columns = {d: f"sim_host_delays_{d}" for d in HOST_DELAYS}
    if not len(sim) or not all(c in sim.columns for c in columns.values()):
        return {}
    scales = [c for c in sim.columns if c.startswith("sim_host_delays_step_scale_")]
    return {
        label: {
            **{d: float(group[c].iloc[0]) for d, c in columns.items()},
            **{c.removeprefix("sim_host_delays_"): float(group[c].iloc[0]) for c in scales if group[c].notna().any()},
        }
        for label, group in sim.groupby("label")
    }


def _within(simulated: float, real: pd.Series, metric: str) -> bool:
    low, high = real.get(f"{metric}_low", np.nan), real.get(f"{metric}_high", np.nan)
    return bool(low <= simulated <= high)


def _relative(simulated: float, real: float) -> float:
    return float((simulated - real) / real) if real else np.nan


def plan(table, cfg, out_dir) -> dict:
    """The analytical split, the simulated best configuration and, given a real sweep, the measured
    one; with experiment.tp_degrees beyond [1], the placement search's best and what it pruned. The
    planners propose only workers that fit their devices: of the smallest TP degree that holds a
    model one device cannot (placements.planning, said under `planned_tp`), none where none does."""
    from testbed.errors import ConfigError
    from testbed.sim.load_split import analytical_split
    from testbed.studies.placements import planning

    simulated = goodput_by_label(table, cfg, out_dir)
    # what every planner's devices run: the profile's name (None: none) and its line
    out = {"engine_profile": cfg.sim.engine_profile if cfg.sim.analytical() else None, "engine": cfg.sim.engine_line()}
    try:
        planned, why = planning(cfg, num_devices(cfg))
        out["analytical"] = analytical_split(
            planned.serving, planned.sim, None, num_devices(cfg)
        )  # each role's device from cfg.sim
    except ConfigError as error:
        planned, why = cfg, None
        out.update(analytical=None, analytical_skipped=str(error))
    if why:
        out["planned_tp"] = why
    out.update(slo_plan(planned), simulated={"goodput": simulated, "best": best_of(simulated)})
    if list(cfg.experiment.tp_degrees) != [1]:
        out["placements"] = placement_search(cfg, simulated, out["simulated"]["best"])
    if cfg.experiment.measured_sweep:
        measured = json.loads((Path(cfg.experiment.measured_sweep) / "sweep.json").read_text())["aggregate"]
        out["measured"] = {"goodput": measured.get("goodput", {}), "best": measured.get("best", {})}
    return out


def slo_plan(cfg) -> dict:
    """The SLO-aware split of the cluster's prefill and decode workers; none where they do not fit
    their devices (said why)."""
    from testbed.errors import ConfigError
    from testbed.sim.slo_split import slo_split

    try:
        return {"slo_plan": slo_split(cfg.serving, cfg.sim, num_devices(cfg), rate=max(cfg.experiment.rates))}
    except ConfigError as error:
        return {"slo_plan": None, "slo_plan_skipped": str(error)}


def placement_search(cfg, simulated: dict, best: dict) -> dict:
    """The TP placement search: the degrees, what ran, what was pruned and why, and the leader by
    goodput per GPU with its 95% interval (best_of's verdict says whether it is separated)."""
    from testbed.studies.placements import search

    _, pruned = search(cfg, num_devices(cfg))
    label = best.get("label")
    g = simulated.get(label, {})
    return {
        "tp_degrees": list(cfg.experiment.tp_degrees),
        "searched": list(simulated),
        "pruned": pruned,
        "best": label,
        "separated": bool(best.get("separated")),
        "goodput_per_gpu": g.get("goodput_per_gpu"),
        "goodput_per_gpu_low": g.get("goodput_per_gpu_low"),
        "goodput_per_gpu_high": g.get("goodput_per_gpu_high"),
    }
