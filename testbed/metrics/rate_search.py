"""Goodput by search: the rate at which SLO attainment crosses 90%, read off a monotone fit of
every rate a repeat tried, and stated as a bound when no rate tried brackets it. Pure rules over
(rate, attainment, requests) triples: the real cluster, the simulator and the tests drive them alike.

    fit:        attainment against rate, made non-increasing by weighted isotonic regression
                (pool adjacent violators, each point weighted by its requests); a repeat whose
                attainment rose with rate by more than its binomial noise is reported
    goodput:    linear between the fitted curve's bracket [highest rate >= 90%, next rate]; its
                search error the worst case within that bracket (the crossing lies inside it)
    next rate:  x2 up while all pass | /2 down while none pass                     (bracket)
                far from the crossing: the fitted estimate kept off the bracket's ends
                near it: a step of tolerance/2 past the estimate toward the wider side,
                so the next point closes that side                                  (straddle)
    stop:       search error within `tolerance` of the goodput, `budget` points used, or the
                bracket would leave [floor, cap]: the goodput is then censored
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

THRESHOLD = 0.9  # DistServe's attainment for goodput
ABOVE, BELOW = "above", "below"  # censored: every rate tried passes (>= value) / none does (< value)
NOISE_SD = 2.0  # a rise of attainment with rate beyond this many binomial sds is non-monotone
FAR = 4.0  # a bracket wider than FAR x the tolerated error is searched by guarded estimates
GUARD = 0.25  # ... which keep this share of the bracket's width from each end


@dataclass(frozen=True)
class Goodput:
    """One run's goodput: the fitted crossing, or a bound when censored; `error`: how far the true
    crossing may lie from `value` within the fitted curve's bracket; `monotone`: False when the
    repeat's attainment rose with rate by more than its noise (the fit pooled it)."""

    value: float
    censored: str = ""  # "" | ABOVE | BELOW
    error: float = 0.0
    monotone: bool = True

    def text(self, digits: int = 3) -> str:
        sign = {ABOVE: ">= ", BELOW: "< "}.get(self.censored, "")
        return f"{sign}{self.value:.{digits}g}"


@dataclass(frozen=True)
class RateSearch:
    """How far the search may go: `budget` points beyond the grid per configuration and repeat,
    the relative search error (`tolerance`) that ends it, and rates within [floor, cap]."""

    budget: int = 4
    tolerance: float = 0.15
    floor: float = 0.0
    cap: float = math.inf


@dataclass(frozen=True)
class Curve:
    """Attainment against rate, one entry per distinct rate (rising), fitted non-increasing."""

    rates: np.ndarray
    observed: np.ndarray
    fitted: np.ndarray
    weights: np.ndarray
    monotone: bool


def monotone_fit(
    rates: Sequence[float], attainments: Sequence[float], weights: Optional[Sequence[float]] = None
) -> Curve:
    """Weighted isotonic regression (pool adjacent violators), non-increasing in rate; repeated
    rates are merged first. NaN attainment (nothing finished) counts as 0."""
    r = np.asarray(rates, dtype=np.float64)
    a = np.nan_to_num(np.asarray(attainments, dtype=np.float64), nan=0.0)
    w = np.ones_like(r) if weights is None else np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=1.0)
    w = np.where(w > 0, w, 1.0)
    distinct, index = np.unique(r, return_inverse=True)
    weight = np.bincount(index, w, distinct.size)
    observed = np.bincount(index, w * a, distinct.size) / weight
    fitted = _pava_decreasing(observed, weight)
    return Curve(distinct, observed, fitted, weight, _monotone(observed, weight))


def _pava_decreasing(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    blocks: list[list[float]] = []  # [weighted mean, weight, points]
    for value, weight in zip(y, w):
        blocks.append([float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return np.concatenate([np.full(n, m) for m, _, n in blocks]) if blocks else np.array([])


def _monotone(observed: np.ndarray, weight: np.ndarray) -> bool:
    """No rise between two rates (any two, the lower first) beyond NOISE_SD binomial sds."""
    for i in range(observed.size):
        for j in range(i + 1, observed.size):
            p = min(max((observed[i] + observed[j]) / 2, 0.05), 0.95)
            sd = math.sqrt(p * (1 - p) * (1 / weight[i] + 1 / weight[j]))
            if observed[j] - observed[i] > NOISE_SD * sd:
                return False
    return True


def bracket(
    rates: Sequence[float],
    attainments: Sequence[float],
    threshold: float = THRESHOLD,
    weights: Optional[Sequence[float]] = None,
) -> tuple[Optional[float], Optional[float]]:
    """(highest rate the fit passes, the next rate above it); None where there is none."""
    curve = monotone_fit(rates, attainments, weights)
    return _bracket(curve, threshold)


def _bracket(curve: Curve, threshold: float) -> tuple[Optional[float], Optional[float]]:
    passing = np.flatnonzero(curve.fitted >= threshold)
    if not curve.rates.size:
        return None, None
    if not passing.size:
        return None, float(curve.rates[0])
    i = int(passing[-1])
    return float(curve.rates[i]), (float(curve.rates[i + 1]) if i + 1 < curve.rates.size else None)


def goodput_of(
    rates: Sequence[float],
    attainments: Sequence[float],
    threshold: float = THRESHOLD,
    weights: Optional[Sequence[float]] = None,
) -> Goodput:
    """The rate where the fitted attainment crosses `threshold`, linearly within its bracket
    (DistServe's interpolation, on the monotone fit), with the bracket's worst-case error; a
    bound when nothing brackets it. `weights`: each point's requests."""
    if not len(rates):
        return Goodput(math.nan)
    curve = monotone_fit(rates, attainments, weights)
    low, high = _bracket(curve, threshold)
    if low is None:
        return Goodput(high, BELOW, monotone=curve.monotone)
    if high is None:
        return Goodput(low, ABOVE, monotone=curve.monotone)
    a_low, a_high = (float(curve.fitted[curve.rates == x][0]) - threshold for x in (low, high))
    value = low + a_low / (a_low - a_high) * (high - low)
    return Goodput(float(value), "", float(max(value - low, high - value)), curve.monotone)


def next_rate(
    rates: Sequence[float],
    attainments: Sequence[float],
    search: RateSearch,
    used: int,
    threshold: float = THRESHOLD,
    weights: Optional[Sequence[float]] = None,
) -> Optional[float]:
    """The next rate to try for one configuration and repeat, or None: the search error is within
    the tolerance, the budget is spent, or the bracket would leave [floor, cap] (a bound stays)."""
    if used >= search.budget or not len(rates):
        return None
    low, high = bracket(rates, attainments, threshold, weights)
    if low is None:
        proposal = high / 2
        return rounded(proposal) if proposal >= search.floor and proposal > 0 else None
    if high is None:
        proposal = low * 2
        return rounded(proposal) if proposal <= search.cap else None
    g = goodput_of(rates, attainments, threshold, weights)
    if g.error <= search.tolerance * g.value:
        return None
    proposal = rounded(_inside(low, high, g.value, search.tolerance))
    return proposal if low < proposal < high else None


def _inside(low: float, high: float, estimate: float, tolerance: float) -> float:
    """Where a point narrows the crossing most: far from it, the estimate kept GUARD of the width
    off either end (a cliff-shaped curve misleads linear interpolation); near it, half the
    tolerated error past the estimate on the wider side, so that side closes."""
    width = high - low
    if width > FAR * tolerance * estimate:
        return min(max(estimate, low + GUARD * width), high - GUARD * width)
    step = tolerance * estimate / 2
    wider_above = high - estimate >= estimate - low
    proposal = estimate + step if wider_above else estimate - step
    return min(max(proposal, low + width / 8), high - width / 8)


def rounded(rate: float) -> float:
    """Three significant digits: point names stay short and a resumed search proposes the same."""
    return float(f"{rate:.3g}")
