"""The running batch at each token: for every token a worker produced, the number of sequences in
the engine step that produced it (prefill chunks and decodes alike), and TPOT / ITL split by it.

Pure functions of the requests and steps tables. A token is joined to its step by the token's
worker stamp (`token_worker_times`): a worker stamps a step's tokens after the step ended and
before its next step starts (the simulator stamps them at the step's end, which may also be the
next step's start), so the step that produced a token is its worker's last step that ended by
the stamp, and the stamp must not be past the following step's start. The producing worker is
the request's prefill worker for its first token and its decode worker (its prefill worker when
it has none) for the others. That is exact for every request whose tokens came from the workers
it names, which is every request of a run without faults (the simulator and a real 1P1D run
join every token: tests/metrics/test_observations.py). A request that a failure moved between workers
(re-dispatched, or recomputed on D after P sent its first token) may have tokens from a worker
it no longer names: one whose stamp falls inside a step of the named worker has no batch (NaN,
counted as `tokens_unjoined`); one whose stamp falls in that worker's idle gap is joined to the
step before the gap, which is wrong. Recording the producing worker per token would remove
that case at the price of a per-token column in requests.parquet.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from testbed.metrics.latency import Tokens, bucket_index, bucketed, distribution, later_tokens, tokens_of

# Buckets of the running batch (sequences in the producing step): [low, high).
CONCURRENCY_BUCKETS = {"1": (1, 2), "2-4": (2, 5), "5-16": (5, 17), "17-64": (17, 65), "65+": (65, np.inf)}
_STEP_NEEDS = {"worker", "start_s", "end_s", "decode_seqs", "prefill_tokens", "prefill_chunks"}


def step_batch_sizes(steps: pd.DataFrame) -> np.ndarray:
    """Sequences in each step: its decodes plus its prefill chunks."""
    batch = steps["decode_seqs"].to_numpy(np.float64, copy=True)
    prefilled = np.flatnonzero(steps["prefill_tokens"].to_numpy(np.float64) > 0)
    chunks = steps["prefill_chunks"].to_numpy(object)[prefilled]
    batch[prefilled] += np.fromiter(map(len, chunks), dtype=np.float64, count=len(chunks))
    return batch


def token_producers(table: pd.DataFrame, sizes: np.ndarray) -> np.ndarray:
    """Per token (token_arrays order): the worker that produced it, -1 when the request names none."""
    prefill = table["prefill_worker"].astype("Int64").fillna(-1).to_numpy(np.int64)
    decode = table["decode_worker"].astype("Int64").fillna(-1).to_numpy(np.int64)
    decode = np.where(decode >= 0, decode, prefill)
    producer = np.repeat(decode, sizes)
    has = sizes > 0
    producer[(np.cumsum(sizes) - sizes)[has]] = prefill[has]
    return producer


def match_steps(stamps: np.ndarray, producers: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Per token: the batch size of the step that produced it (see the module's note); NaN where
    no step of its worker fits its stamp."""
    out = np.full(stamps.size, np.nan)
    workers = steps["worker"].to_numpy(np.int64)
    rows_by_worker, tokens_by_worker = by_key(workers), by_key(producers)
    ends, starts = steps["end_s"].to_numpy(np.float64), steps["start_s"].to_numpy(np.float64)
    batch = step_batch_sizes(steps)
    for worker, rows in rows_by_worker.items():
        mine = tokens_by_worker.get(worker)
        if mine is None:
            continue
        rows = rows[np.argsort(ends[rows], kind="stable")]  # a worker's steps in the order they ended
        out[mine] = _match_one(stamps[mine], ends[rows], starts[rows], batch[rows])
    return out


def by_key(keys: np.ndarray) -> dict[int, np.ndarray]:
    """{key: the places holding it, in order}, from one stable sort of the (small integer) keys."""
    small = keys.size and -(2**15) <= keys.min() and keys.max() < 2**15
    order = np.argsort(keys.astype(np.int16) if small else keys, kind="stable")  # int16: a radix sort
    values, starts = np.unique(keys[order], return_index=True)
    return dict(zip(values.tolist(), np.split(order, starts[1:])))


def _match_one(stamps: np.ndarray, ends: np.ndarray, starts: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """One worker: its tokens' stamps against its steps (sorted by end)."""
    step = np.searchsorted(ends, stamps, side="right") - 1
    next_start = np.append(starts[1:], np.inf)
    fits = step >= 0
    fits[fits] &= stamps[fits] <= next_start[step[fits]]
    return np.where(fits, batch[np.maximum(step, 0)], np.nan)


def token_batches(table: pd.DataFrame, steps: Optional[pd.DataFrame], tokens: Optional[Tokens] = None) -> np.ndarray:
    """Per client token (token_arrays of token_times): the running batch when it was produced;
    NaN without steps or where the worker stamps do not pair with the client times."""
    client, client_sizes, worker, worker_sizes = tokens_of(table) if tokens is None else tokens
    out = np.full(client.size, np.nan)
    if steps is None or steps.empty or not _STEP_NEEDS <= set(steps.columns) or not client.size:
        return out
    batches = match_steps(worker, token_producers(table, worker_sizes), steps)
    paired = client_sizes == worker_sizes
    out[np.repeat(paired, client_sizes)] = batches[np.repeat(paired, worker_sizes)]
    return out


def by_concurrency(
    table: pd.DataFrame, steps: Optional[pd.DataFrame], tokens: Optional[Tokens] = None
) -> dict[str, dict]:
    """TPOT and ITL per CONCURRENCY_BUCKETS of the running batch: an ITL gap falls in the bucket
    of the step that produced its later token; a request's TPOT in that of the mean batch over
    its tokens after the first. Also the distribution of the batch over every token and how
    many tokens were (not) joined to a step."""
    tokens = tokens_of(table) if tokens is None else tokens
    flat, sizes = tokens.client, tokens.client_sizes
    batch = token_batches(table, steps, tokens)
    later = later_tokens(sizes)
    gap_index = bucket_index(batch[later], CONCURRENCY_BUCKETS)
    return {
        "tpot_by_concurrency": bucketed(
            table["tpot"],
            bucket_index(_mean_after_first(batch, sizes, later), CONCURRENCY_BUCKETS),
            CONCURRENCY_BUCKETS,
        ),
        "itl_by_concurrency": bucketed(flat[later] - flat[later - 1], gap_index, CONCURRENCY_BUCKETS),
        "concurrency": {
            "tokens_joined": int(np.count_nonzero(~np.isnan(batch))),
            "tokens_unjoined": int(np.count_nonzero(np.isnan(batch))),
            **distribution(batch),
        },
    }


def _mean_after_first(batch: np.ndarray, sizes: np.ndarray, later: np.ndarray) -> np.ndarray:
    """Per request: the mean batch over its tokens after the first (NaN: none joined)."""
    owner = np.repeat(np.arange(sizes.size), sizes)[later]
    values = batch[later]
    known = ~np.isnan(values)
    total = np.bincount(owner[known], weights=values[known], minlength=sizes.size)
    count = np.bincount(owner[known], minlength=sizes.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)
