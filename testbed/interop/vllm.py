"""vLLM's `vllm bench serve`: its custom dataset (to replay a point's prompts), its result keys
(to report a point as vLLM would), and its --save-result --save-detailed file (to import a run).

Key names and units follow vllm/benchmarks/serve.py (`benchmark()` result dict, `main_async`
setup keys) and vllm/benchmarks/datasets (`CustomDataset`): latencies in ms in the summary keys,
in seconds in the per-request lists; `p{N}_{metric}_ms` for each --metric-percentiles entry.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from testbed.interop.table import (
    REJECTED,
    InteropError,
    check_requests,
    checked_times,
    client_table,
    evenly_spaced,
    given_arrivals,
    per_request,
    pick_run,
    sorted_rows,
    write_lines,
)
from testbed.metrics.config import SLOConfig
from testbed.metrics.latency import first_last, pooled_itl, token_arrays
from testbed.metrics.slo import filtered_out, meets_slo
from testbed.metrics.summary import throughput

PERCENTILES = (50, 90, 95, 99)  # as `--metric-percentiles 50,90,95,99` (vLLM's default is 99 alone)
DETAIL_FLAG = "vllm bench serve --save-result --save-detailed"


def write_vllm_custom_jsonl(rows: pd.DataFrame, path, decode: Callable[[Sequence[int]], str]) -> Path:
    """`--dataset-name custom` lines {"prompt": text, "output_tokens": n}, in arrival order.
    Replay them with --custom-output-len -1 (so output_tokens counts), --skip-chat-template and
    --disable-shuffle (vLLM shuffles and templates custom prompts by default). The text re-tokenizes
    to about, not exactly, the same ids: the result's input_lens say what was sent."""
    rows = sorted_rows(rows)
    if "prompt_token_ids" not in rows or any(ids is None for ids in rows["prompt_token_ids"]):
        raise InteropError("write_vllm_custom_jsonl: every row needs prompt_token_ids (a text prompt needs the tokens)")
    lines = [
        json.dumps({"prompt": decode([int(t) for t in ids]), "output_tokens": int(n)})
        for ids, n in zip(rows["prompt_token_ids"], rows["output_len"])
    ]
    return write_lines(path, lines)


def bench_result(
    requests: pd.DataFrame,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    model_id: str,
    request_rate: float,
    max_concurrency: Optional[int] = None,
    detailed: bool = True,
    burstiness: float = 1.0,
    decode: Optional[Callable] = None,
) -> dict:
    """A point's requests as `vllm bench serve --save-result [--save-detailed]` would write them,
    with `--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99 --goodput
    ttft:<ms> tpot:<ms>`. Figures follow testbed/metrics/latency.py (the same definitions vLLM
    uses; TTFT counts from the arrival). Requests the workload's overlength filter refused were
    never offered and are left out; failed ones and admission refusals count in `failed`.
    `duration` is the testbed's throughput span (first arrival to last token), so
    request_throughput equals summary.json's. A table already filtered for warm-up stays so."""
    table = requests[~filtered_out(requests)].sort_values("arrival_s", kind="stable")
    ok = table[table["status"] == "ok"]
    duration = throughput(table)["duration_s"]
    per_s = (lambda x: float(x) / duration) if duration > 0 else (lambda x: float("nan"))
    total_in, total_out = int(ok["input_len"].sum()), int(ok["num_tokens"].sum())
    good = int(meets_slo(ok, SLOConfig(slo_ttft_s, slo_tpot_s)).sum())
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "testbed",
        "backend": "testbed",
        "label": None,
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": int(len(table)),
        "request_rate": request_rate if np.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": duration,
        "completed": int(len(ok)),
        "failed": int(len(table) - len(ok)),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    if detailed:
        result.update(_details(table, decode))
    result.update(_peaks(ok))
    for name, values in (("ttft", ok["ttft"]), ("tpot", ok["tpot"]), ("itl", pooled_itl(ok)), ("e2el", ok["e2e"])):
        result.update(_statistics(name, values))
    return result


def _statistics(name: str, seconds) -> dict:
    """mean/median/std and percentiles in ms; 0 when empty, as vLLM's `np.mean(x or 0)`."""
    x = np.asarray(seconds, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    if not x.size:
        x = np.zeros(1)
    out = {
        f"mean_{name}_ms": float(x.mean()) * 1000,
        f"median_{name}_ms": float(np.median(x)) * 1000,
        f"std_{name}_ms": float(x.std()) * 1000,
    }
    out.update({f"p{p}_{name}_ms": float(np.percentile(x, p)) * 1000 for p in PERCENTILES})
    return out


def _details(table: pd.DataFrame, decode: Optional[Callable]) -> dict:
    """The per-request lists of --save-detailed (seconds; a failed request's ttft 0 unless it
    had tokens, its output length 0)."""
    flat, sizes = token_arrays(table["token_times"])
    first, last = first_last(flat, sizes)
    arrival = table["arrival_s"].to_numpy(np.float64)
    ok = (table["status"] == "ok").to_numpy()
    starts = np.cumsum(sizes) - sizes
    itls = [np.diff(flat[s : s + n]).tolist() for s, n in zip(starts, sizes)]
    texts = [
        decode([int(t) for t in ids]) if decode is not None and good else ""
        for ids, good in zip(table["output_token_ids"], ok)
    ]
    errors = [
        "" if good else (REJECTED if status == "rejected" else "") + (reason or status)
        for good, status, reason in zip(ok, table["status"], table["reason"])
    ]
    return {
        "input_lens": table["input_len"].astype(int).tolist(),
        "output_lens": np.where(ok, sizes, 0).tolist(),
        "ttfts": np.nan_to_num(first - arrival).tolist(),
        "itls": itls,
        "latencies": np.nan_to_num(last - arrival).tolist(),
        "start_times": arrival.tolist(),
        "queue_times": [0.0] * len(table),
        "generated_texts": texts,
        "errors": errors,
    }


def _peaks(ok: pd.DataFrame) -> dict:
    """vLLM's max_output_tokens_per_s (tokens per whole second from the first start) and
    max_concurrent_requests (peak of the half-open intervals [start, last token))."""
    flat, sizes = token_arrays(ok["token_times"])
    if not sizes.any():
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    start = ok["arrival_s"].to_numpy(np.float64)
    end = first_last(flat, sizes)[1]
    buckets = np.floor(flat - start.min()).astype(np.int64)
    events = sorted([(s, 1) for s in start] + [(e, -1) for e in end if not np.isnan(e)])
    return {
        "max_output_tokens_per_s": float(np.bincount(buckets[buckets >= 0]).max()),
        "max_concurrent_requests": int(np.max(np.cumsum([d for _, d in events]))),
    }


def read_vllm_result(path, *, run: int = -1, arrivals: Optional[Sequence[float]] = None) -> pd.DataFrame:
    """A `--save-result --save-detailed` file as a requests table (seconds since the first arrival).

    Arrivals: recent vLLM saves `start_times` (perf_counter when each request was sent) and
    `queue_times` (its wait for a --max-concurrency slot, `client_queue_time`): arrival = start -
    queue. A file with `start_times` alone takes them as the arrivals (meta says the wait is not
    in TTFT). Older files have neither: `arrivals` when given (e.g. a trace's timestamps), else the send times the
    client aimed at, reconstructed from `request_rate` (all at 0 for inf; else one every 1/rate,
    the mean of the Poisson or gamma gaps vLLM drew but did not save). meta says which."""
    data = pick_run(path, run)
    ttfts = per_request(data, "ttfts", path, flag=DETAIL_FLAG)
    n = len(ttfts)
    lists = {k: per_request(data, k, path, n, DETAIL_FLAG) for k in ("itls", "input_lens", "output_lens", "errors")}
    latencies = per_request(data, "latencies", path, n) if isinstance(data.get("latencies"), list) else None
    check_requests(path, ttfts, lists, latencies)
    if "start_times" in data:
        sent = np.asarray(
            checked_times(path, "start_times", per_request(data, "start_times", path, n)), dtype=np.float64
        )
        if isinstance(data.get("queue_times"), list):
            queue = np.asarray(
                checked_times(path, "queue_times", per_request(data, "queue_times", path, n), 0.0), dtype=np.float64
            )
            arrival, how = sent - queue, "start_times - queue_times"
        else:  # versions that save send times without the --max-concurrency wait
            arrival = sent
            how = (
                "start_times (the file has no queue_times: a wait for a --max-concurrency slot, "
                "if there was one, is not in TTFT)"
            )
    elif arrivals is not None:
        arrival = sent = given_arrivals(arrivals, n, path)
        how = "given (a trace's timestamps)"
    else:
        arrival = sent = evenly_spaced(data.get("request_rate"), n)
        how = f"reconstructed: evenly spaced at request_rate={data.get('request_rate')}"
    table = client_table(arrivals=arrival, sent=sent, ttfts=ttfts, **lists)
    table.attrs["interop"] = {"format": "vllm", "arrivals": how, **scalars(data)}
    return table


def scalars(data: dict) -> dict:
    """The file's run-level entries (settings and summary figures), per-request lists left out."""
    return {k: v for k, v in data.items() if not isinstance(v, (list, dict))}


def is_vllm(data: dict) -> bool:
    return "total_token_throughput" in data or "endpoint_type" in data or "model_id" in data
