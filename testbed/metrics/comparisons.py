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
    repeats_needed: Optional[int]  # about how many repeats would separate it at this effect size
    censored: bool  # a bound pointing the wrong way took part: no claim


def paired(leader: Mapping[int, Goodput], other: Mapping[int, Goodput]) -> tuple[Interval, bool, np.ndarray]:
    """(interval of the mean per-seed difference leader - other, whether a censored value points
    against the claim, the differences) over the seeds both have; a bound's value stands in for it. The interval
    is widened by the mean interpolation error of both (each crossing lies within its bracket)."""
    seeds = sorted(set(leader) & set(other))
    diffs = [leader[s].value - other[s].value for s in seeds]
    against = any(leader[s].censored == BELOW or other[s].censored == ABOVE for s in seeds)
    error = float(np.mean([leader[s].error + other[s].error for s in seeds])) if seeds else 0.0
    return widened(mean_interval(diffs), error), against, np.array(diffs)


def widened(interval: Interval, error: float, bounds=(-math.inf, math.inf)) -> Interval:
    """The interval grown by `error` on each side (an interpolation's worst case)."""
    if not interval.known or not error:
        return interval
    return replace(interval, low=max(interval.low - error, bounds[0]), high=min(interval.high + error, bounds[1]))


def repeats_to_separate(diffs: np.ndarray, confidence: float = 0.95) -> Optional[int]:
    """The smallest number of repeats whose paired t interval would exclude zero if the per-seed
    differences kept their mean and spread; None if no spread is known or it takes > MAX_REPEATS."""
    mean, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
    if not (sd > 0) or mean == 0:
        return None
    for n in range(2, MAX_REPEATS + 1):
        if t_quantile(confidence, n - 1) * sd / math.sqrt(n) < abs(mean):
            return n
    return None


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
        separated = interval.known and interval.low > 0 and not against
        out.append(Comparison(leader, other, interval, len(diffs), separated,
                              None if separated else repeats_to_separate(diffs), against))
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
        line = (f"best configuration: {leader}, ahead of the runner-up {runner} by "
                f"{_difference(comparisons[0], unit)} (paired over {comparisons[0].seeds} seeds)")
    else:
        tied = [c.other for c in comparisons if not c.separated]
        line = (f"leaders not separated at this sample size: {leader} vs {', '.join(tied)} "
                f"(paired differences below; experiment.repeats sets the repeats)")
    return {"label": leader, "runner_up": runner, "separated": separated, "line": line,
            "comparisons": [comparison_row(c) for c in comparisons]}


def comparison_row(c: Comparison) -> dict:
    d = c.difference
    return {"leader": c.leader, "other": c.other, "difference": d.estimate, "difference_low": d.low,
            "difference_high": d.high, "seeds": c.seeds, "separated": c.separated,
            "repeats_needed": c.repeats_needed, "censored_against": c.censored}


def _difference(c: Comparison, unit: str) -> str:
    d = c.difference
    return f"{d.estimate:.3g} [{d.low:.3g}, {d.high:.3g}] {unit}"


def comparison_lines(rows: list[dict], unit: str = "req/s per GPU") -> list[str]:
    """The final table: per comparison, the paired difference, separated or not, and for one
    that is not, about how many repeats would separate it at the current effect size."""
    if not rows:
        return []
    lines = [f"{'comparison':>26} {'paired difference (' + unit + ')':>36} {'seeds':>5}  verdict"]
    for r in rows:
        low, high = r["difference_low"], r["difference_high"]
        text = (f"{r['difference']:.3g} [{low:.3g}, {high:.3g}]" if not math.isnan(low)
                else f"{r['difference']:.3g} [no interval]")
        if r["separated"]:
            verdict_text = "separated"
        elif r["censored_against"]:
            verdict_text = "not separated (a censored goodput points against it)"
        elif r["repeats_needed"]:
            verdict_text = f"not separated (about {r['repeats_needed']} repeats would separate it)"
        else:
            verdict_text = "not separated (no difference to chase)"
        lines.append(f"{r['leader'] + ' vs ' + r['other']:>26} {text:>36} {r['seeds']:>5}  {verdict_text}")
    return lines
