"""Workload configuration: Hydra structured configs, validated into one-line WorkloadErrors.

Why these dataclasses are not `frozen=True`: OmegaConf marks the config built from a frozen
dataclass read-only, and then Hydra can merge neither the preset YAML nor command-line
overrides onto it (ReadonlyConfigError; for `List[TenantConfig]` even after unlocking, since
list items are re-created from the frozen class). Treat them as values all the same:
`OmegaConf.to_object` makes fresh instances and no code below mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from testbed.errors import TestbedError

ARRIVALS = ("poisson", "gamma", "constant", "onoff", "ramp", "trace")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal", "zipf", "pareto", "empirical")
TRACE_FORMATS = ("azure_csv", "mooncake_jsonl", "native_jsonl")
OVERLENGTH = ("clip", "reject")
THINK_DISTS = ("fixed", "exponential")


class WorkloadError(TestbedError, ValueError):
    """Bad workload input (config, trace file); the message is one line naming the key or file."""


@dataclass
class LengthConfig:
    """A token-length distribution, clipped to [min, max].

    fixed: `mean`. uniform: integers in [min, max]. normal: `mean`, `std`. lognormal: `mean`
    (of the values) and `sigma` (of the log). zipf: P(min + k) ~ (k + 1)^-alpha for k in
    [0, max - min]. pareto: shape `alpha` > 1, scaled so the mean is `mean`. empirical:
    uniform draws from `values`.
    """

    dist: str = "uniform"
    mean: float = 128.0
    std: float = 32.0
    sigma: float = 0.5
    alpha: float = 1.5
    min: int = 1
    max: int = 2048
    values: List[int] = field(default_factory=list)

    def validate(self, key: str) -> None:
        if self.dist not in LENGTH_DISTS:
            raise WorkloadError(f"{key}.dist must be one of {', '.join(LENGTH_DISTS)} (got {self.dist!r})")
        if self.min < 1:
            raise WorkloadError(f"{key}.min must be >= 1 (got {self.min})")
        if self.max < self.min:
            raise WorkloadError(f"{key}.max must be >= {key}.min={self.min} (got {self.max})")
        if self.dist in ("fixed", "normal", "lognormal", "pareto") and self.mean <= 0:
            raise WorkloadError(f"{key}.mean must be > 0 (got {self.mean})")
        if self.dist == "normal" and self.std < 0:
            raise WorkloadError(f"{key}.std must be >= 0 (got {self.std})")
        if self.dist == "lognormal" and self.sigma < 0:
            raise WorkloadError(f"{key}.sigma must be >= 0 (got {self.sigma})")
        if self.dist == "pareto" and self.alpha <= 1:
            raise WorkloadError(f"{key}.alpha must be > 1 for pareto (got {self.alpha})")
        if self.dist == "zipf" and self.alpha <= 0:
            raise WorkloadError(f"{key}.alpha must be > 0 for zipf (got {self.alpha})")
        if self.dist == "empirical" and (not self.values or min(self.values) < 1):
            raise WorkloadError(f"{key}.values must be a non-empty list of lengths >= 1 for empirical")


def _default_input() -> LengthConfig:
    return LengthConfig(dist="uniform", min=100, max=300)


def _default_output() -> LengthConfig:
    return LengthConfig(dist="uniform", min=16, max=64)


@dataclass
class RateLimitConfig:
    """A tenant's admission limit: token buckets on requests and on prompt tokens, each refilling
    at its rate and holding `burst_s` seconds of it. None: no limit on that count."""

    requests_per_s: Optional[float] = None
    prompt_tokens_per_s: Optional[float] = None
    burst_s: float = 1.0


@dataclass
class TenantConfig:
    """One traffic class of a mixed workload: its share, its lengths, its own SLOs, its admission
    limit, and the front workers (ranks) that serve it (empty: any)."""

    name: str = "default"
    weight: float = 1.0
    input_len: LengthConfig = field(default_factory=_default_input)
    output_len: LengthConfig = field(default_factory=_default_output)
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)
    workers: List[int] = field(default_factory=list)


@dataclass
class WorkloadConfig:
    """Traffic for one run. `num_requests` counts open-loop arrivals (first turns of sessions);
    0 means no cap (a trace's whole window, or synthetic arrivals until `duration_s`)."""

    name: str = "poisson"
    arrival: str = "poisson"
    rate: float = 4.0
    burstiness: float = 1.0
    num_requests: int = 64
    duration_s: Optional[float] = None
    input_len: LengthConfig = field(default_factory=_default_input)
    output_len: LengthConfig = field(default_factory=_default_output)
    overlength: str = "clip"
    # Trace: lengths (and hash ids) come from the file; arrivals too when arrival == "trace",
    # else from the synthetic process at `rate` (real lengths at a controlled load).
    path: Optional[str] = None
    format: Optional[str] = None
    length_scale: float = 1.0
    speedup: float = 1.0
    start_s: float = 0.0
    window_s: Optional[float] = None
    prefix_block_tokens: int = 512
    # onoff: Poisson bursts of on_s seconds separated by off_s of silence; `rate` is the mean.
    on_s: float = 2.0
    off_s: float = 2.0
    # ramp: the rate rises linearly from ramp_start_rate to `rate` over ramp_s, then holds.
    ramp_start_rate: float = 0.5
    ramp_s: float = 10.0
    # Sessions (closed loop after the first turn).
    turns: int = 1
    think_time_s: float = 1.0
    think_time_dist: str = "fixed"
    system_prompt_len: int = 0
    tenants: List[TenantConfig] = field(default_factory=list)
    # A decode background (interference studies): requests with short prompts and long outputs,
    # all arriving at t=0, tagged tenant "background", ahead of the arrivals above.
    background_requests: int = 0
    background_input_len: int = 16
    background_output_len: int = 256

    def validate(self) -> "WorkloadConfig":
        """Raise WorkloadError (one line, naming the key) on the first bad value."""
        _choice("workload.arrival", self.arrival, ARRIVALS)
        _choice("workload.overlength", self.overlength, OVERLENGTH)
        _choice("workload.think_time_dist", self.think_time_dist, THINK_DISTS)
        if self.format is not None:
            _choice("workload.format", self.format, TRACE_FORMATS)
        for key in ("rate", "length_scale", "speedup", "burstiness", "on_s", "ramp_s"):
            _positive(f"workload.{key}", getattr(self, key))
        for key in ("start_s", "off_s", "think_time_s", "ramp_start_rate"):
            _non_negative(f"workload.{key}", getattr(self, key))
        for key in ("num_requests", "system_prompt_len", "background_requests"):
            _non_negative(f"workload.{key}", getattr(self, key))
        if self.duration_s is not None:
            _positive("workload.duration_s", self.duration_s)
        if self.window_s is not None:
            _positive("workload.window_s", self.window_s)
        if self.turns < 1:
            raise WorkloadError(f"workload.turns must be >= 1 (got {self.turns})")
        if self.prefix_block_tokens < 1:
            raise WorkloadError(f"workload.prefix_block_tokens must be >= 1 (got {self.prefix_block_tokens})")
        if self.arrival == "trace" and not self.path:
            raise WorkloadError("workload.path must name a trace file when workload.arrival=trace")
        if self.path and (self.turns > 1 or self.tenants):
            raise WorkloadError("workload.turns and workload.tenants are for synthetic workloads (workload.path is set)")
        for key in ("background_input_len", "background_output_len"):
            if getattr(self, key) < 1:
                raise WorkloadError(f"workload.{key} must be >= 1 (got {getattr(self, key)})")
        if self.num_requests == 0 and self.duration_s is None and not self.path and not self.background_requests:
            raise WorkloadError("workload.num_requests must be > 0 unless workload.duration_s or workload.path is set")
        self.input_len.validate("workload.input_len")
        self.output_len.validate("workload.output_len")
        self._validate_tenants()
        return self

    def _validate_tenants(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise WorkloadError(f"workload.tenants names must be unique (got {names})")
        for i, tenant in enumerate(self.tenants):
            _positive(f"workload.tenants[{i}].weight", tenant.weight)
            tenant.input_len.validate(f"workload.tenants[{i}].input_len")
            tenant.output_len.validate(f"workload.tenants[{i}].output_len")
            for key in ("ttft_s", "tpot_s"):
                if getattr(tenant, key) is not None:
                    _positive(f"workload.tenants[{i}].{key}", getattr(tenant, key))
            limit = tenant.rate_limit
            _positive(f"workload.tenants[{i}].rate_limit.burst_s", limit.burst_s)
            for key in ("requests_per_s", "prompt_tokens_per_s"):
                if getattr(limit, key) is not None:
                    _positive(f"workload.tenants[{i}].rate_limit.{key}", getattr(limit, key))


def _choice(key: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise WorkloadError(f"{key} must be one of {', '.join(allowed)} (got {value!r})")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise WorkloadError(f"{key} must be > 0 (got {value})")


def _non_negative(key: str, value: float) -> None:
    if not value >= 0:
        raise WorkloadError(f"{key} must be >= 0 (got {value})")
