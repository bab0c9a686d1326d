"""What a study computes across its points, from the sweep table and the points' request tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.metrics.latency import pooled_itl
from testbed.metrics.slo import attainment_curve, capacity, goodput


def finished(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["status"].isin(["ok", "skipped"])] if len(table) else table


def point_requests(out_dir: Path, point: str) -> pd.DataFrame:
    return pd.read_parquet(out_dir / "points" / point / "requests.parquet")


def goodput_by_label(table: pd.DataFrame, cfg: Config, out_dir: Path) -> dict:
    """Per configuration: goodput (90% attainment, DistServe) in total and per GPU, and
    capacity (p99 ITL under slo.tpot_s, Sarathi-Serve), over the swept rates."""
    out = {}
    for label, group in finished(table).groupby("label"):
        group = group.sort_values("rate")
        total = goodput(group["rate"], group["slo_attainment"])
        gpus = int(group["num_gpus"].iloc[0])
        out[label] = {"goodput": total, "goodput_per_gpu": total / gpus, "num_gpus": gpus,
                      "capacity": capacity(group["rate"], group["itl_p99"], cfg.slo.tpot_s),
                      "rates": group["rate"].tolist(), "attainment": group["slo_attainment"].tolist()}
    return out


def best_of(goodputs: dict) -> dict:
    if not goodputs:
        return {}
    label = max(goodputs, key=lambda k: goodputs[k]["goodput_per_gpu"])
    return {"label": label, "goodput_per_gpu": goodputs[label]["goodput_per_gpu"]}


def ratio_sweep(table, cfg, out_dir) -> dict:
    goodputs = goodput_by_label(table, cfg, out_dir)
    return {"goodput": goodputs, "best": best_of(goodputs)}


def slo_scale(table, cfg, out_dir) -> dict:
    curves = {}
    for row in finished(table).itertuples():
        curve = attainment_curve(point_requests(out_dir, row.point), cfg.slo, cfg.experiment.slo_scales)
        curves[row.label] = {"scales": list(curve), "attainment": list(curve.values())}
    return {"curves": curves}


def interference(table, cfg, out_dir) -> dict:
    """p99 ITL of the decode background with prefills injected / without, per mode and length."""
    out = {}
    for label, group in finished(table).groupby("label"):
        itl = {row.prefill_len: _background_itl(out_dir, row.point) for row in group.itertuples()}
        if 0 not in itl:
            continue
        base = itl[0]
        base_p99 = float(np.percentile(base, 99)) if len(base) else np.nan
        threshold = cfg.metrics.stall_factor * float(np.median(base)) if len(base) else np.nan
        out[label] = {str(length): {
            "itl_p99": float(np.percentile(values, 99)) if len(values) else np.nan,
            "inflation": (float(np.percentile(values, 99)) / base_p99) if len(values) else np.nan,
            "stalls": int(np.sum(values > threshold)),
        } for length, values in sorted(itl.items())}
    return {"interference": out, "baseline_stall_threshold_factor": cfg.metrics.stall_factor}


def _background_itl(out_dir: Path, point: str) -> np.ndarray:
    requests = point_requests(out_dir, point)
    return pooled_itl(requests[(requests["tenant"] == "background") & (requests["status"] == "ok")])


def multiturn(table, cfg, out_dir) -> dict:
    out = {}
    for row in finished(table).itertuples():
        requests = point_requests(out_dir, row.point)
        ok = requests[requests["status"] == "ok"]
        out[row.point] = {"ttft_mean_by_turn": {str(t): float(v) for t, v in ok.groupby("turn")["ttft"].mean().items()}}
    return {"turns": out}


def by_label(columns: list[str]) -> callable:
    """An aggregate that tabulates a few sweep columns per point (mode_compare, chunk_sweep, ...)."""
    def aggregate(table, cfg, out_dir) -> dict:
        rows = finished(table)
        keep = [c for c in columns if c in rows.columns]
        return {"points": rows.set_index("point")[keep].to_dict(orient="index")}
    return aggregate


def burstiness(table, cfg, out_dir) -> dict:
    return {label: dict(zip(group["burstiness"], group["slo_attainment"]))
            for label, group in finished(table).groupby("label")}


VALIDATED = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def sim_validate(table, cfg, out_dir) -> dict:
    """Relative error of the simulation against the real run: per point, and of goodput."""
    rows = finished(table)
    real = rows[rows["executor"] == "real"].set_index(["label", "rate"])
    sim = rows[rows["executor"] == "sim"].set_index(["label", "rate"])
    errors = []
    for key in real.index.intersection(sim.index):
        row = {"label": key[0], "rate": key[1]}
        row.update({f"{m}_error": _relative(sim.loc[key, m], real.loc[key, m]) for m in VALIDATED})
        errors.append(row)
    goodputs = {ex: goodput_by_label(rows[rows["executor"] == ex], cfg, out_dir) for ex in ("real", "sim")}
    goodput_errors = {label: _relative(goodputs["sim"][label]["goodput"], g["goodput"])
                      for label, g in goodputs["real"].items() if label in goodputs["sim"]}
    table_errors = pd.DataFrame(errors)
    if len(table_errors):
        from testbed.tracking.results import write_parquet

        write_parquet(out_dir / "validation.parquet", table_errors)
    worst = {m: float(table_errors[f"{m}_error"].abs().max()) if len(table_errors) else np.nan for m in VALIDATED}
    return {"errors": errors, "goodput_by_executor": goodputs, "goodput_error": goodput_errors,
            "worst_abs_error": worst, "measured_dispatch_latency_s": _dispatch_latency(rows, out_dir)}


def _dispatch_latency(rows: pd.DataFrame, out_dir: Path) -> float:
    """Median arrival -> first prefill step of the real points at their lowest rate, where queueing
    is least: the host-side hop the simulator adds as sim.dispatch_latency_s."""
    real = rows[rows["executor"] == "real"]
    if not len(real):
        return np.nan
    lowest = real[real["rate"] == real["rate"].min()]
    waits = [point_requests(out_dir, p)["prefill_queue_s"].dropna() for p in lowest["point"]]
    waits = pd.concat(waits) if waits else pd.Series(dtype=float)
    return float(waits.median()) if len(waits) else np.nan


def _relative(simulated: float, real: float) -> float:
    return float((simulated - real) / real) if real else np.nan


def plan(table, cfg, out_dir) -> dict:
    """The analytical split, the simulated best configuration and, given a real sweep, the measured one."""
    from testbed.experiments.studies import num_devices
    from testbed.sim.planner import analytical_split

    simulated = goodput_by_label(table, cfg, out_dir)
    out = {"analytical": analytical_split(cfg, cfg.sim.load(cfg.model.name), num_devices(cfg)),
           "simulated": {"goodput": simulated, "best": best_of(simulated)}}
    if cfg.experiment.measured_sweep:
        measured = json.loads((Path(cfg.experiment.measured_sweep) / "sweep.json").read_text())["aggregate"]
        out["measured"] = {"goodput": measured.get("goodput", {}), "best": measured.get("best", {})}
    return out
