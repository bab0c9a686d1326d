"""Simulator settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.errors import ConfigError

SHIPPED = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class SimConfig:
    """`profile`: a file written by `+experiment=profile` (or python -m testbed.sim.profile).
    Unset: the profile shipped for the model preset, `testbed/sim/profiles/<model>_cpu.json`."""

    profile: Optional[str] = None
    # The router -> worker hop of a real run (a queue and a process wake-up), which the engine
    # profile cannot see: sim_validate reports the measured value (prefill_queue_s p50 at low load).
    dispatch_latency_s: float = 0.0

    def validate(self) -> "SimConfig":
        if self.dispatch_latency_s < 0:
            raise ConfigError(f"sim.dispatch_latency_s must be >= 0 (got {self.dispatch_latency_s})")
        return self

    def load(self, model_name: str) -> dict:
        path = Path(self.profile) if self.profile else SHIPPED / f"{model_name}_cpu.json"
        if not path.is_file():
            shipped = ", ".join(sorted(p.name for p in SHIPPED.glob("*.json")))
            raise ConfigError(f"sim.profile: {path} not found; profile this model with `python -m testbed "
                              f"+experiment=profile` and pass sim.profile=<its profile.json> (shipped: {shipped})")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"sim.profile: {path} is not valid JSON (line {error.lineno})") from None
