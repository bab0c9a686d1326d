"""One engine in the driver's own process, replaying a workload at its arrival times.

The smallest serving setup: no worker processes, no KV transfer. It is the default job's
engine on one device and the reference every multi-worker mode must match token for token.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Optional

from testbed.engine import Engine, Sequence, StepRecord, StepResult
from testbed.metrics.events import Event, RequestLog
from testbed.workload import Request, Workload

IDLE_SLEEP_CAP_S = 0.05  # wake at least this often while waiting for the next arrival


def log_step(log: RequestLog, result: StepResult, request_of: Callable[[Sequence], int], worker: int,
             t: float) -> None:
    """Lifecycle events from one engine step (worker time = client time: no hop in between)."""
    for seq, n, was_prefill in result.scheduled:
        rid = request_of(seq)
        if was_prefill:
            log.event(rid, Event.PREFILL_START, t, worker=worker)
            log.event(rid, Event.PREFILL_CHUNK, t, worker=worker)
        else:
            log.event(rid, Event.DECODE_START, t, worker=worker)
    for seq, token in result.tokens:
        rid = request_of(seq)
        if seq.num_output_tokens == 1:
            log.event(rid, Event.PREFILL_END, t, worker=worker)
        log.tokens(rid, [token], t, t)


class InProcessServer:
    def __init__(self, engine: Engine, workload: Workload, log: RequestLog, worker: int = 0):
        self.engine, self.workload, self.log, self.worker = engine, workload, log, worker
        self.pending: list[tuple[float, int, Request]] = [(r.arrival_s, r.request_id, r) for r in workload.requests]
        heapq.heapify(self.pending)
        self.requests: dict[int, Request] = {}
        self.steps: list[StepRecord] = []

    def run(self, t0: float, on_finish: Optional[Callable[[], None]] = None) -> list[StepRecord]:
        """Until every request (and every later session turn) is done."""
        for request, reason in self.workload.rejected:
            self.log.reject(request, t0 + request.arrival_s, reason)
        while self.pending or self.engine.has_work():
            now = time.perf_counter() - t0
            self._admit_arrivals(t0, now)
            if not self.engine.has_work():
                time.sleep(min(max(self.pending[0][0] - now, 0.0), IDLE_SLEEP_CAP_S))
                continue
            result, record = self.engine.step()
            t = time.perf_counter()
            if record is not None:
                self.steps.append(record)
            log_step(self.log, result, lambda seq: seq.seq_id, self.worker, t)
            for seq in result.finished:
                self._finish(seq, t, t0)
                if on_finish:
                    on_finish()
        return self.steps

    def _admit_arrivals(self, t0: float, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, rid, request = heapq.heappop(self.pending)
            self.requests[rid] = request
            self.log.register(request)
            t = time.perf_counter()
            self.log.event(rid, Event.DISPATCHED, t, worker=self.worker)
            self.log.event(rid, Event.PREFILL_QUEUED, t, worker=self.worker)
            self.engine.add(Sequence(rid, list(request.prompt_token_ids), request.output_len))

    def _finish(self, seq: Sequence, t: float, t0: float) -> None:
        self.log.finish(seq.seq_id, t)
        follow_up = self.workload.next_turn(self.requests[seq.seq_id], seq.output_token_ids, t - t0)
        if follow_up is not None:
            heapq.heappush(self.pending, (follow_up.arrival_s, follow_up.request_id, follow_up))
