"""A real engine's benchmark result read as a replay reference: the figures it reports, in the
testbed's definitions, and what it says about the workload it ran.

Four clients' files are read: vLLM `bench serve` JSON and SGLang `bench_serving` JSONL, in two
kinds, and inference-perf's lifecycle-metrics JSON and GuideLLM's JSON report, summary-only (their
definitions and conversions: testbed/interop/inference_perf.py and guidellm.py; in short,
inference-perf's TPOT and GuideLLM's ITL are the testbed's TPOT, GuideLLM's TPOT and
inference-perf's NTPOT include TTFT and are not read, neither ITL is compared):
- with per-request lists (`--save-detailed` / `--output-details`): the requests table of
  read_vllm_result / read_sglang_result, its figures recomputed by the testbed's own
  definitions (testbed/metrics/latency.py), and the lengths and arrivals that rebuild the run;
- summary-only (what projects publish): the file's own summary figures, converted to seconds.
  A published table turned into a file may lack `duration` and `completed`; what is absent stays
  None and is never estimated.

The clients' definitions, and how each converts to the testbed's (TTFT from the request's
arrival to its first token; TPOT = (last token - first token) / (output tokens - 1) per
request; E2E from arrival to the last token):
- vLLM `bench serve` (vllm/benchmarks/serve.py, benchmark_serving.py before 0.10): TTFT from
  the send (after any --max-concurrency wait) to the first chunk with content (an empty first
  chunk does not stop the clock); TPOT = (latency - ttft) / (output_len - 1) with output_len the
  server's token count (or the retokenized text), so per token, not per chunk; ITL per chunk.
  Same as the testbed's once arrivals are start_times - queue_times; summary TPOT is used as is.
- SGLang `bench_serving` (0.3-0.5): TTFT from the send to the first chunk with content; TPOT =
  (latency - ttft) / (output_len - 1) over tokens (output_len the server's count; the 0.2
  scripts divided by output_len - 2), so per token; ITL per stream chunk: with several tokens per
  chunk (multi-step scheduling, speculative decoding) ITL is the gap between chunks, not tokens,
  and is not comparable with a per-token ITL (`itl_per_chunk` says so). E2E `e2e_latency`.
- Neither client saves its drawn arrival gaps before vLLM 0.10 (`start_times`): a detailed file
  without them is rebuilt at the file's rate with the synthetic process (see rebuilt_workload).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from testbed.interop.exchange import format_of
from testbed.interop.guidellm import read_guidellm
from testbed.interop.inference_perf import read_inference_perf
from testbed.interop.sglang import read_sglang_result
from testbed.interop.summary import METRICS, STATISTICS, is_summary_only, number, parse_rate
from testbed.interop.table import InteropError, load_runs, pick_run
from testbed.interop.vllm import read_vllm_result, scalars
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.summary import summarize

FIGURES = ("ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p99")
# per-request TPOT in these clients: per token (over output_len - 1), as the testbed's
TPOT_DEFINITION = {
    "vllm": "(latency - ttft) / (output_len - 1): per token",
    "sglang": "(latency - ttft) / (output_len - 1): per token (0.2 scripts: output_len - 2)",
}
TTFT_DEFINITION = {
    "vllm": "send (after a --max-concurrency wait) to the first chunk with content",
    "sglang": "send to the first chunk with content",
}
ITL_DEFINITION = "gap between stream chunks (a chunk may carry several tokens)"
CLIENT_REPORTS = {"inference_perf": read_inference_perf, "guidellm": read_guidellm}


@dataclass
class Reference:
    """A real run's figures (seconds; None where the file has none) and its workload."""

    path: Path
    format: str
    figures: dict  # {"ttft" | "tpot" | "e2e": {stat: seconds or None}}
    throughput: dict  # {"requests_per_s", "output_tokens_per_s"}: per second or None
    rate: float  # the offered rate (inf: all at once; nan: not recorded)
    num_requests: Optional[int]
    max_concurrency: Optional[int]
    burstiness: float
    requests: Optional[pd.DataFrame] = None  # per-request rows (detailed files only)
    definitions: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # the file's run-level entries
    arrival: Optional[str] = None  # the client's arrival process where the file says (poisson | constant)
    notes: list = field(default_factory=list)  # what the file says about how far to trust it

    @property
    def detailed(self) -> bool:
        return self.requests is not None


def detect(data: dict, path) -> str:
    # a summary line of bench_serving names its backend without SGLang's own keys
    found = format_of(data) or (
        "sglang" if data.get("backend") in ("sglang", "vllm") and "median_e2e_latency_ms" in data else None
    )
    if found is None:
        raise InteropError(f"{path}: not a vLLM, SGLang, inference-perf or GuideLLM benchmark result")
    return found


def read_reference(path, *, fmt: Optional[str] = None, run: int = -1) -> Reference:
    """The `run`-th run of a result file as a replay reference (GuideLLM: its `run`-th benchmark)."""
    path = Path(path)
    runs = load_runs(path)
    fmt = fmt or detect(runs[-1], path)
    if fmt in CLIENT_REPORTS:
        return _client_reference(path, fmt, run)
    data = pick_run(path, run)
    if fmt not in METRICS:
        raise InteropError(f"{path}: format {fmt!r} is not one of {', '.join(METRICS)}")
    rate = parse_rate(data.get("request_rate"), path)
    count = number(data, "num_prompts", path, integer=True)
    concurrency = number(data, "max_concurrency", path, integer=True, minimum=1)
    burst = number(data, "burstiness", path)
    definitions = {
        "ttft": TTFT_DEFINITION[fmt],
        "tpot": TPOT_DEFINITION[fmt],
        "itl": ITL_DEFINITION,
        "converted": "TTFT, TPOT and E2E compare as they are (same definitions); ITL is not compared",
    }
    common = dict(
        path=path,
        format=fmt,
        rate=rate,
        max_concurrency=int(concurrency) if concurrency else None,
        burstiness=float(burst) if burst else 1.0,
        definitions=definitions,
        settings=scalars(data),
    )
    if is_summary_only(data):
        completed = number(data, "completed", path, integer=True)
        figures = {name: _summary_latency(data, fmt, name, path) for name in FIGURES}
        throughput = {
            "requests_per_s": number(data, "request_throughput", path),
            "output_tokens_per_s": number(data, "output_throughput", path),
        }
        return Reference(figures=figures, throughput=throughput, num_requests=count or completed, **common)
    reader = read_vllm_result if fmt == "vllm" else read_sglang_result
    requests = reader(path, run=run)
    summary = summarize(requests, slo=SLOConfig(), metrics=MetricsConfig(), num_gpus=1)
    figures = {name: {s: _finite(summary[name].get(s)) for s in STATS} for name in FIGURES}
    throughput = {k: _finite(summary["throughput"].get(k)) for k in ("requests_per_s", "output_tokens_per_s")}
    return Reference(figures=figures, throughput=throughput, num_requests=len(requests), requests=requests, **common)


def _client_reference(path: Path, fmt: str, run: int) -> Reference:
    """An inference-perf or GuideLLM report: its summary figures, already in the testbed's definitions."""
    client = CLIENT_REPORTS[fmt](path, run=run)
    figures = {name: {s: client.figures[name].get(s) for s in STATS} for name in FIGURES}
    throughput = {k: client.throughput.get(k) for k in ("requests_per_s", "output_tokens_per_s")}
    settings = {
        **client.settings,
        "mean_input_len": client.lengths.get("input_len"),
        "mean_output_len": client.lengths.get("output_len"),
        "model": client.model,
    }
    return Reference(
        path=path,
        format=fmt,
        figures=figures,
        throughput=throughput,
        rate=client.rate,
        num_requests=client.num_requests,
        max_concurrency=client.max_concurrency,
        burstiness=1.0,
        definitions=client.definitions,
        settings=settings,
        arrival=client.arrival,
        notes=list(client.notes),
    )


def _summary_latency(data: dict, fmt: str, name: str, path) -> dict:
    metric = METRICS[fmt][name]
    out = {}
    for stat in STATISTICS:
        keys = [f"{stat}_{metric}_ms"] + ([f"median_{metric}_ms"] if stat == "p50" else [])
        value = next((v for v in (number(data, k, path) for k in keys) if v is not None), None)
        out[stat] = value / 1000 if value is not None else None
    return {s: out.get(s) for s in STATS}


def _finite(value) -> Optional[float]:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def trace_rows(requests: pd.DataFrame) -> list[dict]:
    """A detailed reference's requests as the testbed's native trace lines (arrival offset,
    prompt length, output length: what the real engine produced for that request)."""
    ok = requests[requests["status"] == "ok"].sort_values("arrival_s", kind="stable")
    return [
        {"arrival_s": float(t), "input_len": max(int(i), 1), "output_len": max(int(n), 1)}
        for t, i, n in zip(ok["arrival_s"], ok["input_len"], ok["num_tokens"])
    ]


def relative_error(sim: Optional[float], real: Optional[float]) -> Optional[float]:
    """(sim - real) / real; None when either is missing or real is 0."""
    if sim is None or real is None or not real or not np.isfinite(sim) or not np.isfinite(real):
        return None
    return (float(sim) - float(real)) / float(real)
