"""sim_validate: the simulator against real runs of the same workload, per mode and rate.

A study in one module (testbed/studies/study.py): its points, aggregate and figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.deploy.checkpoint import NAME as CHECKPOINT
from testbed.errors import ConfigError
from testbed.metrics.results_dir import write_parquet
from testbed.studies.aggregates import cells, finished, goodput_by_label
from testbed.studies.layouts import layouts, mode_rate_grid, rates
from testbed.studies.repeats import OTHER_REPEATS
from testbed.studies.study import Study
from testbed.studies.sweep import Point

CALIBRATION_SEED = 1000  # a calibration run's seed offset: other requests than any validated repeat
CALIBRATION_REQUESTS = 3  # x workload.num_requests: enough steps for the fit's tails


def points(cfg: Config) -> list[Point]:
    """The same workload run for real and simulated, per mode and rate. The simulator runs on a
    profile fitted in situ (testbed/sim/in_situ.py), never on the run it is compared with: with
    repeats, on the real runs of the other repeats of the same cell, pooled (a cell's repeats run
    one after the other, so the fit was measured while the machine was in the state the compared
    run saw: a shared two-core machine's step times drift by a third over tens of seconds, the
    gap between two rates' cells, and fitting across rates carried that drift into every cell;
    all real points run first); with one repeat, on a calibration run of its own seed at the
    middle rate. With hardware.emulate it runs on the very cost model that paces the real
    workers instead, so what differs is the control plane alone; an explicit sim.profile is kept."""
    if cfg.executor == "vllm":
        return sim_validate_vllm(cfg)
    calibrate = not emulated_sim(cfg) and cfg.sim.profile is None
    cells = mode_rate_grid(cfg)
    real = [
        Point(f"{p.name}_real", {**p.overrides, "executor": "real"}, {**p.knobs, "executor": "real"}) for p in cells
    ]
    calibration = []
    if calibrate and not 1 < cfg.experiment.repeats <= 10:  # a repeat suffix of one digit: the glob holds
        rate = rates(cfg)[len(rates(cfg)) // 2]
        for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
            calibration.append(
                Point(
                    f"calibrate_{label}",
                    {
                        **overrides,
                        "workload.rate": rate,
                        "executor": "real",
                        "seed": cfg.seed + CALIBRATION_SEED,
                        "workload.num_requests": CALIBRATION_REQUESTS * cfg.workload.num_requests,
                    },
                    {"label": label, "mode": overrides["mode"], "rate": rate, "executor": "calibration"},
                    repeat=False,
                )
            )
    sims = []
    for point in cells:
        label = point.knobs["label"]
        profile = (
            {
                "sim.profile": f"run:{{points}}/calibrate_{label}"
                if calibration
                else f"run:{{points}}/{point.name}_real_r{OTHER_REPEATS}"
            }
            if calibrate
            else emulated_sim(cfg)
        )
        sims.append(
            Point(
                f"{point.name}_sim",
                {**point.overrides, **profile, "executor": "sim"},
                {**point.knobs, "executor": "sim"},
            )
        )
    return calibration + real + sims


def sim_validate_vllm(cfg: Config) -> list[Point]:
    """sim_validate against vLLM: the real points on vLLM deployments, the simulated ones on a
    profile of vLLM measured beforehand (`+experiment=profile executor=vllm`: its steps, its KV
    link and its front end), the simulator given the served checkpoint's shape."""
    if cfg.sim.profile is None or not cfg.sim.profile.endswith(".json"):
        raise ConfigError(
            "sim_validate with executor=vllm simulates on a profile of vLLM: measure it with `python -m testbed "
            "+experiment=profile executor=vllm` and pass sim.profile=<its profile.json>"
        )
    profile = json.loads(Path(cfg.sim.profile).read_text())
    if profile.get("engine") != "vllm":
        raise ConfigError(f"sim.profile={cfg.sim.profile} was measured on the testbed's engine, not on vLLM")
    model = cfg.vllm.model or str(cfg.vllm.cache() / CHECKPOINT)
    cells = mode_rate_grid(cfg)
    real = [Point(f"{p.name}_real", {**p.overrides}, {**p.knobs, "executor": "real"}) for p in cells]
    simulated = {
        "executor": "sim",
        "model.name": "hf",
        "model.path": model,
        "model.max_model_len": cfg.vllm.max_model_len,  # what the instances serve, not the checkpoint's 8K
        "engine.kv_cache_mib": int(cfg.vllm.kv_space_gib * 1024),  # each instance's KV space
        "sim.frontend_latency_s": float(profile.get("frontend_latency_s") or 0.0),
        "sim.handoff_latency_s": profile.get("handoff_latency_s"),
    }
    sims = [Point(f"{p.name}_sim", {**p.overrides, **simulated}, {**p.knobs, "executor": "sim"}) for p in cells]
    return real + sims


def emulated_sim(cfg: Config) -> dict:
    """The simulator's settings that stand for the emulated devices ({} when not emulated)."""
    hw = cfg.hardware
    if not (hw.emulate or hw.emulate_prefill or hw.emulate_decode):
        return {}
    out = {
        "sim.profile": hw.emulate,
        "sim.prefill_profile": hw.emulate_prefill,
        "sim.decode_profile": hw.emulate_decode,
    }
    if hw.emulate_model:
        out["model.name"] = hw.emulate_model
    # the emulated GPU's widths and expert placement are the simulated one's
    widths = {"sim.weight_dtype": hw.emulate_weight_dtype, "sim.kv_dtype": hw.emulate_kv_dtype}
    out.update({k: v for k, v in widths.items() if v != "auto"})
    if hw.emulate_expert_parallel:
        out["sim.expert_parallel"] = True
    return {k: v for k, v in out.items() if v is not None}


VALIDATED = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


HOST_DELAYS = ("dispatch_s", "step_gap_s", "report_s", "release_s", "report_first_s", "handoff_s")


def aggregate(table, cfg, out_dir) -> dict:
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


STUDY = Study(
    "sim_validate",
    "the simulator against real runs of the same workload, per mode and rate",
    points,
    aggregate,
    figures=("sim_vs_real",),
    fits_in_situ=True,
    # a tiny paced run on a shared CPU exercises the study, it measures no fidelity: kept in its
    # tables however many steps overran (tests/e2e/test_experiments.py judges the pace itself)
    on_vllm=True,  # against vLLM: its real points on vLLM, its simulated ones on a profile of vLLM
    tiny=(
        "experiment.rates=[20]",
        "experiment.modes=[chunked]",
        "hardware.emulate=h100_sxm",
        "hardware.emulate_model=llama3_8b",
        "hardware.max_overrun_share=1",
    ),
    keys=("modes",),
)
