"""GuideLLM's benchmark report (`guidellm benchmark ... --output-path benchmarks.json`;
neuralmagic/guidellm, now vllm-project/guidellm): read one benchmark of it as a summary-only run.

The JSON report is {"benchmarks": [...]} (0.2-0.5; 0.4+ adds `metadata` and `args`), one entry per
strategy run (a sweep writes several: `run` picks one, default the last). Each entry's `metrics`
holds StatusDistributionSummary blocks {"successful" | "errored" | "incomplete" | "total":
{mean, median, max, percentiles {p50 (0.4+), p90, p95, p99, ...}, count, ...}}:
`time_to_first_token_ms`, `inter_token_latency_ms`, `time_per_output_token_ms` (ms),
`request_latency` (seconds), `requests_per_second`, `prompt_token_count`, `output_token_count`;
`metrics.request_totals` (0.3+) or the entry's `request_totals` (0.2) counts requests. The strategy is
`config.strategy` (0.3+) or `args.strategy` (0.2): synchronous, concurrent (`streams`),
throughput, constant or poisson (`rate`). YAML and CSV reports are not read.

The client's definitions (guidellm/schemas/request_stats.py, benchmark/schemas/generative/
metrics.py; 0.2: benchmark/benchmark.py), and how each becomes the testbed's:
- TTFT (`time_to_first_token_ms`): from the request's start (the worker's send; the wait in the
  scheduler's queue is not in it) to the first streamed iteration that carried output. Compared as is.
- ITL (`inter_token_latency_ms`): (last token time - first token time) / (output tokens - 1): the
  testbed's TPOT, per token, not a gap between chunks. Its distribution weights each request by
  its output tokens - 1 in 0.4+ (`count` is tokens, not requests), one value per request in 0.2:
  with equal output lengths (the usual synthetic `output_tokens=N`) both are the per-request
  figure; otherwise the 0.4+ mean is token-weighted. Read as the testbed's `tpot`.
- TPOT (`time_per_output_token_ms`): GuideLLM's is not the testbed's: (last - start) / output
  tokens, TTFT included, in 0.4+; (last - first) / output tokens in 0.2. Not read.
- E2E (`request_latency`, seconds): start to the end of the response. Compared as is.
- Output tokens: the server's usage count (`prefer_response_metrics`, the default), else the
  client's count of streamed iterations.
- Throughput: `requests_per_second.successful.mean` (completed requests per second of the
  benchmark); output and input tokens per second are that times the mean output and prompt
  length of the successful requests (GuideLLM's `output_tokens_per_second` is a per-request
  rate distribution, not the run's throughput).
- Requests cancelled when the duration ran out (`incomplete`) are not failures; `errored` are.
The sample of requests some reports keep (`requests`, `--sample-requests`) is not the whole run
and is not read.
"""

from __future__ import annotations

import math
from typing import Optional

from testbed.interop.client_run import ClientRun, count, empty_figures, mapping, seconds
from testbed.interop.table import InteropError, load_runs

FORMAT = "guidellm"
# the testbed's figure -> (GuideLLM metric, scale to seconds)
LATENCY_KEYS = {
    "ttft": ("time_to_first_token_ms", 1e-3),
    "tpot": ("inter_token_latency_ms", 1e-3),
    "e2e": ("request_latency", 1.0),
}
PERCENTILES = {"p50": "p50", "p90": "p90", "p95": "p95", "p99": "p99"}
CLOSED_LOOP = ("synchronous", "concurrent", "throughput")
DEFINITIONS = {
    "ttft": "the request's start (the worker's send) to the first streamed iteration with output",
    "tpot": "GuideLLM's inter_token_latency_ms: (last token - first token) / (output tokens - 1), per token",
    "e2e": "request_latency: start to the end of the response",
    "itl": "not in the report (GuideLLM's ITL is the per-request mean, read as tpot)",
    "guidellm_tpot": "time_per_output_token_ms, TTFT included (0.4+) or over all output tokens (0.2): not read",
    "converted": "TTFT and E2E as they are; the testbed's TPOT is GuideLLM's ITL",
}


def is_guidellm(data) -> bool:
    benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
    return (
        isinstance(benchmarks, list)
        and bool(benchmarks)
        and isinstance(benchmarks[0], dict)
        and isinstance(benchmarks[0].get("metrics"), dict)
        and "time_to_first_token_ms" in benchmarks[0]["metrics"]
    )


def read_guidellm(path, *, run: int = -1) -> ClientRun:
    """The `run`-th benchmark of the report (default: the last) as a summary-only run."""
    runs = load_runs(path)
    data = runs[0]
    if len(runs) != 1 or not is_guidellm(data):
        raise InteropError(f"{path}: not a GuideLLM JSON report (no benchmarks[...].metrics.time_to_first_token_ms)")
    benchmarks = data["benchmarks"]
    if not -len(benchmarks) <= run < len(benchmarks):
        raise InteropError(
            f"{path}: run={run} is out of range (the report holds {len(benchmarks)} benchmarks: "
            f"0..{len(benchmarks) - 1})"
        )
    bench = benchmarks[run]
    where = f"{path}: benchmarks[{run}]"
    metrics = mapping(bench, "metrics", where, required=True)
    figures = empty_figures()
    tokens_weighted = False
    for name, (key, scale) in LATENCY_KEYS.items():
        block = mapping(mapping(metrics, key, f"{where}.metrics"), "successful", f"{where}.metrics.{key}")
        figures[name].update(_statistics(block, scale, f"{where}.metrics.{key}.successful"))
    totals = _totals(bench, metrics, where)
    itl = mapping(metrics.get("inter_token_latency_ms") or {}, "successful", where)
    if isinstance(itl.get("count"), (int, float)) and itl["count"] > max(totals["successful"], 1):
        tokens_weighted = True
    rps = seconds(_successful(metrics, "requests_per_second").get("mean"), 1.0, f"{where}: requests_per_second")
    out_len = _successful(metrics, "output_token_count").get("mean")
    in_len = _successful(metrics, "prompt_token_count").get("mean")
    out_len = float(out_len) if isinstance(out_len, (int, float)) else None
    in_len = float(in_len) if isinstance(in_len, (int, float)) else None
    throughput = {
        "requests_per_s": rps,
        "output_tokens_per_s": rps * out_len if rps is not None and out_len is not None else None,
        "input_tokens_per_s": rps * in_len if rps is not None and in_len is not None else None,
        "duration_s": _duration(bench),
    }
    throughput["total_tokens_per_s"] = (
        throughput["output_tokens_per_s"] + throughput["input_tokens_per_s"]
        if throughput["input_tokens_per_s"] is not None and throughput["output_tokens_per_s"] is not None
        else None
    )
    strategy = _strategy(bench)
    kind = str(strategy.get("type_") or "")
    rate, arrival, concurrency = math.nan, None, None
    if kind in ("constant", "poisson"):
        rate = seconds(strategy.get("rate"), 1.0, f"{where}: strategy.rate") or math.nan
        arrival = kind
    elif kind == "synchronous":
        rate, concurrency = math.inf, 1
    elif kind == "concurrent":
        rate, concurrency = math.inf, count(strategy.get("streams"), f"{where}: strategy.streams")
    elif kind == "throughput":
        rate, concurrency = math.inf, count(strategy.get("max_concurrency"), f"{where}: strategy.max_concurrency")
    notes = []
    if kind in CLOSED_LOOP:
        notes.append(
            f"strategy {kind}: a closed loop (at most {concurrency or 'unbounded'} in flight), not an offered rate"
        )
    definitions = dict(DEFINITIONS)
    definitions["tpot"] += (
        "; distribution weighted by each request's output tokens - 1" if tokens_weighted else "; one value per request"
    )
    counts = {
        "ok": totals["successful"],
        "failed": totals["errored"],
        "total": totals["successful"] + totals["errored"],
        "failed_known": True,
    }
    args = data.get("args") if isinstance(data.get("args"), dict) else {}
    model = (
        args.get("model")
        or (bench.get("config") or {}).get("backend", {}).get("model")
        or (bench.get("worker") or {}).get("backend_model")
    )
    return ClientRun(
        format=FORMAT,
        figures=figures,
        throughput=throughput,
        counts=counts,
        rate=rate,
        arrival=arrival,
        max_concurrency=concurrency,
        num_requests=totals["successful"] + totals["errored"] + totals["incomplete"],
        definitions=definitions,
        lengths={"input_len": in_len, "output_len": out_len},
        model=model if isinstance(model, str) else None,
        notes=notes,
        settings={
            "strategy": kind,
            "rate": strategy.get("rate"),
            "incomplete": totals["incomplete"],
            "guidellm_version": (data.get("metadata") or {}).get("guidellm_version"),
        },
    )


def _statistics(block: dict, scale: float, where: str) -> dict:
    out = {
        "mean": seconds(block.get("mean"), scale, f"{where}.mean"),
        "max": seconds(block.get("max"), scale, f"{where}.max"),
    }
    percentiles = block.get("percentiles") if isinstance(block.get("percentiles"), dict) else {}
    for stat, key in PERCENTILES.items():
        value = percentiles.get(key, block.get("median") if stat == "p50" else None)
        out[stat] = seconds(value, scale, f"{where}.percentiles.{key}")
    if not block.get("count"):  # no successful request: GuideLLM writes zeros
        return {k: None for k in out}
    return out


def _successful(metrics: dict, key: str) -> dict:
    block = metrics.get(key)
    inner = block.get("successful") if isinstance(block, dict) else None
    return inner if isinstance(inner, dict) else {}


def _totals(bench: dict, metrics: dict, where: str) -> dict:
    source = metrics.get("request_totals")  # 0.3+
    if not isinstance(source, dict):
        source = bench.get("request_totals")  # 0.2
    if not isinstance(source, dict):
        source = (bench.get("run_stats") or {}).get("requests_made")
    if not isinstance(source, dict):
        raise InteropError(f"{where}: no request counts (metrics.request_totals or run_stats.requests_made)")
    return {
        k: count(source.get(k), f"{where}: request counts.{k}") or 0 for k in ("successful", "errored", "incomplete")
    }


def _strategy(bench: dict) -> dict:
    for holder in (bench.get("config"), bench.get("args")):
        if isinstance(holder, dict) and isinstance(holder.get("strategy"), dict):
            return holder["strategy"]
    return {}


def _duration(bench: dict) -> Optional[float]:
    if isinstance(bench.get("duration"), (int, float)) and bench["duration"] > 0:  # 0.2
        return float(bench["duration"])
    metrics = bench.get("scheduler_metrics")
    if isinstance(metrics, dict):
        start, end = metrics.get("measure_start_time"), metrics.get("measure_end_time")
    else:
        stats = bench.get("run_stats") or {}
        start, end = stats.get("start_time"), stats.get("end_time")
    if isinstance(start, (int, float)) and isinstance(end, (int, float)) and end > start:
        return float(end - start)
    return None
