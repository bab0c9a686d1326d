"""Engine profiles: a production engine's host side, by engine and version, on an analytical GPU.

A profile (a row of testbed/sim/profiles/engines.yaml) holds the terms the roofline does not time:

- the per-step host time, a fixed part and a part per sequence the step samples for
  (engine.host_overhead_s, engine.host_overhead_per_seq_s: set there, they replace the profile's);
- the front end per request, added to its TTFT and E2E (HTTP, tokenising, the hop to the engine
  core: sim.frontend_latency_s, set, replaces it);
- CUDA graphs for decode (engine.cuda_graphs, set, replaces it);
- async scheduling: the host work overlaps the GPU step, which then costs max(host, gpu) instead
  of host + gpu (testbed/perf/overlap.py);

and names what calibrated it (`calibration`: the runs and the figures fitted). An analytical GPU
runs `vllm_v1`, the current vLLM, unless sim.engine_profile names another (null: none). A measured
profile (sim.profile=<profile.json>, run:<dir>) has its own host side: an engine profile applies
to the analytical GPUs only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from testbed.errors import ConfigError

TABLE = Path(__file__).parent / "profiles" / "engines.yaml"


@dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str  # vllm | sglang
    versions: tuple  # [lowest, past the highest): the versions it stands for (None: open)
    host_overhead_s: float
    host_overhead_per_seq_s: float
    frontend_latency_s: float
    cuda_graphs: bool
    async_scheduling: bool
    calibration: dict

    def covers(self, engine: str, version: str) -> bool:
        low, high = (None if v is None else _version(v) for v in self.versions)
        mine = _version(version)
        return engine == self.engine and (low is None or mine >= low) and (high is None or mine < high)

    def label(self) -> dict:
        """What summary.json and the planner say about the profile."""
        return {
            "name": self.name,
            "engine": self.engine,
            "async_scheduling": self.async_scheduling,
            "calibration": self.calibration.get("runs"),
        }


@functools.lru_cache(maxsize=4)
def profiles(path: Path = TABLE) -> dict[str, EngineProfile]:
    rows = yaml.safe_load(Path(path).read_text()) or {}
    return {name: EngineProfile(name=name, **{**row, "versions": tuple(row["versions"])}) for name, row in rows.items()}


def engine_profile(name: str, key: str = "sim.engine_profile") -> EngineProfile:
    """The profile named `name`; an unknown name is one line listing the profiles."""
    table = profiles()
    if name not in table:
        raise ConfigError(f"{key}={name!r} is not an engine profile; allowed: {', '.join(sorted(table))}")
    return table[name]


def for_engine(text: str, key: str = "engine") -> str:
    """The profile of an engine at a version, as a replay setup says it ("vllm 0.15.1")."""
    engine, version = (str(text).lower().split() + ["", ""])[:2]
    version = version.lstrip("v")
    found = [p.name for p in profiles().values() if version and p.covers(engine, version)]
    if not found:
        spans = "; ".join(f"{p.name}: {p.engine} {_span(p.versions)}" for p in profiles().values())
        raise ConfigError(f"{key}={text!r} names no engine profile (<engine> <version>; profiles: {spans})")
    return found[0]


def host_terms(engine, profile: Optional[str], dtype: str = "auto") -> dict:
    """The analytical cost model's dtype and host terms (testbed.perf.resolve.analytical): the
    EngineConfig's where it sets them, else the profile's (no profile: the EngineConfig's alone)."""
    terms = engine.host_terms(dtype)
    if profile is None:
        return terms
    p = engine_profile(profile)
    return {
        **terms,
        "host_fixed_s": p.host_overhead_s if engine.host_overhead_s is None else engine.host_overhead_s,
        "host_per_seq_s": engine.host_overhead_per_seq_s if engine.sets_host else p.host_overhead_per_seq_s,
        "cuda_graphs": p.cuda_graphs if engine.cuda_graphs is None else engine.cuda_graphs,
        "async_scheduling": p.async_scheduling,
    }


def frontend_s(set_s: Optional[float], profile: Optional[str]) -> float:
    """The front end per request: sim.frontend_latency_s where set (0 included), else the profile's."""
    if set_s is not None:
        return set_s
    return 0.0 if profile is None else engine_profile(profile).frontend_latency_s


def describe(name: Optional[str], analytical: bool = True) -> str:
    """One line naming the engine profile a run simulates (`analytical`: on an analytical GPU) and
    what calibrated it."""
    if not analytical:
        return "none (measured profiles: their step times hold their own host side)"
    if name is None:
        return "none (sim.engine_profile=null: the GPU table's host term in sequence, no front end)"
    p = engine_profile(name)
    overlap = "async scheduling" if p.async_scheduling else "host and GPU in sequence"
    return (
        f"{p.name} ({p.engine} {_span(p.versions)}, {overlap}, front end {p.frontend_latency_s * 1e3:g} ms; "
        f"fitted on {p.calibration.get('engine', '?')}: {_runs(len(p.calibration['runs']))})"
    )


def _runs(n: int) -> str:
    return f"{n} run" + ("s" if n != 1 else "")


def _version(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in str(text).split(".")[:3])


def _span(versions: tuple) -> str:
    low, high = versions
    return f">={low}" + (f" <{high}" if high is not None else "")
