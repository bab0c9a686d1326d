"""Simulator settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from testbed.errors import ConfigError
from testbed.perf.gpus import GPUS
from testbed.perf.measured import load_profile
from testbed.perf.resolve import is_gpu

SHIPPED = Path(__file__).parent / "profiles"
ROLE_KEYS = {"mixed": "profile", "prefill": "prefill_profile", "decode": "decode_profile"}


@dataclass(frozen=True)
class HostDelays:
    """Host-side time a real run spends outside the engine's steps, in seconds."""

    dispatch_s: float = 0.0  # router -> worker: the request's message and the worker's wake-up
    step_gap_s: float = 0.0  # a busy worker's gap between steps: reporting, inbox, KV polling
    report_s: float = 0.0  # worker -> router: a token's step report until the router reads it

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SimConfig:
    """`profile`: the simulated device. A GPU of the analytical table (testbed.perf.gpus: a
    roofline of that GPU for the configured model), or a profile file written by `+experiment=profile`
    (python -m testbed.sim.profile): measured on a device, it replaces the analytical model there.
    Unset: the profile shipped for the model preset, `testbed/sim/profiles/<model>_cpu.json`.
    `prefill_profile` / `decode_profile`: P's and D's own device (heterogeneous pools); unset, sim.profile."""

    profile: Optional[str] = None
    prefill_profile: Optional[str] = None
    decode_profile: Optional[str] = None
    # The router -> worker hop of a real run (a queue and a process wake-up), which the engine
    # profile cannot see: sim_validate reports the measured value (prefill_queue_s p50 at low load).
    dispatch_latency_s: float = 0.0
    # A busy worker's gap between two steps, and the worker -> router report of a token (the
    # harness delay): sim_validate measures both on the real points it validates against.
    step_gap_s: float = 0.0
    report_latency_s: float = 0.0

    def validate(self) -> "SimConfig":
        for key in ("dispatch_latency_s", "step_gap_s", "report_latency_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"sim.{key} must be >= 0 (got {getattr(self, key)})")
        for key in ROLE_KEYS.values():
            spec = getattr(self, key)
            if spec is not None and not is_gpu(spec) and not spec.endswith(".json") and not Path(spec).is_file():
                raise ConfigError(f"sim.{key}={spec!r} is neither a GPU of the analytical table "
                                  f"({', '.join(sorted(GPUS))}) nor a profile .json file")
        return self

    def host_delays(self) -> HostDelays:
        return HostDelays(self.dispatch_latency_s, self.step_gap_s, self.report_latency_s)

    def spec(self, role: str) -> Optional[str]:
        """What simulates a worker of this role ("mixed", "prefill", "decode"); None: the shipped profile."""
        own = getattr(self, ROLE_KEYS[role])
        return own if own is not None else self.profile

    def key(self, role: str) -> str:
        """The setting that decided `spec(role)`, for messages."""
        own = ROLE_KEYS[role]
        return f"sim.{own}" if getattr(self, own) is not None else "sim.profile"

    def load(self, model_name: str, role: str = "mixed") -> Optional[dict]:
        """The measured profile a role runs on; None when its spec names a GPU (analytical)."""
        spec = self.spec(role)
        if spec is not None and is_gpu(spec):
            return None
        if spec is None and not (SHIPPED / f"{model_name}_cpu.json").is_file():
            shipped = ", ".join(sorted(p.name for p in SHIPPED.glob("*.json")))
            raise ConfigError(f"sim.profile: no profile is shipped for model {model_name!r} (shipped: {shipped}); "
                              f"profile it with `python -m testbed +experiment=profile` and pass sim.profile=<its "
                              f"profile.json>, or simulate a GPU: sim.profile={' | '.join(sorted(GPUS))}")
        return load_profile(Path(spec) if spec else SHIPPED / f"{model_name}_cpu.json", self.key(role))
