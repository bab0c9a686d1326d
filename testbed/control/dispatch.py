"""Dispatch policies: which worker gets a request (or, in disagg mode, a request's KV).

- round_robin: the next live worker in turn.
- least_loaded: the fewest queued prompt tokens (mixed and prefill workers), or the fewest
  sequences bound to it and then the most free KV blocks (decode workers).
- session_affinity: a session's later turns go where its earlier turns ran (its KV, and its
  prefix-cache hits, are there); new sessions go to the least loaded worker.
- kv_aware: the best `cached tokens - kv_aware_load_weight x load`, where cached tokens are the
  prompt's leading tokens the worker's prefix cache holds (testbed/control/kv_index.py, kept
  from the workers' step reports) and load is the worker's queued prompt tokens (mixed and
  prefill workers) or the prompt tokens of the sequences bound to it (decode workers); ties go
  to the least loaded. The idea of a KV router (Dynamo) and of a cache-aware router (SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from testbed.control.kv_index import KVIndex
from testbed.engine.prefix import prompt_hashes
from testbed.workload import Request


@dataclass
class WorkerLoad:
    queued_prompt_tokens: int = 0
    bound_sequences: int = 0
    bound_tokens: int = 0  # prompt tokens of the bound sequences (a decode worker's KV load)
    free_blocks: int = 0
    alive: bool = True


@dataclass
class Dispatcher:
    policy: str
    workers: list[int]
    loads: dict[int, WorkerLoad]
    for_decode: bool = False
    index: Optional[KVIndex] = None  # kv_aware: where the prompt blocks are
    load_weight: float = 1.0  # kv_aware: cached tokens worth one token of load
    _next: int = 0
    _affinity: dict[int, int] = field(default_factory=dict)

    def live(self) -> list[int]:
        return [w for w in self.workers if self.loads[w].alive]

    def pick(self, request: Request, allowed: Optional[set[int]] = None) -> Optional[int]:
        """The worker for the request among the live ones (and those in `allowed`, when given)."""
        live = self.live() if allowed is None else [w for w in self.live() if w in allowed]
        if not live:
            return None
        if self.policy == "round_robin":
            worker = live[self._next % len(live)]
            self._next += 1
            return worker
        if self.policy == "session_affinity" and request.session_id is not None:
            worker = self._affinity.get(request.session_id)
            if worker not in live:  # new, dead, or outside the allowed pool
                worker = self._least_loaded(live)
                self._affinity[request.session_id] = worker
            return worker
        if self.policy == "kv_aware":
            return self._kv_aware(live, request)
        return self._least_loaded(live)

    def bind(self, request: Request) -> Optional[int]:
        """The decode worker for a request's KV, counted as bound to it; None when the request
        ends with its first token on the prefill worker, or no decode worker is alive."""
        if request.output_len <= 1:
            return None
        worker = self.pick(request)
        if worker is not None:
            self.loads[worker].bound_sequences += 1
            self.loads[worker].bound_tokens += request.input_len
        return worker

    def _kv_aware(self, live: list[int], request: Request) -> int:
        hashes = prompt_hashes(request.prompt_token_ids, self.index.block_size)
        scored = []
        for w in live:
            load = self.loads[w]
            tokens = load.bound_tokens if self.for_decode else load.queued_prompt_tokens
            score = self.index.cached_tokens(w, hashes) - self.load_weight * tokens
            scored.append((-score, tokens, load.bound_sequences, w))
        return min(scored)[3]

    def _least_loaded(self, live: list[int]) -> int:
        loads = self.loads  # once per request over every worker: tuples, no key function
        if self.for_decode:
            return min((loads[w].bound_sequences, -loads[w].free_blocks, w) for w in live)[2]
        return min((loads[w].queued_prompt_tokens, loads[w].bound_sequences, w) for w in live)[2]


def admission_refusal(cluster, request: Request, outstanding: int) -> Optional[str]:
    """Admission control (cluster.max_prompt_len, cluster.max_outstanding): why a request is
    refused, or None to admit it."""
    cap, limit = cluster.max_prompt_len, cluster.max_outstanding
    if cap is not None and request.input_len > cap:
        return f"prompt of {request.input_len} tokens exceeds cluster.max_prompt_len={cap}"
    if limit is not None and outstanding >= limit:
        return f"{outstanding} requests outstanding (cluster.max_outstanding={limit})"
    return None
