"""The host around the engine: delays and contention a real run has and a cost model lacks.

    release      arrival -> the router lets the request in: its loop's lateness (busy with
                 reports, or waking from its wait); the client's clock runs from the arrival
    dispatch     router -> worker: the request's message and the worker's wake-up
    step_gap     a busy worker's gap between two steps: its report, inbox and KV polling; after
                 a step that prefilled apart (step_gap_prefill: twice the others' here), else `step_gap`;
                 drawn in the worker's contention phase at the share `step_gap_phase` measured
    report       worker -> router: a step's tokens until the router reads them (harness delay)
    report_first the same for a step that carries a request's first token (about twice as long
                 on this machine: the router is more often asleep in its wait), else `report`
    handoff      P's first token stamped -> its KV on the link (disagg): the router binds D on
                 the report, D reserves and answers Ready, P reads it between its steps
    step_scale   a real step's time over the cost model's prediction for its shape: processes
                 sharing cores make the same batch take different times (one per role: P and D
                 contend differently)
    transfer_scale  a real KV transfer's time over the fitted link's for its bytes (drawn by
                 the sending worker): both ends must be on a core at once

Each is a distribution kept as quantiles at LEVELS (every percentile, then finer to the maximum)
and sampled by inverse transform, so the simulation reproduces the tails as well as the medians;
a fixed value (sim.dispatch_latency_s, ...) is a one-point distribution. Each worker, and the
router, draws from its own seeded stream (`Draws`): the same seed gives the same run, and a
worker's draws do not depend on how other workers' events interleave with its own.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Mapping, Optional, Sequence

import numpy as np

# every percentile, then finer towards the maximum: between evenly spaced percentiles the top bin
# spreads 1% of the draws evenly from p99 to the largest value measured, so one stall in thousands
# (a 0.26 s gap among 4,000 of 0.3 ms) would stall 1% of simulated steps by 0.13 s on average
LEVELS = tuple(np.concatenate([np.linspace(0.0, 0.99, 100), np.linspace(0.991, 0.999, 9), [0.9995, 0.9999, 1.0]]))


@functools.lru_cache(maxsize=8)
def levels_of(count: int) -> tuple[float, ...]:
    """The quantile levels of a stored distribution of `count` quantiles (evenly spaced in
    profiles written before LEVELS)."""
    return LEVELS if count == len(LEVELS) else tuple(np.linspace(0.0, 1.0, count))


@dataclass(frozen=True)
class Delay:
    quantiles: tuple[float, ...] = (0.0,)

    @classmethod
    def fixed(cls, value: float) -> "Delay":
        return cls((float(value),))

    @classmethod
    def of(cls, values: Sequence[float]) -> "Delay":
        """The empirical distribution of `values` (non-finite ones dropped)."""
        values = np.asarray(values, dtype=float)
        values = values[np.isfinite(values)]
        if not len(values):
            return cls()
        return cls(tuple(float(q) for q in np.quantile(values, LEVELS)))

    @property
    def is_fixed(self) -> bool:
        return len(self.quantiles) == 1

    @property
    def median(self) -> float:
        return float(np.median(self.quantiles)) if not self.is_fixed else self.quantiles[0]

    def sample(self, u: float) -> float:
        """The value at quantile u in [0, 1), linearly interpolated between stored levels."""
        q = self.quantiles
        if len(q) == 1:
            return q[0]
        levels = levels_of(len(q))
        i = min(bisect.bisect_right(levels, u) - 1, len(q) - 2)
        return q[i] + (q[i + 1] - q[i]) * (u - levels[i]) / (levels[i + 1] - levels[i])


@dataclass(frozen=True)
class HostModel:
    dispatch: Delay = field(default_factory=Delay)
    step_gap: Delay = field(default_factory=Delay)
    report: Delay = field(default_factory=Delay)
    release: Delay = field(default_factory=Delay)  # measured in situ only (the testbed's own router)
    report_first: Optional[Delay] = None  # None: as `report`
    handoff: Delay = field(default_factory=Delay)
    step_gap_prefill: Optional[Delay] = None  # the gap after a step that prefilled; None: as `step_gap`

    @classmethod
    def from_dict(cls, measured: Mapping, fixed: Mapping[str, Optional[float]]) -> "HostModel":
        """Measured quantiles ({name: [q0..q100]}), each replaced by a fixed value where one is set
        (a fixed report is every report's, the first token's too)."""
        delays = {
            name: Delay(tuple(measured[name])) if measured.get(name) else Delay()
            for name in ("dispatch", "step_gap", "report", "release", "handoff")
        }
        if measured.get("report_first") and fixed.get("report") is None:
            delays["report_first"] = Delay(tuple(measured["report_first"]))
        if measured.get("step_gap_prefill") and fixed.get("step_gap") is None:
            delays["step_gap_prefill"] = Delay(tuple(measured["step_gap_prefill"]))
        delays.update({name: Delay.fixed(v) for name, v in fixed.items() if v is not None})
        return cls(**delays)

    @property
    def first_report(self) -> Delay:
        """The report delay of a step that carries a request's first token."""
        return self.report if self.report_first is None else self.report_first

    def gap_after(self, prefilled: bool) -> Delay:
        """A busy worker's gap after a step (`prefilled`: one that prefilled)."""
        return self.step_gap_prefill if prefilled and self.step_gap_prefill is not None else self.step_gap

    def as_dict(self) -> dict:
        """Medians, for summary.json (a fixed value is its own median)."""
        delays = (self.dispatch, self.step_gap, self.report, self.release, self.first_report, self.handoff)
        return {
            "dispatch_s": self.dispatch.median,
            "step_gap_s": self.step_gap.median,
            "report_s": self.report.median,
            "release_s": self.release.median,
            "report_first_s": self.first_report.median,
            "handoff_s": self.handoff.median,
            "sampled": not all(d.is_fixed for d in delays),
        }


def contention_rho(measured: Optional[Mapping]) -> float:
    """How strongly a role's contention phase persists from a step to the next (in-situ profiles)."""
    return float(((measured or {}).get("host") or {}).get("step_scale_rho") or 0.0)


def contention_weight(measured: Optional[Mapping]) -> float:
    """The share of a role's contention (log-variance) that comes in phases; the rest is each
    step's own (1: all in phases, as profiles written before the share was fitted)."""
    found = ((measured or {}).get("host") or {}).get("step_scale_weight")
    return 1.0 if found is None else float(found)


def step_scale(measured: Optional[Mapping], prefill: bool = False) -> Delay:
    """A role's contention on decode steps (or on steps with prefill): what its in-situ profile
    measured, else none (x1)."""
    found = ((measured or {}).get("host") or {}).get("step_scale_prefill" if prefill else "step_scale")
    return Delay(tuple(found)) if found else Delay.fixed(1.0)


def gap_phase(measured: Optional[Mapping]) -> float:
    """The share of a role's step gaps (normal score) that moves with its contention phase
    (in-situ profiles; 0: each gap drawn on its own, as profiles written before it was fitted)."""
    return float(((measured or {}).get("host") or {}).get("step_gap_phase") or 0.0)


def transfer_scale(measured: Optional[Mapping]) -> Delay:
    """A role's KV transfers' time over the fitted link's: what its in-situ profile measured,
    else none (x1)."""
    found = ((measured or {}).get("host") or {}).get("transfer_scale")
    return Delay(tuple(found)) if found else Delay.fixed(1.0)


def step_scale_after_prefill(measured: Optional[Mapping]) -> Delay:
    """A role's contention on the decode step right after one that prefilled (its caches cold:
    1.5x the others' median here), else as on any decode step."""
    found = ((measured or {}).get("host") or {}).get("step_scale_after_prefill")
    return Delay(tuple(found)) if found else step_scale(measured)


class Draws:
    """One worker's (or the router's) uniform draws for its delays. A decode run draws ahead for
    steps it may not run; cut short, it gives those back (`give_back`), next one out first, so
    the stream goes on where stepping one at a time would have left it.

    Contention comes in phases: a slow step is followed by slow steps. On this machine the
    correlation of log(step time over the model's) is 0.6 a step apart but still 0.25 sixteen
    steps apart and 0.1 at 32: a long phase under each step's own jitter, which one AR(1) cannot
    hold (fitted on lag 1 it forgets the phase within 5 steps, so no request decodes through a
    slow phase, and the TPOT tail came out 15-35% low). So a worker's contention draws follow a
    Gaussian copula z = sqrt(w) s + sqrt(1 - w) e: s an AR(1) phase of correlation `rho`, e
    each step's own, `weight` w the phase's share; each draw keeps its measured distribution,
    and a request's decode steps share the phase they fall in. weight=1: one AR(1), one uniform
    a step (`scale_draws`)."""

    def __init__(self, seed: int, rho: float = 0.0, weight: float = 1.0, gap_phase: float = 0.0):
        self.rng = random.Random(seed)
        self.returned: list[float] = []  # a stack: the next draw on top
        self.rho = rho
        self.weight = weight if rho else 1.0
        self.gap_phase = gap_phase if rho else 0.0
        self.z = 0.0  # the contention phase: a standard normal state

    def scale_draws(self, delay: Delay) -> int:
        """How many uniforms a contention draw of `delay` takes."""
        return 0 if delay.is_fixed else 1 if self.weight >= 1 else 2

    def sample(self, delay: Delay, taken: Optional[list] = None) -> float:
        """A value of `delay`; a sampled one's uniform is appended to `taken` when given."""
        if delay.is_fixed:
            return delay.quantiles[0]
        return delay.sample(self._uniform(taken))

    def contention(self, delay: Delay, taken: Optional[list] = None) -> float:
        """A step's contention: a value of `delay` in the worker's current phase."""
        if delay.is_fixed:
            return delay.quantiles[0]
        u = self._uniform(taken)
        if self.rho:
            innovation = _score(u)
            self.z = self.rho * self.z + math.sqrt(1 - self.rho * self.rho) * innovation
            z = self.z
            if self.weight < 1:  # the step's own jitter on top of the phase
                z = _mixed(z, _score(self._uniform(taken)), self.weight)
            u = min(_NORMAL.cdf(z), 1 - 1e-12)
        return delay.sample(u)

    def gap(self, delay: Delay, taken: Optional[list] = None) -> float:
        """A busy worker's gap between steps, in its current contention phase: one uniform, as
        `sample` takes, its normal score mixed with the phase's at `gap_phase`."""
        if delay.is_fixed or not self.gap_phase:
            return self.sample(delay, taken)
        z = _mixed(self.z, _score(self._uniform(taken)), self.gap_phase)
        return delay.sample(min(_NORMAL.cdf(z), 1 - 1e-12))

    def _uniform(self, taken: Optional[list]) -> float:
        u = self.returned.pop() if self.returned else self.rng.random()
        if taken is not None:
            taken.append(u)
        return u

    def give_back(self, uniforms: Sequence[float], z: Optional[float] = None) -> None:
        """Uniforms drawn ahead and not used, and the contention phase to go on from."""
        self.returned.extend(reversed(uniforms))
        if z is not None:
            self.z = z


_NORMAL = NormalDist()


def _score(u: float) -> float:
    """A uniform's standard normal score (clamped off 0 and 1)."""
    return _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))


def _mixed(phase: float, own: float, share: float) -> float:
    """A normal score carrying `share` of the phase's variance and the rest its own."""
    return math.sqrt(share) * phase + math.sqrt(1 - share) * own


@dataclass
class HostSide:
    """A simulation's host: the delays, and by rank each worker's contention and draws."""

    model: HostModel
    scales: list  # by rank: (a decode step's contention, a step with prefill's, a decode step's after one)
    router: Draws
    draws: list  # by rank
    transfer_scales: list  # by rank: the contention of the KV transfers it sends

    @classmethod
    def of(cls, model: HostModel, measured: Sequence[Optional[Mapping]], seed: int) -> "HostSide":
        """`measured`: each worker's in-situ profile (by rank), None where it has none."""
        base = seed * 1_000_003
        return cls(
            model,
            [(step_scale(m), step_scale(m, prefill=True), step_scale_after_prefill(m)) for m in measured],
            Draws(base),
            [
                Draws(base + 1 + rank, contention_rho(m), contention_weight(m), gap_phase(m))
                for rank, m in enumerate(measured)
            ],
            [transfer_scale(m) for m in measured],
        )
