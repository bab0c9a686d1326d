"""summary.json's telemetry figures from telemetry.parquet (testbed/tracking/nvml.py's
samples): energy per output token from the GPUs' cumulative energy counters, NVLink bytes from
their cumulative NVLink data counters, and mean GPU / memory-bandwidth / SM utilisation per
worker role. Pure functions; without NVML (no table, or no GPU of the point in it) every figure
is None beside `available: False` and the reason: nothing is estimated in its place.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np
import pandas as pd

# summary key -> telemetry column, averaged over the samples of a role's GPUs
UTILISATION = {
    "util_pct_mean": "util_pct",  # NVML: time a kernel ran (not how many SMs it kept busy)
    "mem_util_pct_mean": "mem_util_pct",  # NVML: time device memory was read or written
    "sm_util_pct_mean": "sm_util_pct",  # GPM (Hopper+): share of SMs busy
    "dram_bw_util_pct_mean": "dram_bw_util_pct",
}  # GPM: DRAM bandwidth used / peak
NOT_RECORDED = "no telemetry recorded (no NVML, or a simulated or imported run)"
POINT_FIGURES = ("energy_j", "energy_per_output_token_j", "nvlink_tx_bytes", "nvlink_rx_bytes")


def gpu_roles(workers: Iterable[tuple[str, str]]) -> dict[int, str]:
    """{CUDA device index: role} of the point's workers, from (device, role) pairs ("cuda:1" -> 1);
    the roles of workers sharing a GPU joined by "+"; CPU workers have no GPU."""
    roles: dict[int, set] = {}
    for device, role in workers:
        kind, _, index = str(device).partition(":")
        if kind == "cuda":
            roles.setdefault(int(index or 0), set()).add(role)
    return {gpu: "+".join(sorted(names)) for gpu, names in sorted(roles.items())}


def counter_delta(readings) -> float:
    """How much a cumulative counter rose over its readings (in time order): the sum of its
    non-negative steps, so a reset or wrap (a drop) adds nothing; NaN under two readings."""
    x = np.asarray(readings, dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size < 2:
        return float("nan")
    steps = np.diff(x)
    return float(steps[steps >= 0].sum())


def telemetry_summary(
    telemetry: Optional[pd.DataFrame], roles: Mapping[int, str], output_tokens: float, reason: str = ""
) -> dict:
    """The point's telemetry figures over the GPUs in `roles` ({GPU index: role}): energy (J, the
    energy counters' rise; None unless every GPU has one), energy per output token, NVLink TX/RX
    bytes (likewise), and per role the mean utilisations of UTILISATION."""
    rows = None if telemetry is None or telemetry.empty else telemetry[telemetry["gpu"].isin(list(roles))]
    if rows is None or rows.empty:
        why = reason or ("no GPU among the point's workers" if telemetry is not None else NOT_RECORDED)
        return _unavailable(roles, why)
    per_gpu = {
        gpu: _gpu_figures(sample.sort_values("t_s", kind="stable")) for gpu, sample in rows.groupby("gpu", sort=True)
    }
    per_gpu.update({gpu: _gpu_figures(rows.iloc[:0]) for gpu in roles if gpu not in per_gpu})
    energy = _total(per_gpu.values(), "energy_j")
    return {
        "available": True,
        "reason": "",
        "gpus": len(roles),
        "samples": int(len(rows)),
        "energy_j": energy,
        "energy_per_output_token_j": _per(energy, output_tokens),
        "nvlink_tx_bytes": _total(per_gpu.values(), "nvlink_tx_bytes"),
        "nvlink_rx_bytes": _total(per_gpu.values(), "nvlink_rx_bytes"),
        "by_role": {
            role: _role_figures(rows, per_gpu, [g for g, r in roles.items() if r == role])
            for role in sorted(set(roles.values()))
        },
    }


def _gpu_figures(samples: pd.DataFrame) -> dict:
    column = lambda name: samples[name] if name in samples else ()  # noqa: E731  (older tables lack it)
    return {
        "energy_j": counter_delta(column("energy_mj")) / 1e3,
        "nvlink_tx_bytes": counter_delta(column("nvlink_tx_kib")) * 1024.0,
        "nvlink_rx_bytes": counter_delta(column("nvlink_rx_kib")) * 1024.0,
    }


def _role_figures(rows: pd.DataFrame, per_gpu: dict, gpus: list[int]) -> dict:
    mine = rows[rows["gpu"].isin(gpus)]
    means = {key: _mean(mine[name]) if name in mine else None for key, name in UTILISATION.items()}
    return {"gpus": len(gpus), **means, "energy_j": _total([per_gpu[g] for g in gpus], "energy_j")}


def _total(figures: Iterable[dict], key: str) -> Optional[float]:
    values = [f[key] for f in figures]
    return float(sum(values)) if values and not any(np.isnan(values)) else None


def _per(total: Optional[float], count: float) -> Optional[float]:
    return total / count if total is not None and count > 0 else None


def _mean(values: pd.Series) -> Optional[float]:
    x = pd.to_numeric(values, errors="coerce").to_numpy(np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else None


def _unavailable(roles: Mapping[int, str], reason: str) -> dict:
    by_role = {
        role: {"gpus": sum(1 for r in roles.values() if r == role), **dict.fromkeys(UTILISATION), "energy_j": None}
        for role in sorted(set(roles.values()))
    }
    return {
        "available": False,
        "reason": reason,
        "gpus": len(roles),
        "samples": 0,
        **dict.fromkeys(POINT_FIGURES),
        "by_role": by_role,
    }
