"""What a study computes across its points, from the sweep table and the points' request tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.metrics.interference import background_gaps, decode_steps, injection_window
from testbed.experiments.repeats import goodput_interval, per_repeat
from testbed.metrics.slo import attainment_curve, capacity, filtered_out, goodput, meets_slo, tenant_slos
from testbed.metrics.summary import decode_itl_samples, measured
from testbed.metrics.uncertainty import bootstrap_interval, ratio_interval, verdict


def finished(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["status"].isin(["ok", "skipped"])] if len(table) else table


def point_requests(out_dir: Path, point: str, cfg: Config) -> pd.DataFrame:
    """A point's requests without its warm-up: the same filter as its summary.json."""
    return measured(pd.read_parquet(out_dir / "points" / point / "requests.parquet"), cfg.metrics)


def cells(out_dir: Path) -> pd.DataFrame:
    """The sweep's cells (a point's repeats together) with their intervals: intervals.parquet."""
    path = out_dir / "intervals.parquet"
    return pd.read_parquet(path) if path.is_file() else pd.DataFrame()


def goodput_by_label(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict:
    """Per configuration: goodput (90% attainment, DistServe) in total and per GPU, and capacity
    (p99 ITL under slo.tpot_s, Sarathi-Serve), over the swept rates; one value per repeat, their
    mean and a 95% interval across the repeats."""
    out = {}
    for label, group in finished(table).groupby("label"):
        gpus = int(group["num_gpus"].iloc[0])
        totals, capacities = [], []
        for rows in per_repeat(group):
            rows = rows.sort_values("rate")
            totals.append(goodput(rows["rate"], rows["slo_attainment"]))
            capacities.append(capacity(rows["rate"], rows["itl_p99"], cfg.slo.tpot_s))
        highest = float(group["rate"].max())
        total = goodput_interval(totals, highest)
        per_gpu = goodput_interval([t / gpus for t in totals], highest / gpus)
        curve = group.groupby("rate")["slo_attainment"].mean()
        out[label] = {"goodput": total["mean"], "goodput_low": total["low"], "goodput_high": total["high"],
                      "goodput_per_gpu": per_gpu["mean"], "goodput_per_gpu_low": per_gpu["low"],
                      "goodput_per_gpu_high": per_gpu["high"], "goodput_per_repeat": total["values"],
                      "num_gpus": gpus, "repeats": len(totals), "capacity": float(np.mean(capacities)),
                      "rates": curve.index.tolist(), "attainment": curve.tolist()}
    return out


def best_of(goodputs: dict) -> dict:
    """The leader by mean goodput per GPU, `separated` only when its interval clears the
    runner-up's; `line` says which (see metrics.uncertainty.verdict)."""
    if not goodputs:
        return {}
    estimates = {k: (g["goodput_per_gpu"], g.get("goodput_per_gpu_low", np.nan), g.get("goodput_per_gpu_high", np.nan))
                 for k, g in goodputs.items()}
    chosen = verdict(estimates)
    return {**chosen, "goodput_per_gpu": goodputs[chosen["label"]]["goodput_per_gpu"]}


def ratio_sweep(table, cfg, out_dir) -> dict:
    goodputs = goodput_by_label(table, cfg, out_dir)
    return {"goodput": goodputs, "best": best_of(goodputs), "repeats": cfg.experiment.repeats}


def slo_scale(table, cfg, out_dir) -> dict:
    """Per configuration, its repeats pooled: attainment with both SLOs (tenant SLOs included)
    scaled, with a 95% bootstrap interval at each scale."""
    curves, tenants = {}, tenant_slos(cfg.workload.tenants, cfg.slo)
    for label, group in finished(table).groupby("label"):
        requests = pd.concat([point_requests(out_dir, p, cfg) for p in group["point"]], ignore_index=True)
        counted = requests[~filtered_out(requests)]
        scales = list(cfg.experiment.slo_scales)
        curve = attainment_curve(requests, cfg.slo, scales, tenants)
        bounds = [bootstrap_interval(meets_slo(counted, cfg.slo, tenants, scale=s).to_numpy(float), "mean",
                                     seed=cfg.seed) for s in scales]
        curves[label] = {"scales": list(curve), "attainment": list(curve.values()),
                         "low": [b[0] for b in bounds], "high": [b[1] for b in bounds]}
    return {"curves": curves}


def interference(table, cfg, out_dir) -> dict:
    """Per mode and prefill length (repeats pooled): p99 ITL of background gaps that overlap an
    injected prefill against those that do not, in the same run (`inflation`), and against the
    decode-only baseline point (`inflation_vs_baseline`), with 95% bootstrap intervals; decode
    stalls; and the step-level view, decode step time with and without prefill work alongside."""
    out = {}
    for label, group in finished(table).groupby("label"):
        loaded = {int(length): [_point_tables(out_dir, p, cfg) for p in rows["point"]]
                  for length, rows in group.groupby("prefill_len")}
        if 0 not in loaded:
            continue
        out[label] = {}
        for length, runs in sorted(loaded.items()):
            windows = [injection_window(requests) for requests, _ in runs]
            window = _widest(windows)
            gaps = pd.concat([background_gaps(r, s, w) for (r, s), w in zip(runs, windows)], ignore_index=True)
            steps = pd.concat([decode_steps(r, s, w) for (r, s), w in zip(runs, windows)], ignore_index=True)
            # the baseline over the same period of its own run: the background alone, context grown alike
            baseline = pd.concat([background_gaps(r, s, window) for r, s in loaded[0]], ignore_index=True)
            itl = baseline["itl"].to_numpy(float)
            threshold = cfg.metrics.stall_factor * float(np.median(itl)) if itl.size else np.nan
            out[label][str(length)] = _interference_cell(gaps, steps, itl, threshold, cfg.seed)
    return {"interference": out, "baseline_stall_threshold_factor": cfg.metrics.stall_factor}


def _widest(windows: list) -> tuple[float, float] | None:
    known = [w for w in windows if w is not None]
    return (min(w[0] for w in known), max(w[1] for w in known)) if known else None


def _interference_cell(gaps: pd.DataFrame, steps: pd.DataFrame, baseline: np.ndarray, threshold: float,
                       seed: int) -> dict:
    exposed = gaps.loc[gaps["exposed"].astype(bool), "itl"].to_numpy(float)
    quiet = gaps.loc[~gaps["exposed"].astype(bool), "itl"].to_numpy(float)
    inflation = ratio_interval(exposed, quiet, seed=seed)
    versus_baseline = ratio_interval(exposed, baseline, seed=seed)
    p99 = lambda x: float(np.percentile(x, 99)) if x.size else np.nan  # noqa: E731
    with_prefill = steps.loc[steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    without = steps.loc[~steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    return {"exposed_gaps": int(exposed.size), "quiet_gaps": int(quiet.size),
            "itl_p99_exposed": p99(exposed), "itl_p99_quiet": p99(quiet), "itl_p99_baseline": p99(baseline),
            "inflation": inflation[0], "inflation_low": inflation[1], "inflation_high": inflation[2],
            "inflation_vs_baseline": versus_baseline[0], "inflation_vs_baseline_low": versus_baseline[1],
            "inflation_vs_baseline_high": versus_baseline[2],
            "stalls": int(np.sum(exposed > threshold)) + int(np.sum(quiet > threshold)),
            "decode_step_s_with_prefill": float(with_prefill.mean()) if with_prefill.size else np.nan,
            "decode_step_s_without_prefill": float(without.mean()) if without.size else np.nan,
            "decode_steps_with_prefill": int(with_prefill.size)}


def _point_tables(out_dir: Path, point: str, cfg: Config) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps = out_dir / "points" / point / "steps.parquet"
    return point_requests(out_dir, point, cfg), (pd.read_parquet(steps) if steps.is_file() else pd.DataFrame())


def cell_requests(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict[str, pd.DataFrame]:
    """{cell: the requests of its finished repeats, pooled}."""
    return {cell: pd.concat([point_requests(out_dir, p, cfg) for p in points], ignore_index=True)
            for cell, points in _cell_points(table).items()}


def multiturn(table, cfg, out_dir) -> dict:
    """Per cell (repeats pooled), each with a 95% bootstrap interval: mean TTFT and mean KV bytes
    moved per turn (none moved: 0), and the p99 of the decode workers' per-token step time in
    steps with appends (prefill work beside the decodes) and in decode-only steps."""
    out, itl = {}, {}
    for cell, requests in cell_requests(table, cfg, out_dir).items():
        ok = requests[requests["status"] == "ok"].assign(kv_moved=lambda r: r["kv_bytes"].fillna(0.0))
        out[cell] = {**_mean_by_turn(ok, "ttft", cfg.seed), **_mean_by_turn(ok, "kv_moved", cfg.seed, "kv_bytes")}
    for cell, points in _cell_points(table).items():
        frames = [_point_tables(out_dir, p, cfg)[1] for p in points]
        frames = [f for f in frames if not f.empty]
        samples = decode_itl_samples(pd.concat(frames, ignore_index=True)) if frames else None
        if samples is not None:
            itl[cell] = {name: [float(np.percentile(x, 99)) if len(x) else None,
                                *bootstrap_interval(x, "p99", seed=cfg.seed)] for name, x in samples.items()}
    return {"turns": out, "decode_itl_p99": itl}


def _mean_by_turn(ok: pd.DataFrame, column: str, seed: int, name: str = "") -> dict:
    by_turn = {str(t): (float(g.mean()), *bootstrap_interval(g.to_numpy(float), "mean", seed=seed))
               for t, g in ok.groupby("turn")[column]}
    key = f"{name or column}_mean_by_turn"
    return {key: {t: v[0] for t, v in by_turn.items()}, f"{key}_low": {t: v[1] for t, v in by_turn.items()},
            f"{key}_high": {t: v[2] for t, v in by_turn.items()}}


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
        out[f"{label}_interval"] = {b: [lo, hi] for b, lo, hi in zip(group["burstiness"], group["slo_attainment_low"],
                                                                       group["slo_attainment_high"])}
    return out


VALIDATED = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


HOST_DELAYS = ("dispatch_s", "step_gap_s", "report_s")


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
    goodput_errors = {label: _relative(goodputs["sim"][label]["goodput"], g["goodput"])
                      for label, g in goodputs["real"].items() if label in goodputs["sim"]}
    table_errors = pd.DataFrame(errors)
    if len(table_errors):
        from testbed.tracking.results import write_parquet

        write_parquet(out_dir / "validation.parquet", table_errors)
    worst = {m: float(table_errors[f"{m}_error"].abs().max()) if len(table_errors) else np.nan for m in VALIDATED}
    within = {m: int(table_errors[f"{m}_within_real"].sum()) if len(table_errors) else 0 for m in VALIDATED}
    return {"errors": errors, "goodput_by_executor": goodputs, "goodput_error": goodput_errors,
            "worst_abs_error": worst, "within_real_interval": within, "points_compared": len(errors),
            "host_delays": _host_delays(rows)}


def _host_delays(rows: pd.DataFrame) -> dict:
    """Per configuration, the host delays its simulated points ran with (seconds)."""
    sim = rows[rows["executor"] == "sim"] if len(rows) else rows
    columns = {d: f"sim_host_delays_{d}" for d in HOST_DELAYS}
    if not len(sim) or not all(c in sim.columns for c in columns.values()):
        return {}
    scales = [c for c in sim.columns if c.startswith("sim_host_delays_step_scale_")]
    return {label: {**{d: float(group[c].iloc[0]) for d, c in columns.items()},
                    **{c.removeprefix("sim_host_delays_"): float(group[c].iloc[0]) for c in scales
                       if group[c].notna().any()}}
            for label, group in sim.groupby("label")}


def _within(simulated: float, real: pd.Series, metric: str) -> bool:
    low, high = real.get(f"{metric}_low", np.nan), real.get(f"{metric}_high", np.nan)
    return bool(low <= simulated <= high)


def _relative(simulated: float, real: float) -> float:
    return float((simulated - real) / real) if real else np.nan


def plan(table, cfg, out_dir) -> dict:
    """The analytical split, the simulated best configuration and, given a real sweep, the measured one."""
    from testbed.experiments.studies import num_devices
    from testbed.sim.planner import analytical_split
    from testbed.sim.slo_plan import slo_split

    simulated = goodput_by_label(table, cfg, out_dir)
    out = {"analytical": analytical_split(cfg, None, num_devices(cfg)),  # each role's device from cfg.sim
           "slo_plan": slo_split(cfg, num_devices(cfg), rate=max(cfg.experiment.rates)),
           "simulated": {"goodput": simulated, "best": best_of(simulated)}}
    if cfg.experiment.measured_sweep:
        measured = json.loads((Path(cfg.experiment.measured_sweep) / "sweep.json").read_text())["aggregate"]
        out["measured"] = {"goodput": measured.get("goodput", {}), "best": measured.get("best", {})}
    return out
