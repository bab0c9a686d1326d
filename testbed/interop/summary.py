"""Result files without per-request lists, as summary-only points.

Most published `vllm bench serve` and `sglang.bench_serving` results were saved without
`--save-detailed` / `--output-details`: no `ttfts`, `itls` or lengths per request, only the run's
summary figures. Such a file imports as a point whose summary.json holds those figures in the
testbed's keys (seconds, as every summary): TTFT, TPOT, ITL and E2E latency (mean and whichever
of p50/p90/p95/p99/max the file has), throughput, completed and failed counts and the offered
rate, with `summary_only: true`. What needs the requests themselves (SLO attainment under the
study's SLOs, goodput, intervals over requests, distributions) is null, never estimated; figures
that need it leave the point out and say so.

Formats read (key names from vllm/benchmarks/serve.py and benchmark_serving.py before it, and
sglang/bench_serving.py):
- vLLM 0.6-0.25+: `request_rate` a number, `"inf"`, or `Infinity` (a float rate of inf written by
  json.dump); `request_goodput` null without `--goodput` (spelt `request_goodput:` in 0.6);
  `failed` from about 0.7 on (before it, `num_prompts - completed`); `p{N}_{metric}_ms` for each
  `--metric-percentiles` entry, `median_*` always; `e2el` only when asked for.
- SGLang 0.4-0.5: `mean/median/std/p99_{ttft,tpot,itl}_ms`, `p95_itl_ms`, `max_itl_ms`,
  `*_e2e_latency_ms`; no failed count (unknown unless the line says `num_prompts`).
- Every request failed: `completed` 0, the latency figures 0 or absent: imported as null.
"""

from __future__ import annotations

import math
from typing import Optional

from testbed.interop.table import InteropError

# the testbed's summary key -> the file's metric name, per format
METRICS = {
    "vllm": {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"},
    "sglang": {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2e_latency"},
}
STATISTICS = ("mean", "p50", "p90", "p95", "p99", "max")


def is_summary_only(data: dict) -> bool:
    """A run saved without its per-request lists (no `ttfts`)."""
    return not isinstance(data.get("ttfts"), list)


def parse_rate(value, path) -> float:
    """The offered rate: a number, inf for `"inf"` / `Infinity` / a float inf, NaN when not
    recorded (None) or not a rate (SGLang's `"trace"`); anything else is refused."""
    if value is None or value == "trace":
        return math.nan
    if isinstance(value, bool):
        raise InteropError(f"{path}: request_rate={value!r} is not a rate (a number, inf or Infinity)")
    if isinstance(value, (int, float)):
        rate = float(value)
    elif isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "+inf"):
        return math.inf
    else:
        try:
            rate = float(value)
        except (TypeError, ValueError):
            raise InteropError(f"{path}: request_rate={value!r} is not a rate (a number, inf or Infinity)") from None
    if math.isnan(rate):
        return math.nan
    if rate <= 0:
        raise InteropError(f"{path}: request_rate={value!r}: expected a number > 0 or inf")
    return rate


def number(data: dict, key: str, path, *, minimum: float = 0.0, integer: bool = False) -> Optional[float]:
    """A summary figure of the file: None when absent, null or NaN; refused in one line when it is
    not a number or below `minimum`."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InteropError(f"{path}: {key}={value!r} is not a number")
    if math.isnan(value):
        return None
    if value < minimum or math.isinf(value):
        raise InteropError(f"{path}: {key}={value!r} is out of range (expected a finite number >= {minimum:g})")
    if integer and value != int(value):
        raise InteropError(f"{path}: {key}={value!r} is not a whole number")
    return int(value) if integer else float(value)


def counts(data: dict, path) -> dict:
    """Completed and failed requests (failed: the file's `failed`, else `num_prompts - completed`,
    else unknown: 0 with `failed_known` false)."""
    completed = number(data, "completed", path, integer=True)
    if completed is None:
        raise InteropError(f"{path}: no 'completed' count: not a vLLM or SGLang benchmark result")
    failed = number(data, "failed", path, integer=True)
    known = failed is not None
    if failed is None:
        prompts = number(data, "num_prompts", path, integer=True)
        if prompts is not None:
            if prompts < completed:
                raise InteropError(f"{path}: num_prompts={prompts} is below completed={completed}")
            failed, known = prompts - completed, True
    failed = failed or 0
    return {
        "ok": completed,
        "failed": failed,
        "rejected": 0,
        "refused": 0,
        "total": completed + failed,
        "failed_known": known,
    }


def latency(data: dict, fmt: str, name: str, path, completed: int) -> dict:
    """One latency's mean and percentiles in seconds (the file's are in ms); null where the file
    has none, and throughout when no request completed (the files write 0 there)."""
    metric = METRICS[fmt][name]
    out = {}
    for stat in STATISTICS:
        keys = [f"{stat}_{metric}_ms"] + ([f"median_{metric}_ms"] if stat == "p50" else [])
        values = [number(data, k, path) for k in keys]
        value = next((v for v in values if v is not None), None)
        out[stat] = value / 1000 if value is not None and completed > 0 else None
    return out


def throughput(data: dict, fmt: str, path, num_gpus: int) -> dict:
    duration = number(data, "duration", path)
    if duration is None:
        raise InteropError(f"{path}: no 'duration': not a vLLM or SGLang benchmark result")
    per_s = {
        "requests_per_s": number(data, "request_throughput", path),
        "output_tokens_per_s": number(data, "output_throughput", path),
        "input_tokens_per_s": number(data, "input_throughput", path),
        "total_tokens_per_s": number(data, "total_token_throughput" if fmt == "vllm" else "total_throughput", path),
    }
    if per_s["input_tokens_per_s"] is None and duration > 0:  # vLLM writes the total, not the rate
        total_in = number(data, "total_input_tokens", path)
        per_s["input_tokens_per_s"] = total_in / duration if total_in is not None else None
    gpus = max(int(num_gpus), 1)
    per_gpu = {
        f"{k}_per_gpu": (v / gpus if v is not None else None)
        for k, v in per_s.items()
        if k in ("requests_per_s", "output_tokens_per_s")
    }
    return {"duration_s": duration, **per_s, **per_gpu}


def summary_of(data: dict, fmt: str, path, *, num_gpus: int = 1, slo: Optional[dict] = None) -> dict:
    """The file's summary figures in summary.json's keys, marked `summary_only`."""
    if fmt not in METRICS:
        raise InteropError(f"{path}: format {fmt!r} has no summary reader (vllm, sglang)")
    numbers = counts(data, path)
    goodput_key = "request_goodput" if "request_goodput" in data else "request_goodput:"
    summary = {
        "summary_only": True,
        "num_requests": numbers,
        "num_gpus": num_gpus,
        **{name: latency(data, fmt, name, path, numbers["ok"]) for name in METRICS[fmt]},
        "throughput": throughput(data, fmt, path, num_gpus),
        "offered_rate": _finite_or_none(parse_rate(data.get("request_rate"), path)),
        "slo": slo or {},
        # attainment, goodput and everything per request need the requests: not in the file
        "slo_attainment": None,
        "source": {
            "format": fmt,
            "request_goodput": number(data, goodput_key, path),
            "note": "request_goodput is the file's own: good requests per second at the run's "
            "--goodput SLOs (null without them), not the study's attainment",
        },
    }
    return summary


def _finite_or_none(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None
