"""SLO attainment, and the sweep-level figures built on it: goodput (DistServe) and capacity
(Sarathi-Serve)."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from testbed.metrics.config import SLOConfig


def tenant_slos(tenants: Iterable, default: SLOConfig) -> dict[str, SLOConfig]:
    """{tenant name: SLOConfig} from objects with name, ttft_s, tpot_s (e.g. workload
    TenantConfig); a None field falls back to the run's SLO."""
    out = {}
    for t in tenants:
        out[t.name] = SLOConfig(
            ttft_s=default.ttft_s if t.ttft_s is None else t.ttft_s,
            tpot_s=default.tpot_s if t.tpot_s is None else t.tpot_s,
        )
    return out


def meets_slo(
    table: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]] = None, scale: float = 1.0
) -> pd.Series:
    """Per request: status ok and TTFT <= ttft_s and TPOT <= tpot_s (both SLOs times `scale`).
    A request with a single output token has no TPOT and meets that half. A tenant listed in
    `tenants` is judged by its own SLOs."""
    ttft_slo, tpot_slo = (limit * scale for limit in _slo_limits(table, slo, tenants))
    ttft = table["ttft"].to_numpy(dtype=np.float64)
    tpot = table["tpot"].to_numpy(dtype=np.float64)
    single = table["num_tokens"].to_numpy() <= 1
    ok = table["status"].to_numpy() == "ok"
    with np.errstate(invalid="ignore"):
        meets = ok & (ttft <= ttft_slo) & (single | (tpot <= tpot_slo))
    return pd.Series(meets, index=table.index)


def _slo_limits(
    table: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]]
) -> tuple[np.ndarray, np.ndarray]:
    """Per request: its (TTFT, TPOT) SLO, its tenant's when listed. Looked up once per tenant,
    not per request (a 100k-request table has a handful of tenants)."""
    if not tenants:
        return np.full(len(table), slo.ttft_s, dtype=np.float64), np.full(len(table), slo.tpot_s, dtype=np.float64)
    codes, names = pd.factorize(table["tenant"], use_na_sentinel=False)
    chosen = [tenants.get(name, slo) for name in names]
    ttft = np.array([s.ttft_s for s in chosen], dtype=np.float64)
    tpot = np.array([s.tpot_s for s in chosen], dtype=np.float64)
    return ttft[codes], tpot[codes]


def filtered_out(table: pd.DataFrame) -> pd.Series:
    """Requests the workload's overlength filter refused before serving (the same in every mode):
    the only ones attainment leaves out. A table without `refused_by` predates admission control
    being told apart, and counts every rejection as the filter's."""
    rejected = table["status"] == "rejected"
    if "refused_by" not in table.columns:
        return rejected
    return rejected & (table["refused_by"] != "admission")


def slo_attainment(
    table: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]] = None, scale: float = 1.0
) -> float:
    """Share of requests meeting their SLOs among every request that arrived, except those the
    workload's overlength filter refused (reported as a count instead). Failed requests and requests
    refused by admission control count as misses: shedding load must not look good. NaN with no
    requests."""
    served = table[~filtered_out(table)]
    if len(served) == 0:
        return float("nan")
    return float(meets_slo(served, slo, tenants, scale).mean())


def attainment_by_tenant(
    table: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]] = None
) -> dict[str, float]:
    return {str(name): slo_attainment(rows, slo, tenants) for name, rows in table.groupby("tenant", sort=True)}


def attainment_curve(
    table: pd.DataFrame, slo: SLOConfig, scales: Sequence[float], tenants: Optional[Mapping[str, SLOConfig]] = None
) -> dict[float, float]:
    """{scale: attainment with both SLOs multiplied by scale} (DistServe's SLO-scale plots)."""
    served = table[~filtered_out(table)]  # once, not once per scale
    return {float(s): slo_attainment(served, slo, tenants, scale=float(s)) for s in scales}


def _highest_passing_rate(rates: Sequence[float], margins: Sequence[float]) -> float:
    """The highest rate whose margin is >= 0, interpolated linearly to where the margin crosses 0
    between it and the next (failing) rate. NaN margins fail."""
    r = np.asarray(rates, dtype=np.float64)
    m = np.nan_to_num(np.asarray(margins, dtype=np.float64), nan=-np.inf)
    order = np.argsort(r, kind="stable")
    r, m = r[order], m[order]
    passing = np.flatnonzero(m >= 0)
    if passing.size == 0:
        return 0.0
    i = int(passing[-1])
    if i == len(r) - 1 or not np.isfinite(m[i + 1]):
        return float(r[i])
    return float(r[i] + m[i] / (m[i] - m[i + 1]) * (r[i + 1] - r[i]))


def goodput(
    rates: Sequence[float], attainments: Sequence[float], threshold: float = 0.9, *, num_gpus: int = 1
) -> float:
    """Highest request rate with SLO attainment >= threshold (DistServe), per GPU when num_gpus > 1.

    Rates need not be sorted. Take the highest swept rate that passes; if a higher rate fails,
    interpolate linearly between the two to where attainment equals the threshold. Edge cases:
    every rate passes -> the highest rate (no extrapolation); none passes -> 0.0. On a
    non-monotonic curve, the highest passing rate wins.
    """
    margins = np.asarray(attainments, dtype=np.float64) - threshold
    return _highest_passing_rate(rates, margins) / num_gpus


def capacity(rates: Sequence[float], p99_itl: Sequence[float], itl_slo: float) -> float:
    """Highest rate whose p99 ITL stays at or under itl_slo (Sarathi-Serve), interpolated like
    goodput: all pass -> the highest rate, none -> 0.0."""
    margins = itl_slo - np.asarray(p99_itl, dtype=np.float64)
    return _highest_passing_rate(rates, margins)
