"""SGLang's `python -m sglang.bench_serving --output-file X --output-details`: import a run.

The file is JSONL, one line appended per run: the run's settings and summary (`backend`,
`dataset_name`, `request_rate`, `duration`, `completed`, `mean_ttft_ms`, ...) and, with
--output-details, the per-request lists `input_lens`, `output_lens`, `ttfts`, `itls`,
`generated_texts`, `errors` (seconds; see `benchmark()` in sglang/bench_serving.py). SGLang
records no send times, so arrivals come from elsewhere (see read_sglang_result).
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd

from testbed.interop.table import (
    InteropError,
    check_requests,
    client_table,
    evenly_spaced,
    given_arrivals,
    per_request,
    pick_run,
)
from testbed.interop.vllm import scalars

DETAIL_FLAG = "sglang.bench_serving --output-details"


def read_sglang_result(path, *, run: int = -1, arrivals: Optional[Sequence[float]] = None) -> pd.DataFrame:
    """The `run`-th line of the file (default: the last) as a requests table.

    Arrivals, which SGLang does not save: `arrivals` when given (for a Mooncake replay, the
    trace's timestamps: see mooncake.trace_arrivals); else from `request_rate`, all at 0 for inf
    and one every 1/rate otherwise (the mean of the exponential gaps it drew, not the gaps
    themselves). A Mooncake or trace-timed run without `arrivals` is refused: its rate setting
    is not what it sent."""
    data = pick_run(path, run)
    ttfts = per_request(data, "ttfts", path, flag=DETAIL_FLAG)
    n = len(ttfts)
    lists = {k: per_request(data, k, path, n, DETAIL_FLAG) for k in ("itls", "input_lens", "output_lens", "errors")}
    check_requests(path, ttfts, lists)
    if arrivals is not None:
        arrival = given_arrivals(arrivals, n, path)
        how = "given (a trace's timestamps)"
    elif data.get("dataset_name") == "mooncake" or data.get("request_rate") == "trace":
        raise InteropError(
            f"{path}: a trace replay (dataset_name={data.get('dataset_name')!r}) records no "
            f"arrivals; pass the trace it replayed (--trace FILE)"
        )
    else:
        arrival = evenly_spaced(data.get("request_rate"), n)
        how = f"reconstructed: evenly spaced at request_rate={data.get('request_rate')}"
    table = client_table(arrivals=arrival, sent=arrival, ttfts=ttfts, **lists)
    table.attrs["interop"] = {"format": "sglang", "arrivals": how, **scalars(data)}
    return table


def is_sglang(data: dict) -> bool:
    return "total_throughput" in data or "mean_e2e_latency_ms" in data or "dataset_name" in data
