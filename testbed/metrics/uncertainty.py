"""Stated uncertainty, with the run as the independent unit.

Gaps of one batch share a step and requests of one run share a queue, so neither is an
independent sample; repeats (runs with their own seeds) are. Every interval here therefore
varies whole units: the runs of a cell, or, for a single run, contiguous batches of its requests
in arrival order (the method of batch means). The estimator is the grouped (delete-one-unit)
jackknife with Student's t on units - 1 degrees of freedom:

    estimate  = f(all units pooled)                  the same f for the figure and its interval
    pseudo_i  = f(all units but i)
    se        = sqrt((R - 1) / R * sum_i (pseudo_i - mean(pseudo))^2)
    interval  = estimate -/+ t_{R-1, 0.975} se        clipped to the figure's range

For a mean with equal units it is Student's t over the units' means; for a pooled percentile it
carries both the within-run and the across-run variation. A percentile has one definition,
numpy's linear interpolation, for the estimate and every pseudo-value; a tail that the pooled
sample cannot estimate (fewer than MIN_TAIL values beyond it) is marked, not narrowed.
Configurations share seeds, so they are compared by paired per-seed differences (comparisons.py).

References: Efron and Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 11 (jackknife);
Kalibera and Jones, "Rigorous benchmarking in reasonable time" (ISMM 2013), runs as the unit;
Le Boudec, "Performance Evaluation of Computer and Communication Systems" (2010), ch. 2 (quantile
intervals) and batch means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from testbed.metrics.config import SLOConfig
from testbed.metrics.latency import itl_steps, pooled_itl
from testbed.metrics.slo import filtered_out, meets_slo

CONFIDENCE = 0.95
TAIL = 0.025  # a quantile is estimable when its distribution-free 95% interval exists (see estimable)
BATCHES = 5  # one run: its requests cut into this many arrival-ordered batches
AUTOCORRELATION = 0.5  # a single run's batches correlated beyond this lag-1 value are named
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
NOT_ESTIMABLE = "not estimable"
SAMPLE_EDGE = "at the sample's edge"  # a quantile interval that reached the pooled sample's extreme
ONE_RUN = "within one run"  # a single run's interval: over batches of its requests, not over runs
LATENCY = (0.0, math.inf)
SHARE = (0.0, 1.0)


@dataclass(frozen=True)
class Interval:
    """A figure, its 95% interval and what stands behind it; unpacks as (estimate, low, high)."""

    estimate: float
    low: float = math.nan
    high: float = math.nan
    units: int = 0  # independent units the interval varies (runs, or batches of one run)
    note: str = ""  # "" | NOT_ESTIMABLE | SAMPLE_EDGE | ONE_RUN[...] | "one unit"

    def __iter__(self) -> Iterator[float]:
        return iter((self.estimate, self.low, self.high))

    @property
    def known(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))


def statistic(values, name: str) -> float:
    """`name` ("mean", "p50", "p99", ...) of the values, NaN dropped; NaN when none are left."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if not x.size:
        return math.nan
    return float(x.mean()) if name == "mean" else float(np.percentile(x, 100 * QUANTILES[name]))


def estimable(n: int, name: str) -> bool:
    """Can n values bound this figure at 95%? A quantile q needs the sample's extreme to pass it
    with probability >= 97.5% even for independent values: max(q, 1 - q)^n <= 0.025, so p50
    needs 6 values and p99 368 (Le Boudec, section 2.2.1); fewer give no interval, not a narrow one."""
    q = QUANTILES.get(name)
    return n >= 2 if q is None else max(q, 1 - q) ** n <= TAIL


def order_interval(values: np.ndarray, q: float, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free interval of the q-quantile of independent values: the order
    statistics whose ranks bound Binomial(n, q) (Le Boudec, theorem 2.1)."""
    from scipy import stats

    x = np.sort(values)
    n, tail = x.size, (1 - confidence) / 2
    low = int(stats.binom.ppf(tail, n, q))  # P(Binomial < low + 1) >= tail: x_(low) (1-based) lies below
    high = int(stats.binom.ppf(1 - tail, n, q)) + 1
    return float(x[max(low - 1, 0)]), float(x[min(high - 1, n - 1)])


def jackknife(
    units: Sequence,
    estimator: Callable[[Sequence], float],
    bounds=(-math.inf, math.inf),
    confidence: float = CONFIDENCE,
) -> Interval:
    """The grouped jackknife of `estimator` (units -> figure) over the units, Student's t on
    len(units) - 1 degrees of freedom, clipped to `bounds`. One unit: no interval."""
    estimate = estimator(units)
    r = len(units)
    if r < 2 or math.isnan(estimate):
        return Interval(estimate, units=r, note="one unit" if r == 1 else "")
    pseudo = np.array([estimator([u for j, u in enumerate(units) if j != i]) for i in range(r)])
    if np.isnan(pseudo).any():
        return Interval(estimate, units=r, note=NOT_ESTIMABLE)
    se = math.sqrt((r - 1) / r * float(np.sum((pseudo - pseudo.mean()) ** 2)))
    half = t_quantile(confidence, r - 1) * se
    return Interval(estimate, max(estimate - half, bounds[0]), min(estimate + half, bounds[1]), r)


def t_quantile(confidence: float, df: int) -> float:
    from scipy import stats  # here, not at import: scipy adds a second to every command's start

    return float(stats.t.ppf(0.5 + confidence / 2, df))


def sample_interval(units: Sequence, name: str, bounds=LATENCY, draws: Optional[Sequence[int]] = None) -> Interval:
    """`name` of the units' values pooled, and its interval over the units (arrays of values).

    A mean: the grouped jackknife (Student's t over the units). A quantile: Woodruff's interval
    over the units (woodruff), never narrower than the order statistics' interval of the pooled
    values. A quantile is estimable only when the smallest pseudo-sample (every unit but the
    largest) could bound it; `draws`: each unit's independent draws where they are fewer than its
    values (the ITL gaps of one decode step are one draw of its time, not a batch's worth)."""
    arrays = [np.asarray(u, dtype=np.float64) for u in units]
    arrays = [a[~np.isnan(a)] for a in arrays]
    arrays = [a for a in arrays if a.size] or arrays[:1]
    pooled = np.concatenate(arrays) if arrays else np.array([])
    estimate = statistic(pooled, name)
    if name == "mean":
        return (
            jackknife(arrays, lambda parts: statistic(np.concatenate(parts), name), bounds)
            if estimable(pooled.size, name)
            else Interval(estimate, units=len(arrays), note=NOT_ESTIMABLE)
        )
    if not estimable(_smallest_pseudo_sample([a.size for a in arrays] if draws is None else list(draws)), name):
        return Interval(estimate, units=len(arrays), note=NOT_ESTIMABLE)
    runs = woodruff(arrays, QUANTILES[name], bounds)
    if not runs.known:
        return runs
    # a tail the runs happen to agree on is still bounded by its order statistics: the hull of both
    low, high = order_interval(pooled, QUANTILES[name])
    return replace(runs, low=min(runs.low, low), high=max(runs.high, high))


def _smallest_pseudo_sample(sizes: list[int]) -> int:
    """The values left when the largest unit is deleted (the jackknife's smallest sample)."""
    return sum(sizes) - max(sizes) if len(sizes) > 1 else sum(sizes)


def woodruff(arrays: list[np.ndarray], q: float, bounds=LATENCY, confidence: float = CONFIDENCE) -> Interval:
    """Woodruff's interval of the pooled q-quantile, with the run as the unit: the share of each
    run's values at or below the pooled quantile is a smooth statistic (a ratio of counts), so its
    grouped jackknife over the runs is trusted where a quantile's is not; the share's interval
    around q is mapped back to the pooled sample's order statistics, outward (Woodruff 1952;
    Francisco and Fuller 1991; the outward rounding offsets a high quantile's low bias in small
    samples). A share past the sample's ends reaches its extreme value and is marked SAMPLE_EDGE."""
    pooled = np.sort(np.concatenate(arrays))
    n = pooled.size
    estimate = float(np.percentile(pooled, 100 * q))
    counts = [(float(np.sum(a <= estimate)), a.size) for a in arrays]
    share = jackknife(counts, lambda parts: sum(c for c, _ in parts) / sum(m for _, m in parts), confidence=confidence)
    if not share.known:
        return Interval(estimate, units=share.units, note=share.note)
    low, high = q - (share.estimate - share.low), q + (share.high - share.estimate)
    # a share past the sample's ends maps to its extreme value, which bounds nothing beyond it: said
    note = SAMPLE_EDGE if low < 1 / n or high > 1 - 1 / n else ""
    low_x = float(pooled[min(max(math.floor(n * low) - 1, 0), n - 1)])
    high_x = float(pooled[min(max(math.ceil(n * high), 0), n - 1)])
    return Interval(estimate, max(low_x, bounds[0]), min(high_x, bounds[1]), share.units, note)


def ratio_interval(units_a: Sequence, units_b: Sequence, name: str = "p99") -> Interval:
    """`name` of a's values pooled over `name` of b's, the units paired (a unit is one run, and
    a[i] and b[i] come from the same one), its interval over the units."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in zip(units_a, units_b)]
    na, nb = (sum(p[k].size for p in pairs) for k in (0, 1))

    def ratio(parts) -> float:
        if not parts:
            return math.nan
        top, bottom = (statistic(np.concatenate([p[k] for p in parts]), name) for k in (0, 1))
        return top / bottom if bottom > 0 else math.nan

    if not (estimable(na, name) and estimable(nb, name)):
        return Interval(ratio(pairs), units=len(pairs), note=NOT_ESTIMABLE)
    return jackknife([p for p in pairs if p[0].size and p[1].size], ratio, (0.0, math.inf))


def share_interval(units: Sequence) -> Interval:
    """A share (SLO attainment) of the units' 0/1 outcomes pooled: the jackknife over units on
    the logit scale (a share near 0 or 1 is skewed across runs, and a t interval on the raw scale
    under-covers there), widened to at least Wilson's score interval of the pooled count (a
    share of 100% from a few hundred requests is not known to be exactly 1)."""
    arrays = [np.asarray(u, dtype=np.float64) for u in units if len(u)]
    hits, n = sum(float(a.sum()) for a in arrays), sum(a.size for a in arrays)
    if not n:
        return Interval(math.nan)
    runs = logit_share([(float(a.sum()), a.size) for a in arrays])
    if runs.note:
        return runs
    low, high = wilson(hits, n)
    return Interval(runs.estimate, min(runs.low, low), max(runs.high, high), runs.units)


def logit_share(counts: Sequence[tuple[float, int]], confidence: float = CONFIDENCE) -> Interval:
    """The pooled share of (hits, n) per unit and its interval: the grouped jackknife of its logit
    (half a hit added each way, so 0 and 1 stay finite), mapped back to [0, 1]."""
    share = sum(c for c, _ in counts) / sum(n for _, n in counts)
    logit = lambda parts: _logit((sum(c for c, _ in parts) + 0.5) / (sum(n for _, n in parts) + 1))  # noqa: E731
    scale = jackknife(list(counts), logit, confidence=confidence)
    if not scale.known:
        return Interval(share, units=scale.units, note=scale.note)
    half = scale.high - scale.estimate
    return Interval(
        share,
        _expit(_logit(share_in(share, counts)) - half),
        _expit(_logit(share_in(share, counts)) + half),
        scale.units,
    )


def share_in(share: float, counts: Sequence[tuple[float, int]]) -> float:
    """The share kept off 0 and 1 by half a hit (as the logit's jackknife sees it)."""
    n = sum(m for _, m in counts)
    return (share * n + 0.5) / (n + 1)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _expit(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def wilson(hits: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson's score interval of a binomial share."""
    from scipy import stats

    z = float(stats.norm.ppf(0.5 + confidence / 2))
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], bounds=(-math.inf, math.inf)) -> Interval:
    """Student's t interval of the mean of one value per unit (a goodput per repeat)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if not x.size:
        return Interval(math.nan)
    return jackknife(list(x), lambda v: float(np.mean(v)), bounds)


# -- a cell's requests, as units -----------------------------------------------------------------
def request_units(requests: pd.DataFrame, run_column: str = "point") -> list[pd.DataFrame]:
    """The independent units of a cell's requests: one per run (`run_column` tells them apart),
    or with a single run, BATCHES contiguous batches of its requests in arrival order."""
    if run_column in requests.columns and requests[run_column].nunique() > 1:
        return [rows for _, rows in requests.groupby(run_column, sort=True)]
    ordered = requests.sort_values("arrival_s", kind="stable") if "arrival_s" in requests.columns else requests
    cuts = np.array_split(np.arange(len(ordered)), min(BATCHES, max(len(ordered), 1)))
    return [ordered.iloc[c] for c in cuts if c.size]


def point_intervals(
    requests: pd.DataFrame, slo: SLOConfig, tenants: Optional[Mapping[str, SLOConfig]] = None, run_column: str = "point"
) -> dict[str, Interval]:
    """{figure: Interval} of one cell, its repeats' requests (warm-up left out) told apart by
    `run_column`: p50 and p99 of TTFT, TPOT and ITL over the ok requests (ITL over every gap), and
    SLO attainment over every request that counts for it (see slo_attainment). A single run's
    intervals vary batches of its requests and say so (ONE_RUN, with their autocorrelation)."""
    units = request_units(requests, run_column)
    ok = [u[u["status"] == "ok"] for u in units]
    samples = {
        "ttft": [u["ttft"].to_numpy(np.float64) for u in ok],
        "tpot": [u["tpot"].to_numpy(np.float64) for u in ok],
        "itl": [pooled_itl(u) for u in ok],
    }
    steps = [itl_steps(u) for u in ok]  # ITL: one draw per decode step, however many gaps it has
    out = {
        f"{metric}_{stat}": sample_interval(values, stat, draws=steps if metric == "itl" else None)
        for metric, values in samples.items()
        for stat in ("p50", "p99")
    }
    counted = [u[~filtered_out(u)] for u in units]
    hits = [meets_slo(u, slo, tenants).to_numpy(np.float64) for u in counted if len(u)]
    out["slo_attainment"] = share_interval(hits)
    if _one_run(requests, run_column):
        batches = {
            **{f"{m}_{s}": [statistic(v, s) for v in values] for m, values in samples.items() for s in ("p50", "p99")},
            "slo_attainment": [float(np.mean(h)) for h in hits],
        }
        out = {k: _within_one_run(v, batches[k]) for k, v in out.items()}
    return out


def _one_run(requests: pd.DataFrame, run_column: str) -> bool:
    return run_column not in requests.columns or requests[run_column].nunique() <= 1


def _within_one_run(interval: Interval, batch_values: Sequence[float]) -> Interval:
    """A single run's interval, labelled: batch means assume batches nearly independent, so a
    lag-1 autocorrelation above AUTOCORRELATION is named (the interval is then too narrow)."""
    if interval.note == NOT_ESTIMABLE or not interval.known:
        return interval
    r1 = lag1(batch_values)
    note = ONE_RUN if not r1 > AUTOCORRELATION else f"{ONE_RUN}; batches correlated (lag-1 {r1:.2f})"
    return replace(interval, note=note if not interval.note else f"{note}; {interval.note}")


def lag1(values: Sequence[float]) -> float:
    """The lag-1 autocorrelation of a sequence (NaN when it has no spread)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)] - np.nanmean(x) if x.size else x
    denominator = float(np.sum(x * x))
    return float(np.sum(x[1:] * x[:-1]) / denominator) if x.size > 2 and denominator > 0 else math.nan


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Do two intervals overlap? An unknown (NaN) bound counts as overlapping: nothing is claimed."""
    if any(math.isnan(v) for v in (*a, *b)):
        return True
    return a[0] <= b[1] and b[0] <= a[1]
