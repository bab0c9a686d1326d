"""What a workload will cost, from its configuration alone: the requests it offers, the span of
their arrivals and the host memory its requests take. The root configuration refuses a run whose
estimate is above its limits before anything is drawn (a typo such as `num_requests=100000000` or
`rate=1e-9` would otherwise allocate for minutes or wait for years)."""

from __future__ import annotations

from typing import Optional

from testbed.workload.config import LengthConfig, WorkloadConfig

# host bytes, measured roughly: a prompt token (its int64 draw and its tuple slot), an output token
# (its id and time in the results, and their columns), a request (its objects, rows and arrays)
PROMPT_TOKEN_BYTES = 24
OUTPUT_TOKEN_BYTES = 64
REQUEST_BYTES = 2048
DRAWN_BYTES = 24  # per arrival drawn before a duration cut: its time and two lengths
TRACE_PROMPT, TRACE_OUTPUT = 1024, 256  # a trace's lengths before it is read (Azure's conversation means)


def mean_length(cfg: LengthConfig) -> float:
    """The distribution's mean, clipped to [min, max] (the midpoint where it names none)."""
    if cfg.dist == "empirical" and cfg.values:
        mean = sum(cfg.values) / len(cfg.values)
    elif cfg.dist in ("uniform", "zipf"):
        mean = (cfg.min + cfg.max) / 2
    else:
        mean = cfg.mean
    return min(max(mean, cfg.min), cfg.max)


def drawn_arrivals(cfg: WorkloadConfig) -> Optional[float]:
    """Open-loop arrivals drawn before any cut; None for a trace without num_requests (its file decides)."""
    if cfg.path:
        return float(cfg.num_requests) if cfg.num_requests else None
    if cfg.num_requests:
        return float(cfg.num_requests)
    # arrivals.synthetic_until draws about twice the expected count, then doubles until past duration_s
    return 2.0 * cfg.rate * cfg.duration_s + 16 if cfg.duration_s is not None else 0.0


def offered_requests(cfg: WorkloadConfig) -> Optional[float]:
    """Requests the run offers, later turns and the background included; None when a trace decides."""
    drawn = drawn_arrivals(cfg)
    if drawn is None:
        return None
    kept = drawn if cfg.duration_s is None or cfg.arrival == "trace" else min(drawn, cfg.rate * cfg.duration_s)
    return kept * cfg.turns + cfg.background_requests


def arrival_span_s(cfg: WorkloadConfig) -> Optional[float]:
    """Seconds from the start to the last arrival (later turns' think times included): a run lasts
    at least this long. None when a trace's timestamps decide."""
    if cfg.arrival == "trace":
        span = (
            cfg.duration_s
            if cfg.duration_s is not None
            else (cfg.window_s / cfg.speedup if cfg.window_s is not None else None)
        )
    else:
        n = drawn_arrivals(cfg)
        span = None if n is None else _synthetic_span(cfg, n)
        if span is not None and cfg.duration_s is not None:
            span = min(span, cfg.duration_s)
    if cfg.concurrency:  # a closed loop's span is its service time, unknown here: its think times bound it below
        return -(-(drawn_arrivals(cfg) or 0) // cfg.concurrency) * cfg.turns * cfg.think_s(closed=True)
    return None if span is None else span + (cfg.turns - 1) * cfg.think_s(closed=False)


def _synthetic_span(cfg: WorkloadConfig, n: float) -> float:
    """The expected time of the n-th arrival (`rate` is the mean rate of every process; a ramp
    rises to it linearly from ramp_start_rate over ramp_s)."""
    if cfg.arrival != "ramp":
        return n / cfg.rate
    area = (cfg.ramp_start_rate + cfg.rate) / 2 * cfg.ramp_s  # arrivals expected during the ramp
    if n > area:
        return cfg.ramp_s + (n - area) / cfg.rate
    slope = (cfg.rate - cfg.ramp_start_rate) / cfg.ramp_s
    if slope == 0:
        return n / cfg.rate
    return (-cfg.ramp_start_rate + (cfg.ramp_start_rate**2 + 2 * slope * n) ** 0.5) / slope


def host_bytes(cfg: WorkloadConfig, max_model_len: int) -> float:
    """Host memory the requests and their results take (0 for a trace without num_requests: the
    trace reader's file-size cap bounds it)."""
    drawn, offered = drawn_arrivals(cfg), offered_requests(cfg)
    if drawn is None or offered is None:
        return 0.0
    prompt, output = mean_length(cfg.input_len), mean_length(cfg.output_len)
    if cfg.path:  # a trace's lengths are in its file, unread: a conversation's, about
        prompt, output = TRACE_PROMPT, TRACE_OUTPUT
    output = min(output, max_model_len - 1)
    prompt = min(prompt + cfg.system_prompt_len, max_model_len - output)
    per_request = REQUEST_BYTES + prompt * PROMPT_TOKEN_BYTES + output * OUTPUT_TOKEN_BYTES
    return drawn * DRAWN_BYTES + offered * per_request
