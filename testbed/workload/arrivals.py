"""Arrival processes: arrival times in seconds from the run start, given a numpy Generator.

Every synthetic process starts its first arrival one gap after time zero (a renewal process
observed from t = 0), so `n / arrivals[-1]` estimates the rate.
"""

from __future__ import annotations

import numpy as np


def poisson(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Gamma gaps as in vLLM's benchmark: shape = burstiness, scale = 1 / (rate * burstiness).

    The mean gap stays 1 / rate; the coefficient of variation is 1 / sqrt(burstiness), so
    burstiness < 1 is burstier than Poisson and burstiness = 1 is Poisson.
    """
    return np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


def constant(n: int, rate: float) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.float64) / rate


def on_off(rng: np.random.Generator, n: int, rate: float, on_s: float, off_s: float) -> np.ndarray:
    """Poisson bursts: arrivals only during on_s-second windows, each followed by off_s of silence.

    The rate inside a burst is rate * (on_s + off_s) / on_s so that `rate` stays the mean offered
    load, which keeps on/off runs comparable with Poisson runs in a rate sweep.
    """
    peak = rate * (on_s + off_s) / on_s
    busy = poisson(rng, n, peak)  # times on a clock that only runs while "on"
    periods = np.floor(busy / on_s)
    return busy + periods * off_s


def ramp(rng: np.random.Generator, n: int, start_rate: float, end_rate: float, ramp_s: float) -> np.ndarray:
    """Non-homogeneous Poisson whose rate rises linearly from start_rate to end_rate over ramp_s
    seconds and then holds, by inverting the cumulative intensity at unit-rate Poisson points."""
    units = np.cumsum(rng.exponential(1.0, size=n))
    slope = (end_rate - start_rate) / ramp_s
    ramp_area = (start_rate + end_rate) / 2.0 * ramp_s
    times = np.empty(n)
    inside = units <= ramp_area
    u = units[inside]
    if slope == 0:
        times[inside] = u / start_rate
    else:
        # Solve start_rate * t + slope * t^2 / 2 = u for t >= 0.
        times[inside] = (-start_rate + np.sqrt(start_rate**2 + 2.0 * slope * u)) / slope
    times[~inside] = ramp_s + (units[~inside] - ramp_area) / end_rate
    return times


def replay(timestamps_s: np.ndarray, speedup: float) -> np.ndarray:
    """Trace replay: the trace's own offsets, compressed by `speedup` (2.0 = twice the rate)."""
    return np.asarray(timestamps_s, dtype=np.float64) / speedup


def synthetic(rng: np.random.Generator, n: int, cfg) -> np.ndarray:
    """The configured synthetic process (cfg: WorkloadConfig) for n arrivals."""
    if cfg.arrival == "poisson":
        return poisson(rng, n, cfg.rate)
    if cfg.arrival == "gamma":
        return gamma(rng, n, cfg.rate, cfg.burstiness)
    if cfg.arrival == "constant":
        return constant(n, cfg.rate)
    if cfg.arrival == "onoff":
        return on_off(rng, n, cfg.rate, cfg.on_s, cfg.off_s)
    if cfg.arrival == "ramp":
        return ramp(rng, n, cfg.ramp_start_rate, cfg.rate, cfg.ramp_s)
    raise ValueError(f"not a synthetic arrival process: {cfg.arrival!r}")


def synthetic_until(rng_factory, cfg, num_requests: int, duration_s: float | None) -> np.ndarray:
    """num_requests arrivals, or, when num_requests is 0, every arrival before duration_s.

    rng_factory() returns a fresh, identically seeded Generator so that doubling the draw keeps
    the process deterministic given the seed.
    """
    if num_requests > 0:
        times = synthetic(rng_factory(), num_requests, cfg)
    else:
        n = max(16, int(2 * cfg.rate * duration_s) + 16)
        times = synthetic(rng_factory(), n, cfg)
        while times[-1] <= duration_s:
            n *= 2
            times = synthetic(rng_factory(), n, cfg)
    if duration_s is not None:
        times = times[times <= duration_s]
    return times
