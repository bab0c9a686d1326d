"""Stated uncertainty: bootstrap intervals for one point's figures, intervals across repeats, and
the rule that names a winner only when its interval clears the runner-up's.

Pure functions over tables and arrays (scipy for the bootstrap, the binomial and Student's t),
so the real cluster, the simulator and the analysis code state uncertainty the same way.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from testbed.metrics.config import SLOConfig
from testbed.metrics.latency import pooled_itl
from testbed.metrics.slo import filtered_out, meets_slo

CONFIDENCE = 0.95
RESAMPLES = 1000
NAN_INTERVAL = (math.nan, math.nan)


def bootstrap_interval(values: Sequence[float], statistic: str, *, seed: int = 0,
                       confidence: float = CONFIDENCE, resamples: int = RESAMPLES) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` ("p50", "p99", "mean") of the values; NaN
    values are dropped; fewer than two values give (nan, nan).

    A mean is resampled (scipy.stats.bootstrap). A percentile uses the exact bootstrap
    distribution instead, the limit of infinitely many resamples: the q-quantile of a resample is
    the order statistic x_(j) with P(<= x_(j)) = P(Binomial(n, j/n) >= ceil(q n)), so its
    interval costs one sort, where resampling the tens of thousands of ITL gaps of a run would
    cost minutes."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size < 2:
        return NAN_INTERVAL
    if np.all(x == x[0]):  # a constant sample: the bootstrap distribution is a point
        return float(x[0]), float(x[0])
    from scipy import stats  # here, not at import: scipy adds a second to every command's start

    if statistic in QUANTILES:
        ranks, cdf = _quantile_distribution(x.size, QUANTILES[statistic])
        ordered = np.sort(x)
        tail = (1 - confidence) / 2
        return float(ordered[np.searchsorted(cdf, tail)]), float(ordered[min(np.searchsorted(cdf, 1 - tail), x.size - 1)])
    result = stats.bootstrap((x,), _STATISTICS[statistic], n_resamples=resamples, confidence_level=confidence,
                             method="percentile", vectorized=True, batch=50, random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


QUANTILES = {"p50": 0.50, "p99": 0.99}


def _quantile_distribution(n: int, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(ranks 0..n-1, cdf): the exact bootstrap distribution of the sample q-quantile's rank."""
    from scipy import stats

    m = max(1, math.ceil(q * n))
    ranks = np.arange(n)
    cdf = stats.binom.sf(m - 1, n, (ranks + 1) / n)  # P(at least m of n draws fall at or below x_(j))
    return ranks, np.maximum.accumulate(cdf)


def _quantile_draws(x: np.ndarray, q: float, draws: int, rng: np.random.Generator) -> np.ndarray:
    """`draws` values from the exact bootstrap distribution of the sample q-quantile of x."""
    ordered = np.sort(x)
    _, cdf = _quantile_distribution(x.size, q)
    return ordered[np.minimum(np.searchsorted(cdf, rng.random(draws)), x.size - 1)]


def ratio_interval(a: Sequence[float], b: Sequence[float], statistic: str = "p99", *, seed: int = 0,
                   confidence: float = CONFIDENCE, resamples: int = 4 * RESAMPLES) -> tuple[float, float, float]:
    """(estimate, low, high) of the ratio of a percentile ("p50", "p99") of a to that of b, the two
    samples resampled independently (bootstrap draws from each quantile's exact bootstrap
    distribution); fewer than two values on either side give NaN bounds."""
    x, y = (np.asarray(v, dtype=np.float64) for v in (a, b))
    x, y = x[~np.isnan(x)], y[~np.isnan(y)]
    f = _STATISTICS[statistic]
    if x.size == 0 or y.size == 0 or f(y) <= 0:
        return math.nan, math.nan, math.nan
    estimate = float(f(x) / f(y))
    if x.size < 2 or y.size < 2:
        return estimate, math.nan, math.nan
    rng = np.random.default_rng(seed)
    q = QUANTILES[statistic]
    ratios = _quantile_draws(x, q, resamples, rng) / _quantile_draws(y, q, resamples, rng)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return estimate, float(low), float(high)


def _percentile(q: float):
    return lambda x, axis=-1: np.percentile(x, q, axis=axis)


_STATISTICS = {"p50": _percentile(50), "p99": _percentile(99), "mean": lambda x, axis=-1: np.mean(x, axis=axis)}


def point_intervals(requests: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]] = None,
                    *, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """{figure: (estimate, low, high)} of one point, its repeats' requests pooled (warm-up already
    left out): p50 and p99 of TTFT, TPOT and ITL over the ok requests (ITL over every gap), and SLO
    attainment over every request that counts for it (see slo_attainment); 95% percentile-bootstrap
    intervals."""
    ok = requests[requests["status"] == "ok"]
    samples = {"ttft": ok["ttft"].to_numpy(np.float64), "tpot": ok["tpot"].to_numpy(np.float64),
               "itl": pooled_itl(ok)}
    out = {}
    for metric, values in samples.items():
        for stat in ("p50", "p99"):
            out[f"{metric}_{stat}"] = (_estimate(values, stat), *bootstrap_interval(values, stat, seed=seed))
    counted = requests[~filtered_out(requests)]
    hits = meets_slo(counted, slo, tenants).to_numpy(np.float64) if len(counted) else np.array([])
    out["slo_attainment"] = (_estimate(hits, "mean"), *bootstrap_interval(hits, "mean", seed=seed))
    return out


def _estimate(values: np.ndarray, statistic: str) -> float:
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(_STATISTICS[statistic](x)) if x.size else math.nan


def repeat_interval(values: Sequence[float], confidence: float = CONFIDENCE,
                    bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean over repeats (one value per seed),
    clipped to `bounds` (a goodput lies between 0 and the highest swept rate). One repeat:
    (value, nan, nan); identical values: a zero-width interval."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size == 1:
        return mean, math.nan, math.nan
    from scipy import stats

    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, max(mean - half, bounds[0]), min(mean + half, bounds[1])


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Do two intervals overlap? An unknown (NaN) bound counts as overlapping: nothing is claimed."""
    if any(math.isnan(v) for v in (*a, *b)):
        return True
    return a[0] <= b[1] and b[0] <= a[1]


def verdict(estimates: Mapping[str, tuple[float, float, float]], unit: str = "req/s per GPU") -> dict:
    """The best configuration, named only when its interval clears the runner-up's.

    `estimates`: {label: (mean, low, high)}. Returns {"label", "runner_up", "separated", "line"};
    `label` is the leader by mean either way, and `line` is the sentence to print."""
    ranked = sorted(((v[0], k) for k, v in estimates.items() if not math.isnan(v[0])), reverse=True)
    if not ranked:
        return {"label": None, "runner_up": None, "separated": False, "line": "best configuration: none finished"}
    leader = ranked[0][1]
    if len(ranked) == 1:
        return {"label": leader, "runner_up": None, "separated": True,
                "line": f"best configuration: {leader} ({_fmt(estimates[leader], unit)}; the only one)"}
    runner = ranked[1][1]
    lead, second = estimates[leader], estimates[runner]
    separated = not overlaps(lead[1:], second[1:])
    if separated:
        line = (f"best configuration: {leader} ({_fmt(lead, unit)}), clear of the runner-up {runner} "
                f"({_fmt(second, unit)})")
    else:
        tied = [k for _, k in ranked if overlaps(lead[1:], estimates[k][1:])]
        line = (f"leaders not separated at this sample size: {', '.join(f'{k} ({_fmt(estimates[k], unit)})' for k in tied)}; "
                f"more repeats (experiment.repeats) or requests would be needed to name a best configuration")
    return {"label": leader, "runner_up": runner, "separated": separated, "line": line}


def _fmt(estimate: tuple[float, float, float], unit: str) -> str:
    mean, low, high = estimate
    if math.isnan(low):
        return f"{mean:.2f} {unit}, no interval from one repeat"
    return f"{mean:.2f} [{low:.2f}, {high:.2f}] {unit}"
