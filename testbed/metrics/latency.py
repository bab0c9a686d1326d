"""Per-request latencies and pooled latency distributions (pure functions on the requests table).

Definitions as in vLLM's benchmark and DistServe: for a request arriving at a with tokens
reaching the client at t_1 < ... < t_n: TTFT = t_1 - a, TPOT = (t_n - t_1) / (n - 1) for n > 1,
E2E = t_n - a, ITL = every gap t_{i+1} - t_i (pooled across requests).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 95, 99)
# TTFT buckets by input length in tokens: [low, high).
BUCKETS = {"0-1K": (0, 1024), "1K-4K": (1024, 4096), "4K-16K": (4096, 16384), "16K+": (16384, np.inf)}


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


def add_derived(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with ttft, tpot, e2e, normalized_latency, prefill_queue_s, decode_queue_s,
    kv_transfer_s, num_tokens and warmup (False unless already set)."""
    df = df.copy()
    tokens = [as_times(c) for c in df["token_times"]]
    first = np.array([t[0] if t.size else np.nan for t in tokens], dtype=np.float64)
    last = np.array([t[-1] if t.size else np.nan for t in tokens], dtype=np.float64)
    n = np.array([t.size for t in tokens], dtype=np.int64)
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


def pooled_itl(table: pd.DataFrame) -> np.ndarray:
    """Every inter-token gap of every request, pooled (a batch of tokens in one message has gaps of 0)."""
    gaps = [np.diff(as_times(c)) for c in table["token_times"]]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def harness_delays(table: pd.DataFrame) -> np.ndarray:
    """Per token: arrival at the router minus the worker's stamp (queueing in the harness itself)."""
    delays = []
    for client, worker in zip(table["token_times"], table["token_worker_times"]):
        c, w = as_times(client), as_times(worker)
        if c.size and c.size == w.size:
            delays.append(c - w)
    return np.concatenate(delays) if delays else np.zeros(0)


def ttft_by_bucket(table: pd.DataFrame) -> dict[str, dict]:
    """TTFT distribution and request count per input-length bucket."""
    out = {}
    for name, (low, high) in BUCKETS.items():
        rows = table[(table["input_len"] >= low) & (table["input_len"] < high)]
        out[name] = {"count": int(len(rows)), **distribution(rows["ttft"])}
    return out


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
