"""What one run may cost before anything is drawn (the root configuration refuses a run above it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from testbed.errors import ConfigError


@dataclass(frozen=True)
class LimitsConfig:
    """What one run may cost, estimated from the configuration before anything is drawn: the span
    of its arrivals in wall-clock seconds (real and http executors; the simulator's clock is its
    own) and its host memory in GB (requests, results, and with hardware=cpu the workers' weights
    and explicit KV pools)."""

    max_run_s: float = 86400.0  # a day
    max_memory_gb: Optional[float] = None  # None: 80% of this machine's physical memory

    def validate(self) -> "LimitsConfig":
        for key in ("max_run_s", "max_memory_gb"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"limits.{key}={value} must be > 0")
        return self
