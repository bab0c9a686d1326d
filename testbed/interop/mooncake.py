"""The Mooncake trace format: what a point ran, for SGLang's `bench_serving --dataset-name mooncake`
(and for the testbed's own trace reader) to replay.

One JSON line per request: {"timestamp": ms, "input_length", "output_length", "hash_ids"}. A
hash id stands for one block of `block_size` prompt tokens; two requests share an id exactly
when their prompts agree up to and including that block, so the prefix sharing of multi-turn
sessions and shared system prompts survives the export although the tokens do not.

SGLang's loader (sglang/benchmark/datasets/mooncake.py, `get_mooncake_request_over_time`) reads
`timestamp`, `hash_ids` and `output_length` only: it sorts by timestamp, replays from the first
one (times --mooncake-slowdown-factor) and builds each prompt from the hash ids (a short text
per id), so prefix sharing is kept but prompt lengths are its own, not `input_length`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from testbed.interop.table import InteropError, sorted_rows, write_lines
from testbed.workload.traces import read_mooncake_jsonl

BLOCK_SIZE = 512  # the Mooncake traces' block, and the testbed's workload.prefix_block_tokens


def block_hash_ids(
    prompts: Sequence[Optional[Sequence[int]]], lengths: Sequence[int], block_size: int = BLOCK_SIZE
) -> list[list[int]]:
    """Per prompt, one id per block (the last may be partial), numbered 0, 1, 2, ... in order of
    first appearance. An id is keyed by its parent's id and the block's tokens (a chain), so it
    is equal exactly when the whole prefix through that block is. A prompt that is None has no
    tokens to compare: it gets fresh ids for its `lengths` entry, shared with nothing."""
    if block_size < 1:
        raise InteropError(f"block_size must be >= 1 (got {block_size})")
    ids: dict = {}
    out = []
    for prompt, length in zip(prompts, lengths):
        if prompt is None:
            out.append([_fresh(ids) for _ in range(-(-int(length) // block_size))])
            continue
        tokens = prompt if isinstance(prompt, tuple) else tuple(int(t) for t in prompt)  # runs hand over tuples
        parent, chain = -1, []
        for start in range(0, len(tokens), block_size):
            parent = ids.setdefault((parent, tokens[start : start + block_size]), len(ids))
            chain.append(parent)
        out.append(chain)
    return out


def _fresh(ids: dict) -> int:
    number = len(ids)
    ids[("unshared", number)] = number
    return number


def write_mooncake_jsonl(rows: pd.DataFrame, path, block_size: int = BLOCK_SIZE) -> Path:
    """The requests of `rows` (table.ROW_COLUMNS; a prompt_token_ids of None: lengths only) as a
    Mooncake trace, in arrival order, timestamps in whole milliseconds since the run's start."""
    rows = sorted_rows(rows)
    prompts = list(rows["prompt_token_ids"]) if "prompt_token_ids" in rows else [None] * len(rows)
    prompts = [p if isinstance(p, (list, tuple, np.ndarray)) else None for p in prompts]  # None/NaN: unknown
    hashes = block_hash_ids(prompts, rows["input_len"].tolist(), block_size)
    # formatted by hand: json.dumps per line is a third of a 100k-request run's export
    lines = [
        f'{{"timestamp": {int(round(float(t) * 1000.0))}, "input_length": {int(n)}, '
        f'"output_length": {int(m)}, "hash_ids": [{", ".join(map(str, h))}]}}'
        for t, n, m, h in zip(rows["arrival_s"], rows["input_len"], rows["output_len"], hashes)
    ]
    return write_lines(path, lines)


def trace_arrivals(path, count: Optional[int] = None, slowdown: float = 1.0) -> np.ndarray:
    """When SGLang sends the requests of a Mooncake trace: its first `count` lines (its
    --num-prompts), sorted by timestamp, from the first one, scaled by the slowdown factor."""
    records = read_mooncake_jsonl(Path(path))
    times = records.timestamps_s[:count] if count is not None else records.timestamps_s
    if count is not None and len(times) < count:
        raise InteropError(f"{path}: the trace has {len(times)} requests, the result {count}")
    times = np.sort(times)
    return (times - times[0]) * float(slowdown) if times.size else times
