"""A benchmark client's summary report read into the testbed's terms: what inference-perf's
lifecycle-metrics JSON and GuideLLM's benchmark report hold (inference_perf.py, guidellm.py).

Neither report carries the whole per-request record the testbed's requests table needs (GuideLLM
keeps a sample of requests, inference-perf's per-request file is a separate, large file), so both
import as summary-only points, like a vLLM or SGLang file saved without its per-request lists
(summary.py): the client's figures converted to the testbed's definitions, in seconds; what has
no counterpart stays None, never estimated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from testbed.interop.table import InteropError

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATISTICS = ("mean", "p50", "p90", "p95", "p99", "max")


@dataclass
class ClientRun:
    """One run of a client report. Latencies in seconds, rates per second, None where absent."""

    format: str
    figures: dict  # {"ttft" | "tpot" | "itl" | "e2e": {statistic: seconds or None}}
    throughput: dict  # requests_per_s, output_tokens_per_s, input_tokens_per_s, total_tokens_per_s, duration_s
    counts: dict  # ok, failed, total, failed_known
    rate: float  # offered rate (inf: as fast as the concurrency allows; nan: not in the file)
    arrival: Optional[str]  # poisson | constant | None (closed loop or not recorded)
    max_concurrency: Optional[int]
    num_requests: Optional[int]
    definitions: dict  # the client's definitions and how each became the testbed's
    settings: dict = field(default_factory=dict)  # the run's scalar settings, for meta.json
    lengths: dict = field(default_factory=dict)  # mean prompt and output tokens of served requests
    model: Optional[str] = None
    notes: list = field(default_factory=list)

    def summary(self, *, num_gpus: int = 1, slo: Optional[dict] = None) -> dict:
        """summary.json's keys for a summary-only point (as summary.summary_of writes them)."""
        gpus = max(int(num_gpus), 1)
        per_s = dict(self.throughput)
        for key in ("requests_per_s", "output_tokens_per_s"):
            per_s[f"{key}_per_gpu"] = per_s[key] / gpus if per_s.get(key) is not None else None
        rate = self.rate if math.isfinite(self.rate) else None
        return {
            "summary_only": True,
            "num_requests": {"rejected": 0, "refused": 0, **self.counts},
            "num_gpus": num_gpus,
            **{name: dict(self.figures[name]) for name in LATENCIES},
            "throughput": per_s,
            "offered_rate": rate,
            "slo": slo or {},
            "slo_attainment": None,
            "source": {
                "format": self.format,
                "definitions": self.definitions,
                "notes": list(self.notes),
                "note": "the client's own summary figures converted to the testbed's definitions; "
                "SLO attainment and goodput need the requests: not in the file",
            },
        }


def seconds(value, scale: float, where: str) -> Optional[float]:
    """A latency figure in seconds: None when absent or null; refused when not a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InteropError(f"{where}={value!r} is not a finite number >= 0")
    return float(value) * scale


def count(value, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise InteropError(f"{where}={value!r} is not a whole number >= 0")
    return int(value)


def mapping(data, key: str, where: str, required: bool = False) -> dict:
    value = data.get(key) if isinstance(data, dict) else None
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise InteropError(f"{where}.{key}: expected an object (got {type(value).__name__})")
    return value


def empty_figures() -> dict:
    return {name: {s: None for s in STATISTICS} for name in LATENCIES}
