"""Token-length distributions, clipped to [min, max], reporting how many values were clipped."""

from __future__ import annotations

import numpy as np

from testbed.workload.config import LengthConfig


def sample_lengths(cfg: LengthConfig, n: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """n integer lengths from the distribution and the number that fell outside [min, max]."""
    raw = _draw(cfg, n, rng)
    values = np.rint(raw).astype(np.int64)
    clipped = int(np.count_nonzero((values < cfg.min) | (values > cfg.max)))
    return np.clip(values, cfg.min, cfg.max), clipped


def _draw(cfg: LengthConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    if cfg.dist == "fixed":
        return np.full(n, cfg.mean, dtype=np.float64)
    if cfg.dist == "uniform":
        return rng.integers(cfg.min, cfg.max + 1, size=n).astype(np.float64)
    if cfg.dist == "normal":
        return rng.normal(cfg.mean, cfg.std, size=n)
    if cfg.dist == "lognormal":
        # Choose mu so that the mean of the values (not of their logs) is cfg.mean.
        mu = np.log(cfg.mean) - cfg.sigma**2 / 2.0
        return rng.lognormal(mu, cfg.sigma, size=n)
    if cfg.dist == "pareto":
        # Classical Pareto with scale x_m chosen so the mean alpha * x_m / (alpha - 1) is cfg.mean.
        scale = cfg.mean * (cfg.alpha - 1.0) / cfg.alpha
        return scale * (1.0 + rng.pareto(cfg.alpha, size=n))
    if cfg.dist == "zipf":
        return cfg.min + _bounded_zipf_ranks(cfg.alpha, cfg.max - cfg.min + 1, n, rng)
    if cfg.dist == "empirical":
        return rng.choice(np.asarray(cfg.values, dtype=np.float64), size=n, replace=True)
    raise ValueError(f"unknown length distribution {cfg.dist!r}")


def _bounded_zipf_ranks(alpha: float, count: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Ranks 0..count-1 with P(k) ~ (k + 1)^-alpha (numpy's zipf is unbounded and needs alpha > 1)."""
    weights = np.arange(1, count + 1, dtype=np.float64) ** -alpha
    return rng.choice(count, size=n, p=weights / weights.sum()).astype(np.float64)


def scale_lengths(values: np.ndarray, scale: float) -> np.ndarray:
    """Trace lengths times length_scale, rounded, at least one token."""
    return np.maximum(1, np.rint(np.asarray(values, dtype=np.float64) * scale)).astype(np.int64)
