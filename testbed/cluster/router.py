"""The router (driver): replays the workload, turns worker reports into calls on the request book.

Open loop: requests are released at their arrival times whatever the system's state; a
session's next turn is released a think time after its previous turn finished, and so is a
closed loop's next request after any of its user's requests ended (finished, failed, refused:
testbed/workload/closed_loop.py), so a loop of N users never has more than N in flight.
Every rule about a request (admission, loads, binding, token order, endings) lives in the
request book (testbed/control/book.py), which the simulator drives too; the router stamps times,
sends messages and watches the workers. Every token is stamped twice: on the worker (end of its
step) and here on receipt; TTFT and ITL use the receipt time, and the difference is the
harness's own delay.
"""

from __future__ import annotations

import heapq
import queue
import time
from typing import Callable

from testbed.cluster.contention import ContentionSampler, schedstat
from testbed.cluster.launcher import Cluster
from testbed.cluster.memory import RssSampler
from testbed.control.book import RequestBook
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.control.request import Tracked, WorkerStep
from testbed.control.transfers import TransferLog
from testbed.metrics.events import RequestLog
from testbed.metrics.steps import StepLog
from testbed.names import Mode
from testbed.net.faults import FaultInjected, FaultsConfig, Stall
from testbed.net.messages import (
    Abort,
    Failed,
    Heartbeat,
    KVArrived,
    KVAttemptFailed,
    KVSent,
    Pong,
    Reserve,
    Reserved,
    Serve,
    StepEvents,
    WorkerError,
)
from testbed.workload import Request, Workload

LIVENESS_CHECK_S = 0.2
MEMORY_SAMPLE_S = 1.0


class Router:
    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        log: RequestLog,
        mode: str,
        cluster_config: ClusterConfig,
        kv: KVTransferConfig,
        t0: float,
        faults: FaultsConfig = FaultsConfig(),
        block_size: int = 16,
        tenants=(),
    ):
        self.cluster, self.workload, self.log, self.t0 = cluster, workload, log, t0
        self.cluster_config = cluster_config
        roles = {p.rank: p.role for p in cluster.plans}
        self.book = RequestBook(cluster_config, kv, mode == Mode.DISAGG, roles, log, block_size, tenants)
        self.pending = [(r.arrival_s, r.request_id, r) for r in workload.initial()]
        heapq.heapify(self.pending)
        self.released = 0  # requests taken off `pending` (a session's later turns join it as they come)
        self.steps = StepLog()
        # one row per KV transfer attempt, marked where it crossed nodes
        self.transfers = TransferLog(t0, {rank: s.node for rank, s in cluster.started.items()})
        self.last_seen = {rank: time.perf_counter() for rank in roles}
        # liveness: a worker silent for 5 heartbeats whose process is alive is slow, not lost: its
        # open silence (rank -> (when it last reported, its process's CPU s when found silent)) and
        # every silence that ended (slow_periods); lost only when silent for hang_s
        self.silent: dict[int, tuple[float, float | None]] = {}
        self.slow_periods: list[dict] = []
        self.pids = {int(name.removeprefix("worker")): pid for name, pid in cluster.local_pids().items()}
        self.last_progress = time.perf_counter()
        self.on_finish: Callable[[], None] = lambda: None
        self.cluster_faults, self.timed_faults = faults, faults.timed()
        # a kill triggered by the run's state: (requests ended, worker), or None
        self.counted_kill = None if faults.kill_after_ended is None else (faults.kill_after_ended, faults.kill_worker)
        self.memory = RssSampler(cluster.local_pids())
        self.host = ContentionSampler(cluster.local_pids())  # what the host gave the run's processes
        self.faults: list[dict] = []  # every injected fault and every re-dispatch, for the results
        self.harness: list[tuple[float, float, float]] = []  # per step report: build, pipe, router queue
        self.last_check = self.last_sample = 0.0  # the liveness check's and the memory sample's (_watch)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop=None) -> None:
        """Until every request ended, or `stop` (a threading.Event: a signal) is set: then the loop
        ends between two reports, where the book is whole, and `interrupt` ends what is open."""
        self.book.reject_workload(self.workload.rejected, self.t0)
        while (self.pending or self.book.active) and not (stop is not None and stop.is_set()):
            now = time.perf_counter()
            self._release(now - self.t0)
            self._inject(now - self.t0)
            wait = min(self.pending[0][0] - (now - self.t0), 0.05) if self.pending else 0.05
            self._pump(max(wait, 0.0))
            self._watch(now)

    def interrupt(self, reason: str) -> int:
        """Fail every open request (its workers abort it and free its KV, so the audit stays
        clean); returns how many."""
        open_ids = list(self.book.active)
        for rid in open_ids:
            self._fail(rid, time.perf_counter(), reason)
        return len(open_ids)

    def _watch(self, now: float) -> None:
        """The liveness block of every router loop: each LIVENESS_CHECK_S, the workers' liveness and
        the run's progress; each MEMORY_SAMPLE_S, the processes' memory and CPU counters."""
        if now - self.last_check > LIVENESS_CHECK_S:
            self._check_workers(now)
            self._check_progress(now)
            self.last_check = now
        if now - self.last_sample > MEMORY_SAMPLE_S:
            self.memory.sample()
            self.host.sample()
            self.last_sample = now

    def _inject(self, now_s: float) -> None:
        if self.counted_kill is not None and self._ended() >= self.counted_kill[0]:
            self.timed_faults.insert(0, (now_s, "kill_worker", self.counted_kill[1]))
            self.counted_kill = None
        while self.timed_faults and self.timed_faults[0][0] <= now_s:
            _, kind, worker = self.timed_faults.pop(0)
            if kind == "kill_worker":
                self.cluster.kill(worker)
            else:
                self.cluster.inboxes[worker].put(Stall(self.cluster_faults.stall_ms / 1000))
            self.faults.append({"kind": kind, "worker": worker, "request_id": None, "t_s": now_s})

    def _ended(self) -> int:
        """Requests that ended (finished, failed or refused): released and no longer open."""
        return self.released - len(self.book.active)

    def _release(self, now_s: float) -> None:
        while self.pending and self.pending[0][0] <= now_s:
            _, _, request = heapq.heappop(self.pending)
            self.released += 1
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
        if not self.book.active:
            self.last_progress = t  # an idle gap between arrivals is not a stall
        tracked = self.book.admit(request, t)
        if tracked is not None:
            self._dispatch(tracked)
        else:  # refused: a closed loop's user sends its next request
            self._follow(self.workload.ended(request, t - self.t0))

    def _dispatch(self, tracked: Tracked) -> None:
        self.book.deliver(tracked, self._reserve, self._serve, time.perf_counter)

    def _serve(self, tracked: Tracked) -> None:
        request = tracked.request
        self.cluster.inboxes[tracked.worker].put(
            Serve(request.request_id, request.prompt_token_ids, request.output_len, tracked.decode_worker)
        )

    def _reserve(self, tracked: Tracked) -> None:
        request = tracked.request
        self.cluster.inboxes[tracked.decode_worker].put(
            Reserve(request.request_id, request.prompt_token_ids, request.output_len, tracked.worker)
        )

    # -- worker reports ------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if hasattr(msg, "worker"):
            self.last_seen[msg.worker] = now = time.perf_counter()
            if msg.worker in self.silent:
                self._end_silence(msg.worker, now, "reported")
        if isinstance(msg, StepEvents):
            self._on_step(msg)
        elif isinstance(msg, KVSent):
            self.transfers.sent(
                msg.rid,
                msg.prefill_rank,
                msg.decode_rank,
                msg.attempt,
                msg.kv_bytes,
                msg.start,
                msg.end,
                msg.wait_s,
                msg.dropped,
                bool(msg.error),
            )
            moved = not (msg.dropped or msg.error)  # an attempt that moved data (the first one wins)
            self.book.kv_sent(msg.rid, msg.prefill_rank, msg.decode_rank, msg.start, msg.kv_bytes, moved)
        elif isinstance(msg, KVArrived):
            self.transfers.arrived(msg.rid, msg.prefill_rank, msg.worker, msg.attempt, msg.t)
            self.book.kv_arrived(msg.rid, msg.worker, msg.t)
        elif isinstance(msg, KVAttemptFailed):
            self.transfers.failed(msg.rid, msg.prefill_rank, msg.worker, msg.attempt, msg.outcome, msg.t)
        elif isinstance(msg, Failed):
            self._on_failed(msg)
        elif isinstance(msg, FaultInjected):
            self.faults.append({"kind": msg.kind, "worker": msg.worker, "request_id": msg.rid, "t_s": msg.t - self.t0})
        elif isinstance(msg, WorkerError):
            raise RuntimeError(f"worker {msg.worker} crashed:\n{msg.error}")
        elif not isinstance(msg, (Heartbeat, Reserved, Pong)):
            raise AssertionError(f"unexpected message {msg!r}")

    def _on_step(self, ev: StepEvents) -> None:
        self.last_progress = received = time.perf_counter()
        read = getattr(self.cluster.events, "last_read", received)
        self.harness.append((ev.sent - ev.t, read - ev.sent, received - read))
        self.steps.add(ev.worker, ev.record)
        step = WorkerStep(ev.worker, ev.record.start, ev.t, ev.free_blocks, ev.report, ev.cached)
        for tracked in self.book.step_report(step, received, self._reserve):
            self._finished(tracked, received)

    def _on_failed(self, msg: Failed) -> None:
        tracked = self.book.involves(msg.rid, msg.worker)
        if tracked is None:
            return  # the request ended, or moved to other workers, before this report
        if msg.kind == "kv_recompute":
            self.book.decode_recomputes(msg.rid, msg.worker)  # late, not lost
        elif msg.kind == "kv_broken":  # the wire to the prefill worker broke: that worker is lost to it
            self._lost(msg.rid, msg.reason, time.perf_counter())
        else:
            self._fail(msg.rid, msg.t, msg.reason)

    # -- endings -------------------------------------------------------------------------------
    def _finished(self, tracked: Tracked, t: float) -> None:
        self.on_finish()
        self._follow(self.workload.next_turn(tracked.request, tracked.output, t - self.t0))

    def _follow(self, follow_up) -> None:
        """A session's next turn or a closed loop's next request waits for its arrival time."""
        if follow_up is not None:
            heapq.heappush(self.pending, (follow_up.arrival_s, follow_up.request_id, follow_up))

    def _fail(self, rid: int, t: float, reason: str) -> None:
        tracked = self.book.get(rid)
        # its workers read before the book closes it: closing unbinds the decode worker (decode_worker
        # turns None), and a decode worker never told would keep the request's blocks to the end
        workers = () if tracked is None else (tracked.worker, tracked.decode_worker)
        if self.book.fail(rid, t, reason) is None:
            return
        self.on_finish()
        self._follow(self.workload.ended(tracked.request, t - self.t0))
        for worker in workers:
            if worker is not None and self.cluster.alive(worker):
                self.cluster.inboxes[worker].put(Abort(rid, reason))

    @property
    def hang_s(self) -> float:
        """How long a worker whose process is alive may stay silent before it is lost as hung:
        cluster.stall_timeout_s, and never less than the 5 heartbeats that make it slow."""
        return max(self.cluster_config.stall_timeout_s, 5 * self.cluster_config.heartbeat_s)

    def _check_workers(self, now: float) -> None:
        """A worker whose process is gone is lost. One whose process is alive but that sent nothing
        for 5 heartbeats is slow (a starved host, a long step): counted, not failed, and its
        requests wait; silent for hang_s it is lost as hung (under torchrun the run fails here)."""
        beats = 5 * self.cluster_config.heartbeat_s
        for rank, load in self.book.loads.items():
            if not load.alive:
                continue
            silent_s = now - self.last_seen[rank]
            if self.cluster.alive(rank):
                if silent_s <= self.hang_s:
                    if silent_s > beats and rank not in self.silent:
                        self.silent[rank] = (self.last_seen[rank], self._cpu_s(rank))
                    continue
                why = (
                    f"hung: silent for {silent_s:.0f} s with its process alive (over {self.hang_s:g} s: "
                    "cluster.stall_timeout_s, and at least 5 x cluster.heartbeat_s)"
                )
                ended = "hung"
            else:
                why, ended = "its process is gone", "died"
            if rank in self.silent:
                self._end_silence(rank, now, f"lost ({ended})")
            self.cluster.lose(rank, why)
            role = self.cluster.plans[rank].role
            for rid in self.book.lose_worker(rank):
                self._lost(rid, f"worker {rank} ({role}) {ended}", now)

    def _cpu_s(self, rank: int) -> float | None:
        """The on-CPU seconds of a local worker's main thread (None where not measured)."""
        counters = schedstat(self.pids[rank]) if rank in self.pids else None
        return None if counters is None else counters[0]

    def _end_silence(self, rank: int, now: float, ended: str) -> None:
        since, cpu = self.silent.pop(rank)
        cpu_now = self._cpu_s(rank) if cpu is not None else None
        self.slow_periods.append(
            {
                "worker": f"worker{rank}",
                "from_s": since - self.t0,
                "to_s": now - self.t0,
                "silent_s": now - since,
                # what its process ran from when it was found silent: ~0 blocked, else working slowly
                "cpu_s": None if cpu_now is None else cpu_now - cpu,
                "ended": ended,
            }
        )

    def liveness(self) -> list[dict]:
        """Every slow period of the run (those still open end now, with the run)."""
        now = time.perf_counter()
        for rank in list(self.silent):
            self._end_silence(rank, now, "run ended")
        return self.slow_periods

    def _check_progress(self, now: float) -> None:
        """The run's own bound: when no step anywhere has run for stall_timeout_s while requests
        wait (a hang that still heartbeats), those requests fail instead of the run waiting."""
        limit = self.cluster_config.stall_timeout_s
        if self.book.active and now - self.last_progress > limit:
            for rid in list(self.book.active):
                self._fail(rid, now, f"no worker reported for {limit:.0f} s (cluster.stall_timeout_s)")

    def _lost(self, rid: int, reason: str, now: float) -> None:
        """A worker the request needs is gone: start it over on live workers (the client keeps
        the tokens it has) or fail it (cluster.on_worker_failure)."""
        moved = self.book.redispatch(rid) if self.cluster_config.on_worker_failure == "redispatch" else None
        if moved is None:
            self._fail(rid, now, reason)
            return
        tracked, old = moved
        for worker in old:
            self.cluster.inboxes[worker].put(Abort(rid, reason))
        self._dispatch(tracked)
        self.faults.append({"kind": "redispatch", "worker": tracked.worker, "request_id": rid, "t_s": now - self.t0})
