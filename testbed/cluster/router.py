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
from testbed.cluster.dispatch import Dispatcher, WorkerLoad, admission_refusal
from testbed.cluster.faults import FaultInjected, FaultsConfig, Stall
from testbed.cluster.launcher import Cluster
from testbed.cluster.memory import RssSampler
from testbed.cluster.messages import (Abort, Failed, Heartbeat, KVArrived, KVAttemptFailed, KVSent, Reserve, Reserved,
                                      Serve, StepEvents, WorkerError)
from testbed.cluster.transfers import TransferLog
from testbed.metrics.events import Event, RequestLog
from testbed.workload import Request, Workload

LIVENESS_CHECK_S = 0.2
MEMORY_SAMPLE_S = 1.0


@dataclass
class Tracked:
    request: Request
    worker: int  # the mixed or prefill worker
    decode_worker: Optional[int] = None
    output: list = field(default_factory=list)
    left_front: bool = False  # prefill side done with it (mixed: finished; disagg: KV sent)
    on_decode: bool = False  # D holds it: KV installed, or D recomputes it
    queued: bool = True  # its prompt tokens count in its worker's queue until the first token
    early: dict = field(default_factory=dict)  # index -> (token, worker time): arrived before their turn
    finished_early: bool = False  # the last token was reported before all earlier ones arrived


class Router:
    def __init__(self, cluster: Cluster, workload: Workload, log: RequestLog, mode: str,
                 cluster_config: ClusterConfig, kv: KVTransferConfig, t0: float, faults: FaultsConfig = FaultsConfig()):
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
        self.transfers = TransferLog(t0)  # one row per KV transfer attempt
        self.last_seen = {rank: time.perf_counter() for rank in roles}
        self.last_progress = time.perf_counter()
        self.on_finish: Callable[[], None] = lambda: None
        self.cluster_faults, self.timed_faults = faults, faults.timed()
        self.memory = RssSampler({f"worker{rank}": s.pid for rank, s in cluster.started.items()})
        self.faults: list[dict] = []  # every injected fault and every re-dispatch, for the results

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        for request, reason in self.workload.rejected:
            self.log.reject(request, self.t0 + request.arrival_s, reason, by="workload")
        last_check = last_sample = 0.0
        while self.pending or self.active:
            now = time.perf_counter()
            self._release(now - self.t0)
            self._inject(now - self.t0)
            wait = min(self.pending[0][0] - (now - self.t0), 0.05) if self.pending else 0.05
            self._pump(max(wait, 0.0))
            if now - last_check > LIVENESS_CHECK_S:
                self._check_workers(now)
                self._check_progress(now)
                last_check = now
            if now - last_sample > MEMORY_SAMPLE_S:
                self.memory.sample()
                last_sample = now

    def _inject(self, now_s: float) -> None:
        while self.timed_faults and self.timed_faults[0][0] <= now_s:
            _, kind, worker = self.timed_faults.pop(0)
            if kind == "kill_worker":
                self.cluster.processes[worker].kill()
            else:
                self.cluster.inboxes[worker].put(Stall(self.cluster_faults.stall_ms / 1000))
            self.faults.append({"kind": kind, "worker": worker, "request_id": None, "t_s": now_s})

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
        if not self.active:
            self.last_progress = t  # an idle gap between arrivals is not a stall
        self.log.register(request)
        reason = admission_refusal(self.cfg, request, len(self.active))
        worker = None if reason else self.front.pick(request)
        if reason or worker is None:
            self.log.reject(request, t, reason or "no live worker to serve it")
            return
        tracked = Tracked(request, worker)
        self.active[request.request_id] = tracked
        self.log.event(request.request_id, Event.DISPATCHED, t, worker=worker)
        self._dispatch(tracked)
        self.log.event(request.request_id, Event.PREFILL_QUEUED, time.perf_counter(), worker=worker)

    def _dispatch(self, tracked: Tracked) -> None:
        request, load = tracked.request, self.loads[tracked.worker]
        load.queued_prompt_tokens += request.input_len
        load.bound_sequences += 1
        decode = self._bind_decode(tracked) if self.disagg and self.kv.binding == "early" else None
        self.cluster.inboxes[tracked.worker].put(Serve(request.request_id, request.prompt_token_ids,
                                                       request.output_len, decode))

    def _bind_decode(self, tracked: Tracked) -> Optional[int]:
        """Pick the decode worker and have it reserve blocks for the KV."""
        request = tracked.request
        worker = tracked.decode_worker = self.back.bind(request)
        if worker is None:
            return None
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
            self._on_arrived(msg)
        elif isinstance(msg, KVAttemptFailed):
            self.transfers.failed(msg)
        elif isinstance(msg, Failed):
            self._on_failed(msg)
        elif isinstance(msg, FaultInjected):
            self.faults.append({"kind": msg.kind, "worker": msg.worker, "request_id": msg.rid, "t_s": msg.t - self.t0})
        elif isinstance(msg, WorkerError):
            raise RuntimeError(f"worker {msg.worker} crashed:\n{msg.error}")
        elif not isinstance(msg, (Heartbeat, Reserved)):
            raise AssertionError(f"unexpected message {msg!r}")

    def _on_step(self, ev: StepEvents) -> None:
        self.last_progress = time.perf_counter()
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
            tracked = self.active.get(rid)
            if tracked is not None and len(tracked.output) < tracked.request.output_len:
                tracked.finished_early = True  # D's report overtook P's first token: wait for it
            else:
                self._finish(rid, received)

    def _on_token(self, rid: int, index: int, token: int, ev: StepEvents, received: float) -> None:
        tracked = self.active.get(rid)
        if tracked is None:
            return
        if tracked.queued and ev.worker == tracked.worker:
            tracked.queued = False
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len
        if index < len(tracked.output):
            return  # a recomputed prefix re-emits tokens the client already has
        # P's and D's reports travel on different pipes: D's first decode can overtake P's first
        # token. The client sees tokens in order, so a later one waits for its predecessors.
        tracked.early[index] = (token, ev.t, ev.worker)
        while len(tracked.output) in tracked.early:
            token, worker_t, worker = tracked.early.pop(len(tracked.output))
            if not tracked.output:
                self.log.event(rid, Event.PREFILL_END, worker_t, worker=worker)
            tracked.output.append(token)
            self.log.tokens(rid, [token], worker_t, received)
        if tracked.finished_early and len(tracked.output) == tracked.request.output_len:
            self._finish(rid, received)

    def _on_sent(self, msg: KVSent) -> None:
        self.transfers.sent(msg)
        if not (msg.dropped or msg.error):  # an attempt that moved data (the first one wins)
            self.log.event(msg.rid, Event.KV_TRANSFER_START, msg.start, prefill_worker=msg.prefill_rank,
                           decode_worker=msg.decode_rank, kv_bytes=msg.kv_bytes)
        tracked = self.active.get(msg.rid)
        if tracked is not None:
            self._leave_front(tracked)

    def _on_arrived(self, msg: KVArrived) -> None:
        self.transfers.arrived(msg)
        self.log.event(msg.rid, Event.KV_TRANSFER_END, msg.t, decode_worker=msg.worker)
        self.log.event(msg.rid, Event.DECODE_QUEUED, msg.t, worker=msg.worker)
        tracked = self.active.get(msg.rid)
        if tracked is not None:
            tracked.on_decode = True

    def _on_failed(self, msg: Failed) -> None:
        tracked = self.active.get(msg.rid)
        if tracked is None or msg.worker not in (tracked.worker, tracked.decode_worker):
            return  # the request ended, or moved to other workers, before this report
        if msg.kind == "kv_recompute":
            tracked.on_decode = True  # the decode worker carries on: the request is late, not lost
            return
        if msg.kind == "kv_broken":  # the wire to the prefill worker broke: that worker is lost to it
            self._lost(msg.rid, tracked, msg.reason, time.perf_counter())
            return
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
        if tracked is not None:
            self._unbind(tracked)
        return tracked

    def _unbind(self, tracked: Tracked) -> None:
        if tracked.queued:
            tracked.queued = False
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len
        self._leave_front(tracked)
        if tracked.decode_worker is not None:
            self.loads[tracked.decode_worker].bound_sequences -= 1
            tracked.decode_worker = None

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

    def _check_progress(self, now: float) -> None:
        """The run's own bound: when no step anywhere has run for stall_timeout_s while requests
        wait (a hang that still heartbeats), those requests fail instead of the run waiting."""
        if self.active and now - self.last_progress > self.cfg.stall_timeout_s:
            for rid in list(self.active):
                self._fail(rid, now, f"no worker reported for {self.cfg.stall_timeout_s:.0f} s (cluster.stall_timeout_s)")

    def _lose_worker(self, rank: int, now: float) -> None:
        self.loads[rank].alive = False
        role = self.cluster.plans[rank].role
        for rid, tracked in list(self.active.items()):
            if self._depends_on(tracked, rank):
                self._lost(rid, tracked, f"worker {rank} ({role}) died", now)

    def _depends_on(self, tracked: Tracked, rank: int) -> bool:
        """Its decode worker, and its prefill worker until the KV has left (or, where P keeps
        the KV for resends, until D holds the request)."""
        if tracked.decode_worker == rank:
            return True
        resendable = self.kv.on_failure == "retry" and not tracked.on_decode
        return tracked.worker == rank and (not tracked.left_front or resendable)

    def _lost(self, rid: int, tracked: Tracked, reason: str, now: float) -> None:
        """A worker the request needs is gone: re-dispatch it or fail it (cluster.on_worker_failure)."""
        if self.cfg.on_worker_failure == "redispatch" and self._redispatch(rid, tracked, reason, now):
            return
        self._fail(rid, now, reason)

    def _redispatch(self, rid: int, tracked: Tracked, reason: str, now: float) -> bool:
        """Start the request over on live workers; the client keeps the tokens it has (the new
        run re-emits them and the router passes on only what is new)."""
        worker = self.front.pick(tracked.request)
        if worker is None:
            return False
        for old in (tracked.worker, tracked.decode_worker):
            if old is not None and self.loads[old].alive:
                self.cluster.inboxes[old].put(Abort(rid, reason))
        self._unbind(tracked)
        tracked.worker, tracked.left_front, tracked.queued, tracked.on_decode = worker, False, True, False
        self._dispatch(tracked)
        self.faults.append({"kind": "redispatch", "worker": worker, "request_id": rid, "t_s": now - self.t0})
        return True
