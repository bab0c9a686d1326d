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

    dist: str = "uniform"  # fixed | uniform | normal | lognormal | zipf | pareto | empirical
    mean: float = 128.0  # mean length in tokens (fixed: the length; normal, lognormal, pareto)
    std: float = 32.0  # normal's standard deviation in tokens (dist=normal)
    sigma: float = 0.5  # lognormal's sigma, of the log (dist=lognormal)
    alpha: float = 1.5  # zipf's exponent (> 0) or pareto's shape (> 1) (dist=zipf, pareto)
    min: int = 1  # shortest length in tokens (>= 1): uniform's and zipf's low end; every draw is clipped to it
    max: int = 2048  # longest length in tokens: uniform's and zipf's high end; every draw is clipped to it
    values: List[int] = field(default_factory=list)  # lengths drawn uniformly from (dist=empirical)

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

    requests_per_s: Optional[float] = None  # request bucket's refill rate (requests/s); None: no limit
    prompt_tokens_per_s: Optional[float] = None  # prompt-token bucket's refill rate (tokens/s); None: no limit
    burst_s: float = 1.0  # each bucket holds this many seconds of its rate


@dataclass
class TenantConfig:
    """One traffic class of a mixed workload: its share, its lengths, its own SLOs, its admission
    limit, and the front workers (ranks) that serve it (empty: any)."""

    name: str = "default"  # the tenant's label on its requests (unique)
    weight: float = 1.0  # share of the arrivals, relative to the other tenants' weights
    input_len: LengthConfig = field(default_factory=_default_input)  # its prompt (and later turns' message) lengths
    output_len: LengthConfig = field(default_factory=_default_output)  # its output lengths
    ttft_s: Optional[float] = None  # its own TTFT SLO (s); None: slo.ttft_s
    tpot_s: Optional[float] = None  # its own TPOT SLO (s); None: slo.tpot_s
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)  # its admission limit (token buckets)
    workers: List[int] = field(default_factory=list)  # front worker ranks that serve it; empty: any


@dataclass
class WorkloadConfig:
    """Traffic for one run. `num_requests` counts open-loop arrivals (first turns of sessions);
    0 means no cap (a trace's whole window, or synthetic arrivals until `duration_s`)."""

    name: str = "poisson"  # the workload preset's name (conf/workload/NAME.yaml)
    arrival: str = "poisson"  # poisson | gamma | constant | onoff | ramp | trace (the trace file's own times)
    rate: float = 4.0  # mean arrivals per second (ramp: the rate it rises to)
    burstiness: float = 1.0  # gamma's shape: < 1 burstier than Poisson, 1 Poisson (arrival=gamma)
    num_requests: int = 64  # open-loop arrivals (first turns); 0: no cap
    duration_s: Optional[float] = None  # arrivals after this many s are dropped; None: no limit
    input_len: LengthConfig = field(default_factory=_default_input)
    output_len: LengthConfig = field(default_factory=_default_output)
    overlength: str = "clip"  # clip (shorten the output, then the prompt, to fit max_model_len) | reject (refuse it)
    # Trace: lengths (and hash ids) come from the file; arrivals too when arrival == "trace",
    # else from the synthetic process at `rate` (real lengths at a controlled load).
    path: Optional[str] = None
    format: Optional[str] = None  # azure_csv | mooncake_jsonl | native_jsonl; None: detected from the file
    length_scale: float = 1.0  # trace lengths (and prefix_block_tokens) times this, rounded, >= 1 token
    speedup: float = 1.0  # trace replay's time compression (2.0: twice the rate; arrival=trace)
    start_s: float = 0.0  # trace time (s) where the replayed window starts; offsets count from it
    window_s: Optional[float] = None  # length of the replayed trace window (s of trace time); None: to the end
    prefix_block_tokens: int = 512  # tokens per trace hash id (a shared prefix block), times length_scale
    # onoff: Poisson bursts of on_s seconds separated by off_s of silence; `rate` is the mean.
    on_s: float = 2.0
    off_s: float = 2.0  # seconds of silence after each burst (arrival=onoff)
    # ramp: the rate rises linearly from ramp_start_rate to `rate` over ramp_s, then holds.
    ramp_start_rate: float = 0.5
    ramp_s: float = 10.0  # seconds the rate rises over (arrival=ramp)
    # Sessions (closed loop after the first turn).
    turns: int = 1  # turns per session (1: single requests)
    # wait from a request's end to its session's next turn or its closed-loop user's next request
    # (s; the mean when exponential); None: 1 s between a session's turns, 0 between a user's requests
    think_time_s: Optional[float] = None
    think_time_dist: str = "fixed"  # fixed | exponential: how think_time_s is drawn
    # Closed loop: `concurrency` users, each sending its next request when its last one ended
    # (+ think time); the requests (lengths, trace rows) are drawn as for the open loop.
    concurrency: int = 0  # users of a closed loop (never more requests in flight); 0: open loop
    paced: bool = False  # closed loop: also wait for each request's open-loop arrival (vLLM's --max-concurrency)
    system_prompt_len: int = 0  # tokens of one system prompt every synthetic request starts with (added to input_len)
    tenants: List[TenantConfig] = field(default_factory=list)  # mixed workload's traffic classes; empty: one, "default"
    # A decode background (interference studies): requests with short prompts and long outputs,
    # all arriving at t=0, tagged tenant "background", ahead of the arrivals above.
    background_requests: int = 0
    background_input_len: int = 16  # prompt tokens of each background request
    background_output_len: int = 256  # output tokens of each background request

    def validate(self) -> "WorkloadConfig":
        """Raise WorkloadError (one line, naming the key) on the first bad value."""
        _choice("workload.arrival", self.arrival, ARRIVALS)
        _choice("workload.overlength", self.overlength, OVERLENGTH)
        _choice("workload.think_time_dist", self.think_time_dist, THINK_DISTS)
        if self.format is not None:
            _choice("workload.format", self.format, TRACE_FORMATS)
        for key in ("rate", "length_scale", "speedup", "burstiness", "on_s", "ramp_s"):
            _positive(f"workload.{key}", getattr(self, key))
        for key in ("start_s", "off_s", "ramp_start_rate"):
            _non_negative(f"workload.{key}", getattr(self, key))
        if self.think_time_s is not None:
            _non_negative("workload.think_time_s", self.think_time_s)
        for key in ("num_requests", "system_prompt_len", "background_requests", "concurrency"):
            _non_negative(f"workload.{key}", getattr(self, key))
        if self.concurrency and self.num_requests == 0 and not self.path:
            raise WorkloadError(
                "workload.num_requests must be > 0 with workload.concurrency > 0 (the requests its users send)"
            )
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
            raise WorkloadError(
                "workload.turns and workload.tenants are for synthetic workloads (workload.path is set)"
            )
        for key in ("background_input_len", "background_output_len"):
            if getattr(self, key) < 1:
                raise WorkloadError(f"workload.{key} must be >= 1 (got {getattr(self, key)})")
        if self.num_requests == 0 and self.duration_s is None and not self.path and not self.background_requests:
            raise WorkloadError("workload.num_requests must be > 0 unless workload.duration_s or workload.path is set")
        self.input_len.validate("workload.input_len")
        self.output_len.validate("workload.output_len")
        self._validate_tenants()
        return self

    def think_s(self, closed: bool) -> float:
        """The mean think time: between a closed-loop user's requests (closed) or a session's turns."""
        if self.think_time_s is not None:
            return self.think_time_s
        return 0.0 if closed else 1.0

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
