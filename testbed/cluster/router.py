"""The router (driver): replays the workload, dispatches, and turns worker reports into events.

Open loop: requests are released at their arrival times whatever the system's state; a
session's next turn is released a think time after its previous turn finished (closed loop).
Every token is stamped twice: on the worker (end of its step) and here on receipt; TTFT and ITL
use the receipt time, and the difference is the harness's own delay.
"""

from __future__ import annotations

import heapq
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from testbed.cluster.config import ClusterConfig, KVTransferConfig
from testbed.cluster.dispatch import Dispatcher, WorkerLoad
from testbed.cluster.launcher import Cluster
from testbed.cluster.messages import (Abort, Failed, Heartbeat, KVArrived, KVSent, Reserve, Reserved, Serve,
                                      StepEvents, WorkerError)
from testbed.metrics.events import Event, RequestLog
from testbed.workload import Request, Workload

LIVENESS_CHECK_S = 0.2


@dataclass
class Tracked:
    request: Request
    worker: int  # the mixed or prefill worker
    decode_worker: Optional[int] = None
    output: list = field(default_factory=list)
    left_front: bool = False  # prefill side done with it (mixed: finished; disagg: KV sent)


class Router:
    def __init__(self, cluster: Cluster, workload: Workload, log: RequestLog, mode: str,
                 cluster_config: ClusterConfig, kv: KVTransferConfig, t0: float):
        self.cluster, self.workload, self.log, self.t0 = cluster, workload, log, t0
        self.cfg, self.kv, self.disagg = cluster_config, kv, mode == "disagg"
        roles = {p.rank: p.role for p in cluster.plans}
        self.loads = {rank: WorkerLoad() for rank in roles}
        front = [r for r, role in roles.items() if role != "decode_only"]
        back = [r for r, role in roles.items() if role == "decode_only"]
        self.front = Dispatcher(cluster_config.dispatch, front, self.loads)
        self.back = Dispatcher(cluster_config.decode_dispatch, back, self.loads, for_decode=True)
        self.pending = [(r.arrival_s, r.request_id, r) for r in workload.requests]
        heapq.heapify(self.pending)
        self.active: dict[int, Tracked] = {}
        self.steps: list[tuple[int, object]] = []
        self.transfers: dict[int, dict] = {}
        self.last_seen = {rank: time.perf_counter() for rank in roles}
        self.on_finish: Callable[[], None] = lambda: None

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        for request, reason in self.workload.rejected:
            self.log.reject(request, self.t0 + request.arrival_s, reason)
        last_check = 0.0
        while self.pending or self.active:
            now = time.perf_counter()
            self._release(now - self.t0)
            wait = min(self.pending[0][0] - (now - self.t0), 0.05) if self.pending else 0.05
            self._pump(max(wait, 0.0))
            if now - last_check > LIVENESS_CHECK_S:
                self._check_workers(now)
                last_check = now

    def _release(self, now_s: float) -> None:
        while self.pending and self.pending[0][0] <= now_s:
            _, _, request = heapq.heappop(self.pending)
            self._admit(request)

    def _pump(self, timeout: float) -> None:
        try:
            msg = self.cluster.events.get(timeout=timeout) if timeout > 0 else self.cluster.events.get_nowait()
            while True:
                self.handle(msg)
                msg = self.cluster.events.get_nowait()
        except queue.Empty:
            pass

    # -- admission and dispatch ----------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        t = time.perf_counter()
        self.log.register(request)
        reason = self._admission_refusal(request)
        worker = None if reason else self.front.pick(request)
        if reason or worker is None:
            self.log.reject(request, t, reason or "no live worker to serve it")
            return
        tracked = Tracked(request, worker)
        self.active[request.request_id] = tracked
        load = self.loads[worker]
        load.queued_prompt_tokens += request.input_len
        load.bound_sequences += 1
        decode = self._bind_decode(tracked) if self.disagg and self.kv.binding == "early" else None
        self.log.event(request.request_id, Event.DISPATCHED, t, worker=worker)
        self.cluster.inboxes[worker].put(Serve(request.request_id, request.prompt_token_ids, request.output_len, decode))
        self.log.event(request.request_id, Event.PREFILL_QUEUED, time.perf_counter(), worker=worker)

    def _admission_refusal(self, request: Request) -> Optional[str]:
        cap = self.cfg.max_prompt_len
        if cap is not None and request.input_len > cap:
            return f"prompt of {request.input_len} tokens exceeds cluster.max_prompt_len={cap}"
        limit = self.cfg.max_outstanding
        if limit is not None and len(self.active) >= limit:
            return f"{len(self.active)} requests outstanding (cluster.max_outstanding={limit})"
        return None

    def _bind_decode(self, tracked: Tracked) -> Optional[int]:
        """Pick the decode worker and have it reserve blocks for the KV."""
        request = tracked.request
        if request.output_len <= 1:
            return None  # finishes with its first token on the prefill worker
        worker = self.back.pick(request)
        if worker is None:
            return None
        tracked.decode_worker = worker
        self.loads[worker].bound_sequences += 1
        self.cluster.inboxes[worker].put(Reserve(request.request_id, request.prompt_token_ids, request.output_len,
                                                 tracked.worker))
        return worker

    # -- worker reports ------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if hasattr(msg, "worker"):
            self.last_seen[msg.worker] = time.perf_counter()
        if isinstance(msg, StepEvents):
            self._on_step(msg)
        elif isinstance(msg, KVSent):
            self._on_sent(msg)
        elif isinstance(msg, KVArrived):
            self.log.event(msg.rid, Event.KV_TRANSFER_END, msg.t, decode_worker=msg.worker)
            self.log.event(msg.rid, Event.DECODE_QUEUED, msg.t, worker=msg.worker)
            self.transfers.setdefault(msg.rid, {})["end_s"] = msg.t - self.t0
        elif isinstance(msg, Failed):
            self._on_failed(msg)
        elif isinstance(msg, WorkerError):
            raise RuntimeError(f"worker {msg.worker} crashed:\n{msg.error}")
        elif not isinstance(msg, (Heartbeat, Reserved)):
            raise AssertionError(f"unexpected message {msg!r}")

    def _on_step(self, ev: StepEvents) -> None:
        self.steps.append((ev.worker, ev.record))
        self.loads[ev.worker].free_blocks = ev.free_blocks
        for rid, _, was_prefill in ev.scheduled:
            kind = (Event.PREFILL_START, Event.PREFILL_CHUNK) if was_prefill else (Event.DECODE_START,)
            for event in kind:
                self.log.event(rid, event, ev.record.start, worker=ev.worker)
        received = time.perf_counter()
        for rid, index, token in ev.tokens:
            self._on_token(rid, index, token, ev, received)
        for rid in ev.handoff:
            tracked = self.active.get(rid)
            if tracked is not None and tracked.decode_worker is None and self.kv.binding == "late":
                self._bind_decode(tracked)
        for rid in ev.finished:
            self._finish(rid, received)

    def _on_token(self, rid: int, index: int, token: int, ev: StepEvents, received: float) -> None:
        tracked = self.active.get(rid)
        if tracked is None or index != len(tracked.output):
            return  # a recomputed prefix re-emits tokens the client already has
        tracked.output.append(token)
        self.log.tokens(rid, [token], ev.t, received)
        if index == 0:
            self.log.event(rid, Event.PREFILL_END, ev.t, worker=ev.worker)
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len

    def _on_sent(self, msg: KVSent) -> None:
        self.log.event(msg.rid, Event.KV_TRANSFER_START, msg.start, prefill_worker=msg.prefill_rank,
                       decode_worker=msg.decode_rank, kv_bytes=msg.kv_bytes)
        row = self.transfers.setdefault(msg.rid, {})
        row.update(request_id=msg.rid, prefill_worker=msg.prefill_rank, decode_worker=msg.decode_rank,
                   kv_bytes=msg.kv_bytes, start_s=msg.start - self.t0, send_end_s=msg.end - self.t0,
                   wait_s=msg.wait_s)
        row.setdefault("end_s", msg.end - self.t0)
        tracked = self.active.get(msg.rid)
        if tracked is not None:
            self._leave_front(tracked)

    def _on_failed(self, msg: Failed) -> None:
        if "recomputing" in msg.reason:
            return  # the decode worker carries on: the request is late, not lost
        self._fail(msg.rid, msg.t, msg.reason)

    # -- endings -------------------------------------------------------------------------------
    def _finish(self, rid: int, t: float) -> None:
        tracked = self._close(rid)
        if tracked is None:
            return
        self.log.finish(rid, t)
        self.on_finish()
        follow_up = self.workload.next_turn(tracked.request, tracked.output, t - self.t0)
        if follow_up is not None:
            heapq.heappush(self.pending, (follow_up.arrival_s, follow_up.request_id, follow_up))

    def _fail(self, rid: int, t: float, reason: str) -> None:
        tracked = self._close(rid)
        if tracked is None:
            return
        self.log.fail(rid, t, reason)
        self.on_finish()
        for worker in (tracked.worker, tracked.decode_worker):
            if worker is not None and self.cluster.alive(worker):
                self.cluster.inboxes[worker].put(Abort(rid, reason))

    def _close(self, rid: int) -> Optional[Tracked]:
        tracked = self.active.pop(rid, None)
        if tracked is None:
            return None
        if not tracked.output:
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len
        self._leave_front(tracked)
        if tracked.decode_worker is not None:
            self.loads[tracked.decode_worker].bound_sequences -= 1
        return tracked

    def _leave_front(self, tracked: Tracked) -> None:
        if not tracked.left_front:
            tracked.left_front = True
            self.loads[tracked.worker].bound_sequences -= 1

    def _check_workers(self, now: float) -> None:
        silent_limit = 5 * self.cfg.heartbeat_s
        for rank, load in self.loads.items():
            if not load.alive:
                continue
            dead = not self.cluster.alive(rank)
            if not dead and now - self.last_seen[rank] > silent_limit:
                self.cluster.processes[rank].kill()  # silent too long: treat as lost
                dead = True
            if dead:
                self._lose_worker(rank, now)

    def _lose_worker(self, rank: int, now: float) -> None:
        self.loads[rank].alive = False
        role = self.cluster.plans[rank].role
        for rid, tracked in list(self.active.items()):
            if (tracked.worker == rank and not tracked.left_front) or tracked.decode_worker == rank:
                self._fail(rid, now, f"worker {rank} ({role}) died")
