"""SLOs and metric options (Hydra structured configs; not frozen for the reason given in
testbed/workload/config.py: OmegaConf makes frozen dataclass configs read-only)."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import ConfigError


@dataclass
class SLOConfig:
    """Latency objectives: a request meets them when TTFT <= ttft_s and TPOT <= tpot_s."""

    ttft_s: float = 1.0  # time-to-first-token SLO (s)
    tpot_s: float = 0.1  # time-per-output-token SLO (s per token after the first)

    def validate(self) -> "SLOConfig":
        for key in ("ttft_s", "tpot_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"slo.{key} must be > 0 (got {getattr(self, key)})")
        return self


@dataclass
class MetricsConfig:
    """warm-up: the first `warmup_requests` (by arrival) and those arriving before `warmup_s`
    are left out of summaries; a decode stall is an ITL above stall_factor x the median ITL; a real
    run whose processes waited for a core more than contended_stretch - 1 times the time they ran is
    contended (testbed/cluster/contention.py)."""

    warmup_requests: int = 0  # first requests (by arrival) left out of summaries, aggregates and figures
    warmup_s: float = 0.0  # requests arriving before this (s) are left out of summaries, aggregates and figures
    stall_factor: float = 5.0  # a decode stall is an ITL above this many times the median ITL (> 1)
    # a real run is contended when its processes' (on-CPU + run-queue wait) / on-CPU exceeds this (> 1)
    contended_stretch: float = 2.0

    def validate(self) -> "MetricsConfig":
        if self.warmup_requests < 0:
            raise ConfigError(f"metrics.warmup_requests must be >= 0 (got {self.warmup_requests})")
        if self.warmup_s < 0:
            raise ConfigError(f"metrics.warmup_s must be >= 0 (got {self.warmup_s})")
        if not self.stall_factor > 1:
            raise ConfigError(f"metrics.stall_factor must be > 1 (got {self.stall_factor})")
        if not self.contended_stretch > 1:
            raise ConfigError(f"metrics.contended_stretch must be > 1 (got {self.contended_stretch})")
        return self
