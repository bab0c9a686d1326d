"""build_workload: config + seed -> the list of requests of one run (and their later turns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from testbed.workload import arrivals
from testbed.workload.closed_loop import Users
from testbed.workload.config import WorkloadConfig, WorkloadError
from testbed.workload.lengths import sample_lengths, scale_lengths
from testbed.workload.request import (
    TAG_ARRIVALS,
    TAG_BLOCKS,
    TAG_LENGTHS,
    TAG_PROMPTS,
    TAG_TENANTS,
    Request,
    TokenTable,
    derived_rng,
    random_tokens,
)
from testbed.workload.sessions import TurnPlanner, system_prompt
from testbed.workload.traces import read_trace, resolve_trace_path, select
from testbed.workload.workload import Workload


@dataclass(frozen=True)
class Shape:
    """Per-request arrays before prompts exist: lengths decide clipping before any token is drawn."""

    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    tenant: list
    hash_ids: Optional[list] = None
    prompts: Optional[list] = None


def empty_workload() -> Workload:
    """No requests of its own: a server's requests come from its clients."""
    return Workload([], [], {"sessions_ended_overlength": 0}, planner=None)


def build_workload(cfg: WorkloadConfig, *, seed: int, vocab_size: int, max_model_len: int) -> Workload:
    """Same (cfg, seed) -> the same requests. Raises WorkloadError on bad input."""
    cfg.validate()
    if vocab_size < 1 or max_model_len < 2:
        raise WorkloadError(f"vocab_size must be >= 1 and max_model_len >= 2 (got {vocab_size}, {max_model_len})")
    shape, report = _trace_shape(cfg, seed) if cfg.path else _synthetic_shape(cfg, seed)
    order = np.argsort(shape.arrival_s, kind="stable")
    input_len, output_len, keep, reasons = _fit(shape, order, cfg.overlength, max_model_len, report)
    tokens = TokenTable(vocab_size)
    prompts = _Prompts(cfg, seed, vocab_size, tokens).build_all(shape, order, input_len)
    # plain Python numbers, converted once: indexing numpy per request costs more than the request
    arrival_s = np.asarray(shape.arrival_s, dtype=np.float64).tolist()
    output_lens = np.asarray(output_len, dtype=np.int64).tolist()
    requests, rejected = [], []
    for request_id, (row, (prompt, blocks)) in enumerate(zip(order.tolist(), prompts)):
        request = Request(
            request_id=request_id,
            arrival_s=arrival_s[row],
            prompt_token_ids=prompt,
            output_len=output_lens[row],
            session_id=request_id if cfg.turns > 1 else None,
            tenant=shape.tenant[row],
            prefix_block_ids=blocks,
        )
        if keep[row]:
            requests.append(request)
        else:
            rejected.append((request, reasons[row]))
    report.update(_summary(requests, rejected))
    planner = TurnPlanner(cfg, seed, vocab_size, max_model_len, len(order), tokens)
    users = Users(requests, cfg, seed) if cfg.concurrency else None
    return Workload(requests, rejected, report, planner, users)


def _synthetic_shape(cfg: WorkloadConfig, seed: int) -> tuple[Shape, dict]:
    shape, report = _foreground_shape(cfg, seed)
    if not cfg.background_requests:
        return shape, report
    n = cfg.background_requests
    return Shape(
        arrival_s=np.concatenate([np.zeros(n), shape.arrival_s]),
        input_len=np.concatenate([np.full(n, cfg.background_input_len), shape.input_len]),
        output_len=np.concatenate([np.full(n, cfg.background_output_len), shape.output_len]),
        tenant=["background"] * n + list(shape.tenant),
    ), report


def _foreground_shape(cfg: WorkloadConfig, seed: int) -> tuple[Shape, dict]:
    if cfg.num_requests == 0 and cfg.duration_s is None:  # a background-only run
        empty = np.zeros(0, dtype=np.int64)
        return Shape(np.zeros(0), empty, empty.copy(), []), {"source": "synthetic"}
    times = arrivals.synthetic_until(lambda: derived_rng(seed, TAG_ARRIVALS), cfg, cfg.num_requests, cfg.duration_s)
    n = len(times)
    rng = derived_rng(seed, TAG_LENGTHS)
    report = {"source": "synthetic", "clipped_input_dist": 0, "clipped_output_dist": 0}
    if cfg.tenants:
        weights = np.array([t.weight for t in cfg.tenants], dtype=np.float64)
        which = derived_rng(seed, TAG_TENANTS).choice(len(cfg.tenants), size=n, p=weights / weights.sum())
        groups = [(np.flatnonzero(which == i), t.input_len, t.output_len) for i, t in enumerate(cfg.tenants)]
        tenant = [cfg.tenants[i].name for i in which]
    else:
        groups = [(np.arange(n), cfg.input_len, cfg.output_len)]
        tenant = ["default"] * n
    input_len = np.zeros(n, dtype=np.int64)
    output_len = np.zeros(n, dtype=np.int64)
    for index, input_cfg, output_cfg in groups:
        input_len[index], clipped_in = sample_lengths(input_cfg, len(index), rng)
        output_len[index], clipped_out = sample_lengths(output_cfg, len(index), rng)
        report["clipped_input_dist"] += clipped_in
        report["clipped_output_dist"] += clipped_out
    input_len += cfg.system_prompt_len
    return Shape(times, input_len, output_len, tenant), report


def _trace_shape(cfg: WorkloadConfig, seed: int) -> tuple[Shape, dict]:
    path = resolve_trace_path(cfg.path)
    records = select(read_trace(path, cfg.format), cfg.start_s, cfg.window_s, cfg.num_requests)
    if cfg.arrival == "trace":
        times = arrivals.replay(records.timestamps_s, cfg.speedup)
    else:  # the trace's lengths at a synthetic arrival process
        times = arrivals.synthetic(derived_rng(seed, TAG_ARRIVALS), len(records), cfg)
    keep = np.ones(len(times), dtype=bool) if cfg.duration_s is None else times <= cfg.duration_s
    records = records.take(np.flatnonzero(keep))
    shape = Shape(
        arrival_s=times[keep],
        input_len=scale_lengths(records.input_len, cfg.length_scale),
        output_len=scale_lengths(records.output_len, cfg.length_scale),
        tenant=records.tenants or ["default"] * len(records),
        hash_ids=records.hash_ids,
        prompts=records.prompts,
    )
    if records.prompts is not None:  # explicit prompts are replayed as they are, unscaled
        explicit = [i for i, p in enumerate(records.prompts) if p is not None]
        shape.input_len[explicit] = [len(records.prompts[i]) for i in explicit]
    if len(shape.arrival_s) == 0:
        raise WorkloadError(
            f"workload.path: no requests of {path} fall in the window (start_s={cfg.start_s}, "
            f"window_s={cfg.window_s}, duration_s={cfg.duration_s})"
        )
    return shape, {"source": str(path)}


def _fit(shape: Shape, order: np.ndarray, policy: str, max_model_len: int, report: dict):
    """Apply overlength: input + output must fit in max_model_len. `clip` shortens the output to
    at most max_model_len - 1, then the prompt (its tail, so shared prefixes survive); `reject`
    refuses the request with a reason."""
    input_len, output_len = shape.input_len.copy(), shape.output_len.copy()
    over = input_len + output_len > max_model_len
    keep = np.ones(len(input_len), dtype=bool)
    reasons: dict[int, str] = {}
    if policy == "reject":
        keep = ~over
        for row in np.flatnonzero(over):
            reasons[int(row)] = (
                f"overlength: input {input_len[row]} + output {output_len[row]} > max_model_len {max_model_len}"
            )
        report.update(clipped_input=0, clipped_output=0)
    else:
        new_output = np.minimum(output_len, max_model_len - 1)
        new_input = np.minimum(input_len, max_model_len - new_output)
        report.update(
            clipped_input=int(np.count_nonzero(new_input < input_len)),
            clipped_output=int(np.count_nonzero(new_output < output_len)),
        )
        input_len, output_len = new_input, new_output
    report["rejected"] = int(np.count_nonzero(~keep))
    report["sessions_ended_overlength"] = 0
    return input_len, output_len, keep, reasons


class _Prompts:
    """Token ids for each request: shared system prompt + random user tokens (synthetic), shared
    blocks per Mooncake hash id, or the trace's explicit prompt."""

    def __init__(self, cfg: WorkloadConfig, seed: int, vocab_size: int, tokens: TokenTable):
        self.seed, self.vocab_size, self.tokens = seed, vocab_size, tokens
        self.rng = derived_rng(seed, TAG_PROMPTS)
        self.system = system_prompt(seed, cfg.system_prompt_len, vocab_size) if not cfg.path else np.zeros(0, np.int64)
        # Block size scales with the lengths so that prefix sharing survives length_scale.
        self.block_tokens = max(1, int(round(cfg.prefix_block_tokens * cfg.length_scale)))
        self.blocks: dict[int, np.ndarray] = {}

    def build_all(self, shape: Shape, order: np.ndarray, input_len: np.ndarray) -> list[tuple[tuple, tuple]]:
        """(prompt, prefix block ids) of every row, in `order` (the order the generator draws in)."""
        if shape.prompts is None and shape.hash_ids is None:
            return self._synthetic(np.asarray(input_len, dtype=np.int64)[order])
        return [self.build(shape, int(row), int(input_len[row])) for row in order]

    def _synthetic(self, lengths: np.ndarray) -> list[tuple[tuple, tuple]]:
        """System prompt + random user tokens for each length, as `build` makes them. The user
        tokens of every request come from one draw: Generator.integers gives the same stream
        whether drawn at once or request by request (tests/metrics/test_scale.py checks it), and one
        call instead of one per request saves seconds on 100k requests."""
        heads = np.minimum(lengths, len(self.system))
        ends = np.cumsum(lengths - heads)
        users = random_tokens(self.rng, int(ends[-1]) if len(ends) else 0, self.vocab_size)
        out = []
        for head, start, end in zip(heads.tolist(), (ends - (lengths - heads)).tolist(), ends.tolist()):
            ids = np.concatenate([self.system[:head], users[start:end]]) if head else users[start:end]
            out.append((self.tokens.as_tuple(ids), ()))
        return out

    def build(self, shape: Shape, row: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if shape.prompts is not None and shape.prompts[row] is not None:
            ids = np.asarray(shape.prompts[row][:length], dtype=np.int64)
            if len(ids) and ids.max() >= self.vocab_size:
                raise WorkloadError(
                    f"trace row {row}: prompt_token_ids has id {ids.max()} >= vocab_size {self.vocab_size}"
                )
            return self.tokens.as_tuple(ids), ()
        hash_ids = shape.hash_ids[row] if shape.hash_ids is not None else ()
        used = hash_ids[: -(-length // self.block_tokens)]
        parts = [self.system] + [self._block(h) for h in used]
        head = np.concatenate(parts)[:length]
        tail = random_tokens(self.rng, length - len(head), self.vocab_size)
        return self.tokens.as_tuple(np.concatenate([head, tail])), tuple(int(h) for h in used)

    def _block(self, block_id: int) -> np.ndarray:
        """The tokens of one hash block: a function of (seed, block id) only."""
        if block_id not in self.blocks:
            rng = derived_rng(self.seed, TAG_BLOCKS, block_id)
            self.blocks[block_id] = random_tokens(rng, self.block_tokens, self.vocab_size).astype(np.int32)
        return self.blocks[block_id]


def _summary(requests: list[Request], rejected: list) -> dict:
    inputs = [r.input_len for r in requests]
    outputs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "mean_input_len": float(np.mean(inputs)) if inputs else float("nan"),
        "mean_output_len": float(np.mean(outputs)) if outputs else float("nan"),
        "last_arrival_s": float(requests[-1].arrival_s) if requests else 0.0,
    }
