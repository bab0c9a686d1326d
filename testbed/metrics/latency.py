"""Per-request latencies and pooled latency distributions (pure functions on the requests table).

Definitions as in vLLM's benchmark and DistServe: for a request arriving at a with tokens
reaching the client at t_1 < ... < t_n: TTFT = t_1 - a, TPOT = (t_n - t_1) / (n - 1) for n > 1,
E2E = t_n - a, ITL = every gap t_{i+1} - t_i (pooled across requests).
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple, Optional

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 95, 99)
# TTFT buckets by input length in tokens: [low, high).
BUCKETS = {"0-1K": (0, 1024), "1K-4K": (1024, 4096), "4K-16K": (4096, 16384), "16K+": (16384, np.inf)}
# TPOT / ITL buckets by output length in tokens: [low, high).
OUTPUT_BUCKETS = {"0-128": (0, 128), "128-512": (128, 512), "512-2K": (512, 2048), "2K+": (2048, np.inf)}


def distribution(values) -> dict[str, float]:
    """mean, p50, p90, p95, p99, max by linear interpolation (numpy's default); NaN when empty.
    NaN values are ignored."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    if x.size == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}, "max": float("nan")}
    out = {"mean": float(x.mean())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(x, PERCENTILES))})
    out["max"] = float(x.max())
    return out


def as_times(cell) -> np.ndarray:
    """A token_times cell (list, numpy array from parquet, or None/NaN) as a float array."""
    if cell is None or (np.ndim(cell) == 0 and pd.isna(cell)):
        return np.zeros(0)
    return np.asarray(cell, dtype=np.float64).ravel()


def token_arrays(cells) -> tuple[np.ndarray, np.ndarray]:
    """(every time of every cell, concatenated in order; each cell's length), for cells as
    as_times reads them. One pass over the cells: an array per request costs seconds at 100k."""
    cells = [_sequence(c) for c in cells]
    sizes = np.fromiter(map(len, cells), dtype=np.int64, count=len(cells))
    flat = np.fromiter(chain.from_iterable(cells), dtype=np.float64, count=int(sizes.sum()))
    return flat, sizes


def _sequence(cell):
    if isinstance(cell, (list, tuple)):
        return cell
    return as_times(cell)  # an array (from parquet), None/NaN or a lone number


class Tokens(NamedTuple):
    """A table's token times flattened once (token_arrays of token_times and token_worker_times):
    the figures that read them share one pass over the cells."""

    client: np.ndarray
    client_sizes: np.ndarray
    worker: np.ndarray
    worker_sizes: np.ndarray


def tokens_of(table: pd.DataFrame) -> Tokens:
    return Tokens(*token_arrays(table["token_times"]), *token_arrays(table["token_worker_times"]))


def later_tokens(sizes: np.ndarray) -> np.ndarray:
    """Places in the concatenation of token_arrays of every token but a cell's first: the later
    token of each gap inside one request (a gap is flat[i] - flat[i - 1])."""
    starts = np.cumsum(sizes) - sizes
    later = np.ones(int(sizes.sum()), dtype=bool)
    later[starts[sizes > 0]] = False
    return np.flatnonzero(later)


def first_last(flat: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of token_arrays: its first and last time (NaN when empty)."""
    ends = np.cumsum(sizes)
    has = sizes > 0
    first, last = np.full(sizes.size, np.nan), np.full(sizes.size, np.nan)
    first[has], last[has] = flat[ends[has] - sizes[has]], flat[ends[has] - 1]
    return first, last


def add_derived(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with ttft, tpot, e2e, normalized_latency, prefill_queue_s, decode_queue_s,
    kv_transfer_s, num_tokens and warmup (False unless already set)."""
    df = df.copy()
    flat, n = token_arrays(df["token_times"])
    first, last = first_last(flat, n)
    arrival = df["arrival_s"].to_numpy(dtype=np.float64)
    df["num_tokens"] = n
    df["ttft"] = first - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        df["tpot"] = np.where(n > 1, (last - first) / np.maximum(n - 1, 1), np.nan)
        df["e2e"] = last - arrival
        df["normalized_latency"] = np.where(n > 0, (last - arrival) / np.maximum(n, 1), np.nan)
    df["prefill_queue_s"] = df["prefill_start_s"] - df["arrival_s"]
    # Decode queue: from when the decode side could start (KV ready) to its first decode step.
    ready = df["decode_queued_s"].fillna(df["kv_transfer_end_s"])
    df["decode_queue_s"] = df["decode_start_s"] - ready
    df["kv_transfer_s"] = df["kv_transfer_end_s"] - df["kv_transfer_start_s"]
    if "warmup" not in df.columns:
        df["warmup"] = False
    df["warmup"] = df["warmup"].fillna(False).astype(bool)
    return df


def pooled_itl(table: pd.DataFrame, tokens: Optional[Tokens] = None) -> np.ndarray:
    """Every inter-token gap of every request, pooled (a batch of tokens in one message has gaps of 0).
    `tokens`: the table's tokens_of, when already at hand."""
    flat, sizes = token_arrays(table["token_times"]) if tokens is None else tokens[:2]
    if flat.size < 2:
        return np.zeros(0)
    within = np.ones(flat.size - 1, dtype=bool)  # the gaps of the concatenation inside one request
    last = np.cumsum(sizes)[sizes > 0] - 1
    within[last[last < flat.size - 1]] = False
    return np.diff(flat)[within]


def itl_steps(table: pd.DataFrame) -> int:
    """How many distinct steps the pooled gaps end in: the gaps of one decode step share its
    timestamp and are one draw of the step's time, not a batch's worth of draws."""
    flat, sizes = token_arrays(table["token_times"])
    if flat.size < 2:
        return 0
    within = np.ones(flat.size - 1, dtype=bool)
    last = np.cumsum(sizes)[sizes > 0] - 1
    within[last[last < flat.size - 1]] = False
    return int(np.unique(flat[1:][within]).size)


def harness_delays(table: pd.DataFrame, tokens: Optional[Tokens] = None) -> np.ndarray:
    """Per token: arrival at the router minus the worker's stamp (queueing in the harness itself)."""
    client, client_sizes, worker, worker_sizes = tokens_of(table) if tokens is None else tokens
    paired = (client_sizes > 0) & (client_sizes == worker_sizes)  # a request without both stamps is left out
    return client[np.repeat(paired, client_sizes)] - worker[np.repeat(paired, worker_sizes)]


def ttft_by_bucket(table: pd.DataFrame) -> dict[str, dict]:
    """TTFT distribution and request count per input-length bucket."""
    out = {}
    for name, (low, high) in BUCKETS.items():
        rows = table[(table["input_len"] >= low) & (table["input_len"] < high)]
        out[name] = {"count": int(len(rows)), **distribution(rows["ttft"])}
    return out


def ttft_by_tenant(table: pd.DataFrame) -> dict[str, dict]:
    """TTFT distribution and request count per tenant (by name)."""
    return {
        str(name): {"count": int(len(rows)), **distribution(rows["ttft"])}
        for name, rows in table.groupby("tenant", sort=True)
    }


def output_buckets(output_len) -> np.ndarray:
    """Each request's OUTPUT_BUCKETS index by its output length (-1: none)."""
    return bucket_index(output_len, OUTPUT_BUCKETS)


def bucket_index(values, buckets: dict) -> np.ndarray:
    """Each value's index among `buckets` ({name: [low, high)}); -1 for NaN or outside them all."""
    x = np.asarray(values, dtype=np.float64)
    index = np.full(x.shape, -1, dtype=np.int64)
    for i, (low, high) in enumerate(buckets.values()):
        index[(x >= low) & (x < high)] = i
    return index


def bucketed(values, index: np.ndarray, buckets: dict) -> dict[str, dict]:
    """Per bucket: the count and distribution of the values whose index (bucket_index) is its."""
    x = np.asarray(values, dtype=np.float64)
    return {
        name: {"count": int(np.count_nonzero(index == i)), **distribution(x[index == i])}
        for i, name in enumerate(buckets)
    }


def by_output_bucket(table: pd.DataFrame, tokens: Optional[Tokens] = None) -> dict[str, dict]:
    """TPOT (one per request) and ITL (every gap, pooled) per output-length bucket (OUTPUT_BUCKETS,
    by the requests' output_len); `count` is requests for TPOT and gaps for ITL."""
    flat, sizes = token_arrays(table["token_times"]) if tokens is None else tokens[:2]
    index = output_buckets(table["output_len"])
    later = later_tokens(sizes)
    gaps = flat[later] - flat[later - 1]
    gap_index = np.repeat(index, sizes)[later]
    return {
        "tpot_by_output_bucket": bucketed(table["tpot"], index, OUTPUT_BUCKETS),
        "itl_by_output_bucket": bucketed(gaps, gap_index, OUTPUT_BUCKETS),
    }


def interference_ratio(itl_with_prefill, itl_baseline) -> float:
    """p99 ITL of decodes sharing the GPU with prefill work / p99 ITL of a decode-only baseline.
    NaN when either side is empty or the baseline p99 is 0."""
    mixed, base = distribution(itl_with_prefill)["p99"], distribution(itl_baseline)["p99"]
    if np.isnan(mixed) or np.isnan(base) or base == 0:
        return float("nan")
    return float(mixed / base)


def decode_stalls(itls, factor: float) -> int:
    """Number of inter-token gaps longer than factor x the median gap (0 when there are none)."""
    x = np.asarray(itls, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    if x.size == 0:
        return 0
    return int(np.count_nonzero(x > factor * np.median(x)))
