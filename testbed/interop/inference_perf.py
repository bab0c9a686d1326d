"""inference-perf's request-lifecycle report (kubernetes-sigs/inference-perf): read
`summary_lifecycle_metrics.json` or a `stage_N_lifecycle_metrics.json` as a summary-only run.

The file (inference_perf/reportgen/base.py, `summarize_requests`): `load_summary` (`count`,
`schedule_delay`; newer versions `requested_rate`, `achieved_rate`), `successes` (`count`,
`latency` {`request_latency`, `time_to_first_token`, `time_per_output_token`,
`normalized_time_per_output_token`, `inter_token_latency`}, `throughput` {`requests_per_sec`,
`input_tokens_per_sec`, `output_tokens_per_sec`, `total_tokens_per_sec`}, `prompt_len`,
`output_len`), `failures` (`count`, ...). Each latency is {mean, min, max, median, p0.1 ... p99.9}
in seconds over the successful requests of the stage (or of the whole run).

The client's definitions (its metrics page and its code), and how each becomes the testbed's:
- E2E (`request_latency`): the request's send to the end of its stream. As the testbed's, except
  that the send is the client's actual dispatch: `load_summary.schedule_delay` (how late that was
  against the load schedule) is in no latency. A large delay means the offered rate was not sent.
- TTFT (`time_to_first_token`): the send to the first output timestamp. Versions up to about
  v0.2 (2025) stamp every server-sent event, content or not (a chat stream's first, role-only
  delta stops the clock); later ones re-tokenize each chunk and stamp only chunks with text, as
  its metrics page defines it ("first non empty output token"). Compared as is.
- TPOT (`time_per_output_token`): (last output timestamp - first) / (output tokens - 1), the
  output tokens the client's re-tokenization of the streamed text (the server's usage count with
  `use_server_output_tokens`): per token, the testbed's TPOT, up to the tokenizer's count (older
  versions' last timestamp is the `[DONE]` event). Compared as is.
- NTPOT (`normalized_time_per_output_token`): latency / output tokens, TTFT included: not the
  testbed's TPOT; not read.
- ITL (`inter_token_latency`): gaps between consecutive output timestamps pooled over requests:
  per stream event in older versions, per token in later ones with a chunk's tokens sharing its
  arrival (intra-chunk gaps 0, so a median ITL of microseconds). Kept as `itl`, never compared.
The summary is summary-only: the per-request file (`per_request_lifecycle_metrics.json`) is not read.
"""

from __future__ import annotations

import math
from typing import Optional

from testbed.interop.client_run import ClientRun, count, empty_figures, mapping, seconds
from testbed.interop.table import InteropError, load_runs

FORMAT = "inference_perf"
LATENCY_KEYS = {
    "ttft": "time_to_first_token",
    "tpot": "time_per_output_token",
    "itl": "inter_token_latency",
    "e2e": "request_latency",
}
STAT_KEYS = {"mean": "mean", "p50": "median", "p90": "p90", "p95": "p95", "p99": "p99", "max": "max"}
SCHEDULE_LAG_NOTE_S = 1.0  # a mean schedule delay above this is reported: the rate was not what was sent
DEFINITIONS = {
    "ttft": "send (the actual dispatch) to the first output timestamp: the first server-sent event, content or "
    "not, up to about v0.2; the first chunk with text later",
    "tpot": "(last - first output timestamp) / (output tokens - 1), tokens by the client's re-tokenization (or the "
    "server's count): per token, as the testbed's",
    "e2e": "send to the end of the stream (the schedule delay excluded)",
    "itl": "gaps between output timestamps pooled over requests: per event (older) or per token with a chunk's "
    "tokens at its arrival (newer); not comparable",
    "ntpot": "latency / output tokens, TTFT included: not read",
    "converted": "TTFT, TPOT and E2E compare as they are; ITL is kept, not compared",
}


def is_inference_perf(data) -> bool:
    """A lifecycle-metrics report: `successes` with a `latency` block beside a `load_summary` or
    `failures` block."""
    return (
        isinstance(data, dict)
        and isinstance(data.get("successes"), dict)
        and isinstance(data["successes"].get("latency"), dict)
        and ("load_summary" in data or "failures" in data)
    )


def read_inference_perf(path, *, run: int = -1) -> ClientRun:
    """The report as a summary-only run (a stage file and the summary file each hold one run)."""
    runs = load_runs(path)
    if len(runs) != 1 or run not in (0, -1):
        raise InteropError(f"{path}: an inference-perf report holds one run (a stage file per stage); run={run}")
    data = runs[0]
    if not is_inference_perf(data):
        hint = (
            " (this is the server's Prometheus summary: read the client's summary_lifecycle_metrics.json)"
            if isinstance(data.get("successes"), dict) and "time_to_first_token" in data["successes"]
            else ""
        )
        raise InteropError(
            f"{path}: not an inference-perf lifecycle-metrics report (no successes.latency beside "
            f"load_summary or failures){hint}"
        )
    where = str(path)
    successes = mapping(data, "successes", where, required=True)
    load = mapping(data, "load_summary", where)
    failures = mapping(data, "failures", where)
    latency = mapping(successes, "latency", f"{where}: successes", required=True)
    figures = empty_figures()
    for name, key in LATENCY_KEYS.items():
        block = mapping(latency, key, f"{where}: successes.latency")
        for stat, field in STAT_KEYS.items():
            figures[name][stat] = seconds(block.get(field), 1.0, f"{where}: successes.latency.{key}.{field}")
    ok = count(successes.get("count"), f"{where}: successes.count")
    if ok is None:
        raise InteropError(f"{path}: no successes.count")
    failed = count(failures.get("count"), f"{where}: failures.count")
    counts = {"ok": ok, "failed": failed or 0, "total": ok + (failed or 0), "failed_known": failed is not None}
    rates = mapping(successes, "throughput", f"{where}: successes")
    throughput = {
        "requests_per_s": seconds(rates.get("requests_per_sec"), 1.0, f"{where}: requests_per_sec"),
        "output_tokens_per_s": seconds(rates.get("output_tokens_per_sec"), 1.0, f"{where}: output_tokens_per_sec"),
        "input_tokens_per_s": seconds(rates.get("input_tokens_per_sec"), 1.0, f"{where}: input_tokens_per_sec"),
        "total_tokens_per_s": seconds(rates.get("total_tokens_per_sec"), 1.0, f"{where}: total_tokens_per_sec"),
    }
    throughput["duration_s"] = counts["ok"] / throughput["requests_per_s"] if throughput["requests_per_s"] else None
    requested = seconds(load.get("requested_rate"), 1.0, f"{where}: load_summary.requested_rate")
    rate = requested if requested else math.nan
    notes = []
    lag = mapping(load, "schedule_delay", f"{where}: load_summary")
    lag_mean = lag.get("mean") if isinstance(lag.get("mean"), (int, float)) else None
    if lag_mean is not None and lag_mean > SCHEDULE_LAG_NOTE_S:
        notes.append(
            f"the client sent requests {lag_mean:.1f} s after their scheduled time on average "
            f"(load_summary.schedule_delay): the load was bounded by the client or a concurrency cap, "
            f"not the offered rate"
        )
    if rate != rate:
        notes.append(
            "no requested_rate in the file (versions before it, or a concurrency stage): the rate comes "
            "from the run's config.yaml"
        )
    lengths = {"input_len": _mean(successes, "prompt_len"), "output_len": _mean(successes, "output_len")}
    total = count(load.get("count"), f"{where}: load_summary.count")
    return ClientRun(
        format=FORMAT,
        figures=figures,
        throughput=throughput,
        counts=counts,
        rate=rate,
        arrival=None,
        max_concurrency=None,
        num_requests=total or counts["total"],
        definitions=dict(DEFINITIONS),
        lengths=lengths,
        notes=notes,
        settings={
            "requested_rate": load.get("requested_rate"),
            "achieved_rate": load.get("achieved_rate"),
            "schedule_delay_mean_s": lag_mean,
        },
    )


def _mean(successes: dict, key: str) -> Optional[float]:
    block = successes.get(key)
    value = block.get("mean") if isinstance(block, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
