"""Goodput by search: the rate at which SLO attainment crosses 90%, found by bracketing and
bisecting (as DistServe searches its rates), and stated as a bound when the search could not
bracket it. Pure rules over (rate, attainment) pairs: the real cluster, the simulator and the
tests drive them alike.

    rates tried:  grid ... then  x2 up while all pass | /2 down while none pass   (bracket)
                  then the midpoint of [highest passing, next failing]            (bisect)
    stop:         bracket narrower than `tolerance` of its lower end, or `budget` points used,
                  or the bracket would leave [floor, cap]: the goodput is then censored
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

THRESHOLD = 0.9  # DistServe's attainment for goodput
ABOVE, BELOW = "above", "below"  # censored: every rate tried passes (>= value) / none does (< value)


@dataclass(frozen=True)
class Goodput:
    """One run's goodput: the interpolated crossing, or a bound when censored; `error`: how far
    the true crossing may lie from `value` within the final bracket (linear interpolation)."""

    value: float
    censored: str = ""  # "" | ABOVE | BELOW
    error: float = 0.0

    def text(self, digits: int = 3) -> str:
        sign = {ABOVE: ">= ", BELOW: "< "}.get(self.censored, "")
        return f"{sign}{self.value:.{digits}g}"


@dataclass(frozen=True)
class RateSearch:
    """How far the search may go: `budget` points beyond the grid per configuration and repeat,
    a bracket `tolerance` (relative width) that ends it, and rates within [floor, cap]."""

    budget: int = 4
    tolerance: float = 0.15
    floor: float = 0.0
    cap: float = math.inf


def _sorted(rates: Sequence[float], attainments: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(rates, dtype=np.float64)
    a = np.nan_to_num(np.asarray(attainments, dtype=np.float64), nan=-np.inf)
    order = np.argsort(r, kind="stable")
    return r[order], a[order]


def bracket(rates: Sequence[float], attainments: Sequence[float],
            threshold: float = THRESHOLD) -> tuple[Optional[float], Optional[float]]:
    """(highest passing rate, the lowest failing rate above it); None where there is none."""
    r, a = _sorted(rates, attainments)
    passing = np.flatnonzero(a >= threshold)
    if not passing.size:
        return None, (float(r[0]) if r.size else None)
    i = int(passing[-1])
    return float(r[i]), (float(r[i + 1]) if i + 1 < r.size else None)


def goodput_of(rates: Sequence[float], attainments: Sequence[float], threshold: float = THRESHOLD) -> Goodput:
    """The rate where attainment crosses `threshold`, linearly between the bracket's two rates
    (DistServe), with the bracket's worst-case error; a bound when nothing brackets it."""
    if not len(rates):
        return Goodput(math.nan)
    r, a = _sorted(rates, attainments)
    low, high = bracket(r, a, threshold)
    if low is None:
        return Goodput(float(r[0]), BELOW)
    if high is None:
        return Goodput(low, ABOVE)
    m_low, m_high = float(a[r == low][-1]) - threshold, float(a[r == high][0]) - threshold
    value = low + m_low / (m_low - m_high) * (high - low) if np.isfinite(m_high) else low
    return Goodput(float(value), "", float(max(value - low, high - value)))


def next_rate(rates: Sequence[float], attainments: Sequence[float], search: RateSearch, used: int,
              threshold: float = THRESHOLD) -> Optional[float]:
    """The next rate to try for one configuration and repeat, or None: bracketed tightly enough,
    budget spent, or the bracket would leave [floor, cap] (the goodput stays a bound)."""
    if used >= search.budget or not len(rates):
        return None
    low, high = bracket(rates, attainments, threshold)
    if low is None:
        proposal = high / 2
        return rounded(proposal) if proposal >= search.floor and proposal > 0 else None
    if high is None:
        proposal = low * 2
        return rounded(proposal) if proposal <= search.cap else None
    if (high - low) <= search.tolerance * low:
        return None
    proposal = rounded((low + high) / 2)
    return proposal if low < proposal < high else None


def rounded(rate: float) -> float:
    """Three significant digits: point names stay short and a resumed search proposes the same."""
    return float(f"{rate:.3g}")
