"""Comparing configurations: paired per-seed differences, and the verdict that names a winner.

The configurations of a study share seeds (common random numbers: the same arrivals and lengths
per seed), so the difference of two configurations is measured per seed and its Student's t
interval is far narrower than two independent intervals would allow. A winner is named only when
the paired interval of its lead over every other configuration excludes zero. A censored value
(a goodput that is a bound) takes part only where the bound points the claim's way: a leader
known to be >= x still leads by at least its bound; a runner-up known to be < x trails by more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import numpy as np

from testbed.metrics.rate_search import ABOVE, BELOW, Goodput
from testbed.metrics.uncertainty import Interval, mean_interval, t_quantile

MAX_REPEATS = 200  # beyond this, "repeats to separate" says the effect is too small to chase


@dataclass(frozen=True)
class Comparison:
    leader: str
    other: str
    difference: Interval  # leader minus other, mean over shared seeds
    seeds: int
    separated: bool
    repeats_needed: Optional[int]  # repeats for 80% power at this effect, the spread at its upper bound
    censored: bool  # a bound pointing the wrong way took part: no claim
    bound: bool = False  # a bound pointing the claim's way took part: the lead is at least `difference.low`
    detectable: float = math.nan  # the smallest lead these seeds detect with 80% power (same units)
    search_error: float = 0.0  # both sides' mean search error: what the interval was widened by


def paired(leader: Mapping[int, Goodput], other: Mapping[int, Goodput]) -> tuple[Interval, bool, np.ndarray]:
    """(interval of the mean per-seed difference leader - other, whether a censored value points
    against the claim, the differences) over the seeds both have; a bound's value stands in for it. The interval
    is widened by the mean search error of both (each crossing lies within its fitted bracket)."""
    seeds = sorted(set(leader) & set(other))
    diffs = [leader[s].value - other[s].value for s in seeds]
    against = any(leader[s].censored == BELOW or other[s].censored == ABOVE for s in seeds)
    return widened(mean_interval(diffs), search_error(leader, other)), against, np.array(diffs)


def search_error(leader: Mapping[int, Goodput], other: Mapping[int, Goodput]) -> float:
    """The mean over shared seeds of both configurations' search errors (each repeat's own)."""
    seeds = sorted(set(leader) & set(other))
    return float(np.mean([leader[s].error + other[s].error for s in seeds])) if seeds else 0.0


def toward(leader: Mapping[int, Goodput], other: Mapping[int, Goodput]) -> bool:
    """Did a bound pointing the claim's way take part (leader >= x, or other < x)? Then the lead
    is at least the interval's low end, and no more is known."""
    return any(leader[s].censored == ABOVE or other[s].censored == BELOW for s in set(leader) & set(other))


def widened(interval: Interval, error: float, bounds=(-math.inf, math.inf)) -> Interval:
    """The interval grown by `error` on each side (an interpolation's worst case)."""
    if not interval.known or not error:
        return interval
    return replace(interval, low=max(interval.low - error, bounds[0]), high=min(interval.high + error, bounds[1]))


POWER = 0.8  # "how many repeats" plans for this power
SPREAD_BOUND = 0.9  # ... with the per-seed spread at this one-sided upper confidence bound


def spread_bound(diffs: np.ndarray) -> float:
    """An upper confidence bound on the sd of the per-seed differences (chi-square), not the
    sample sd: planning on the observed spread gives about 50% power, half the time less."""
    from scipy import stats

    n = len(diffs)
    if n < 2:
        return math.nan
    sd = float(np.std(diffs, ddof=1))
    return sd * math.sqrt((n - 1) / float(stats.chi2.ppf(1 - SPREAD_BOUND, n - 1)))


def _margin(sd: float, n: int, confidence: float) -> float:
    """The lead a paired t interval over n seeds separates with POWER, per unit of spread."""
    return (t_quantile(confidence, n - 1) + t_quantile(2 * POWER - 1, n - 1)) * sd / math.sqrt(n)


def repeats_to_separate(diffs: np.ndarray, error: float = 0.0, confidence: float = 0.95) -> Optional[int]:
    """The smallest number of repeats that separates the observed mean lead with 80% power, the
    spread at its 90% upper bound and the interval widened by the search `error`; None if no
    spread is known, the lead does not exceed the error, or it takes more than MAX_REPEATS."""
    mean, sd = abs(float(np.mean(diffs))), spread_bound(diffs)
    if not (sd > 0) or mean <= error:
        return None
    for n in range(2, MAX_REPEATS + 1):
        if _margin(sd, n, confidence) + error < mean:
            return n
    return None


def detectable(diffs: np.ndarray, error: float = 0.0, confidence: float = 0.95) -> float:
    """The smallest lead these seeds separate with 80% power (spread at its upper bound, plus
    the search error): what a study of this size can tell apart."""
    sd = spread_bound(diffs)
    return _margin(sd, len(diffs), confidence) + error if sd == sd else math.nan


def compare(values: Mapping[str, Mapping[int, Goodput]]) -> list[Comparison]:
    """The leader by mean value against every other configuration, paired by seed."""
    means = {k: float(np.mean([g.value for g in v.values()])) for k, v in values.items() if v}
    ranked = sorted(means, key=means.get, reverse=True)
    if len(ranked) < 2:
        return []
    leader = ranked[0]
    out = []
    for other in ranked[1:]:
        interval, against, diffs = paired(values[leader], values[other])
        error = search_error(values[leader], values[other])
        separated = interval.known and interval.low > 0 and not against
        out.append(
            Comparison(
                leader,
                other,
                interval,
                len(diffs),
                separated,
                None if separated else repeats_to_separate(diffs, error),
                against,
                toward(values[leader], values[other]),
                detectable(diffs, error),
                error,
            )
        )
    return out


def verdict(values: Mapping[str, Mapping[int, Goodput]], unit: str = "req/s per GPU") -> dict:
    """{"label", "runner_up", "separated", "line", "comparisons"}: the leader by mean, named the
    best only when its paired lead over every other configuration excludes zero."""
    comparisons = compare(values)
    if not comparisons:
        label = next((k for k, v in values.items() if v), None)
        line = f"best configuration: {label} (the only one)" if label else "best configuration: none finished"
        return {"label": label, "runner_up": None, "separated": label is not None, "line": line, "comparisons": []}
    leader, runner = comparisons[0].leader, comparisons[0].other
    separated = all(c.separated for c in comparisons)
    if separated:
        line = (
            f"best configuration: {leader}, ahead of the runner-up {runner} by "
            f"{_difference(comparisons[0], unit)} (paired over {comparisons[0].seeds} seeds)"
        )
    else:
        tied = [c.other for c in comparisons if not c.separated]
        line = (
            f"leaders not separated at this sample size: {leader} vs {', '.join(tied)} "
            f"(paired differences above; experiment.repeats sets the repeats)"
        )
    return {
        "label": leader,
        "runner_up": runner,
        "separated": separated,
        "line": line,
        "comparisons": [comparison_row(c) for c in comparisons],
    }


def comparison_row(c: Comparison) -> dict:
    d = c.difference
    return {
        "leader": c.leader,
        "other": c.other,
        "difference": d.estimate,
        "difference_low": d.low,
        "difference_high": d.high,
        "seeds": c.seeds,
        "separated": c.separated,
        "repeats_needed": c.repeats_needed,
        "censored_against": c.censored,
        "bound": c.bound,
        "detectable": c.detectable,
        "search_error": c.search_error,
    }


def _difference(c: Comparison, unit: str) -> str:
    d = c.difference
    if c.bound:
        return f">= {d.low:.3g} {unit} (a bound: a censored goodput took part)"
    return f"{d.estimate:.3g} [{d.low:.3g}, {d.high:.3g}] {unit}"


def comparison_lines(rows: list[dict], unit: str = "req/s per GPU") -> list[str]:
    """The final table: per comparison, the paired difference (widened by both search errors),
    separated or not, and for one that is not, the repeats for 80% power at the observed lead
    (spread at its upper bound) or, where no number of repeats would do, the smallest lead
    these seeds detect."""
    if not rows:
        return []
    lines = [f"{'comparison':>26} {'paired difference (' + unit + ')':>36} {'seeds':>5}  verdict"]
    for r in rows:
        low, high = r["difference_low"], r["difference_high"]
        if r.get("bound") and not math.isnan(low):  # a censored goodput took part: a lower bound, no more
            text = f">= {low:.3g} (bound)"
        else:
            text = (
                f"{r['difference']:.3g} [{low:.3g}, {high:.3g}]"
                if not math.isnan(low)
                else f"{r['difference']:.3g} [no interval]"
            )
        if r["separated"]:
            verdict_text = "separated"
        elif r["censored_against"]:
            verdict_text = "not separated (a censored goodput points against it)"
        elif r["repeats_needed"]:
            verdict_text = (
                f"not separated ({r['repeats_needed']} repeats for 80% power at this lead, "
                f"spread at its 90% upper bound)"
            )
        elif r.get("detectable", math.nan) == r.get("detectable", math.nan):
            verdict_text = f"not separated (these seeds detect a lead of {r['detectable']:.3g} or more)"
        else:
            verdict_text = "not separated (no difference to chase)"
        lines.append(f"{r['leader'] + ' vs ' + r['other']:>26} {text:>36} {r['seeds']:>5}  {verdict_text}")
    return lines
