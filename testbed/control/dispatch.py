"""Dispatch policies: which worker gets a request (or, in disagg mode, a request's KV).

- round_robin: the next live worker in turn.
- least_loaded: the fewest queued prompt tokens (mixed and prefill workers), or the fewest
  sequences bound to it and then the most free KV blocks (decode workers).
- session_affinity: a session's later turns go where its earlier turns ran (its KV, and its
  prefix-cache hits, are there); new sessions go to the least loaded worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from testbed.workload import Request


@dataclass
class WorkerLoad:
    queued_prompt_tokens: int = 0
    bound_sequences: int = 0
    free_blocks: int = 0
    alive: bool = True


@dataclass
class Dispatcher:
    policy: str
    workers: list[int]
    loads: dict[int, WorkerLoad]
    for_decode: bool = False
    _next: int = 0
    _affinity: dict[int, int] = field(default_factory=dict)

    def live(self) -> list[int]:
        return [w for w in self.workers if self.loads[w].alive]

    def pick(self, request: Request) -> Optional[int]:
        live = self.live()
        if not live:
            return None
        if self.policy == "round_robin":
            worker = live[self._next % len(live)]
            self._next += 1
            return worker
        if self.policy == "session_affinity" and request.session_id is not None:
            worker = self._affinity.get(request.session_id)
            if worker is None or not self.loads[worker].alive:
                worker = self._least_loaded(live)
                self._affinity[request.session_id] = worker
            return worker
        return self._least_loaded(live)

    def bind(self, request: Request) -> Optional[int]:
        """The decode worker for a request's KV, counted as bound to it; None when the request
        ends with its first token on the prefill worker, or no decode worker is alive."""
        if request.output_len <= 1:
            return None
        worker = self.pick(request)
        if worker is not None:
            self.loads[worker].bound_sequences += 1
        return worker

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
