"""Discrete-event simulation of the serving cluster: simulate(cfg) -> the tables of a run.

The router's logic (testbed/cluster/router.py) on a virtual clock: open-loop arrivals, closed-
loop session turns, the real Dispatcher (round robin / least loaded / session affinity),
admission caps, early or late binding of the decode worker, and the connector's back-pressure
and timeouts. Workers are `SimWorker`s: the real Scheduler and BlockManager, with the forward
pass replaced by the step time of its role's cost model (testbed/sim/profiles.py: a measured
profile or an analytical GPU; P and D may differ). Messages take no time (harness delay 0); a KV
transfer takes `transfer_time(bytes)` of the slower link of its two ends, one at a time per
prefill worker. Events at the same instant are all delivered before idle workers look for
their next step, as a real worker drains its inbox before stepping.

Simplifications, each erring towards the real system's slower path: layer-wise KV streaming
(kv_transfer.granularity=layer) moves the KV after the prefill like granularity=request; a
transfer that times out fails the request (kv_transfer.on_failure=recompute is not modelled);
workers never die; a KV send costs the prefill worker no compute time.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from testbed.cluster.dispatch import Dispatcher, WorkerLoad, admission_refusal
from testbed.config import Config
from testbed.engine.sequence import Sequence
from testbed.errors import ConfigError
from testbed.metrics.events import Event
from testbed.metrics.slo import tenant_slos
from testbed.metrics.summary import summarize
from testbed.sim.plan import plan_sim_workers
from testbed.sim.profiles import ROLE_OF, resolve_roles, role_blocks, transfer_time
from testbed.sim.tables import SimRequestLog, TransferRow, requests_steps_transfers
from testbed.sim.worker import SAMPLED_TOKEN, Outgoing, SimWorker
from testbed.workload import Request, build_workload

ARRIVE, STEP_END, KV_SENT, SEND_DEADLINE, RECEIVE_DEADLINE, DELIVER = range(6)


@dataclass
class Tracked:
    request: Request
    worker: int
    decode_worker: Optional[int] = None
    token_times: list = field(default_factory=list)
    left_front: bool = False
    decode_started: bool = False


class Simulation:
    def __init__(self, cfg: Config, profile: Optional[Mapping] = None, num_devices: Optional[int] = None):
        cfg.validate()
        args = cfg.model.args()
        self.cfg, self.args = cfg, args
        available = num_devices if num_devices is not None else cfg.hardware.num_devices
        self.plans = plan_sim_workers(cfg.mode, cfg.cluster, available)
        self.profiles = resolve_roles(cfg, {ROLE_OF[p.role] for p in self.plans}, profile)
        self.roles = [self.profiles[ROLE_OF[p.role]] for p in self.plans]  # by rank
        self.kv_bytes_per_token = args.kv_bytes_per_token * next(iter(self.profiles.values())).dtype_bytes
        blocks = role_blocks(cfg, self.profiles)
        self.workers = [SimWorker(p.rank, p.role, blocks[ROLE_OF[p.role]], cfg.engine, cfg.scheduler,
                                  cfg.kv_transfer.max_pending) for p in self.plans]
        self.workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size,
                                       max_model_len=args.max_model_len)
        self.log = SimRequestLog()
        self.loads = {p.rank: WorkerLoad() for p in self.plans}
        front = [p.rank for p in self.plans if p.role != "decode_only"]
        back = [p.rank for p in self.plans if p.role == "decode_only"]
        self.front = Dispatcher(cfg.cluster.dispatch, front, self.loads)
        self.back = Dispatcher(cfg.cluster.decode_dispatch, back, self.loads, for_decode=True)
        self.disagg, self.kv = cfg.mode == "disagg", cfg.kv_transfer
        self.queue: list = []
        self.counter = 0
        self.now = 0.0
        self.active: dict[int, Tracked] = {}
        self.dirty: set[int] = set()
        self.steps: list[tuple] = []
        self.transfers: dict[int, TransferRow] = {}
        self.num_events = 0
        self.handlers = {ARRIVE: self._arrive, STEP_END: self._step_end, KV_SENT: self._kv_sent,
                         SEND_DEADLINE: self._send_deadline, RECEIVE_DEADLINE: self._receive_deadline,
                         DELIVER: self._deliver}
        # the router -> worker hop of a real run (queue, process wake-up): sim.dispatch_latency_s
        self.dispatch_latency = cfg.sim.dispatch_latency_s

    # -- the event loop --------------------------------------------------------------------------
    def push(self, t: float, kind: int, payload) -> None:
        self.counter += 1  # ties break in push order: the same seed gives the same run
        heapq.heappush(self.queue, (t, self.counter, kind, payload))

    def run(self) -> None:
        for request, reason in self.workload.rejected:
            self.log.reject(request, request.arrival_s, reason, by="workload")
        for request in self.workload.requests:
            self.push(request.arrival_s, ARRIVE, request)
        queue, handlers = self.queue, self.handlers
        while queue:
            self.now, _, kind, payload = heapq.heappop(queue)
            handlers[kind](payload)
            self.num_events += 1
            if self.dirty and (not queue or queue[0][0] > self.now):
                self._wake()
        for rid in list(self.active):  # stuck: recorded as unfinished (failed) with the tokens it got
            self.log.token_series(rid, SAMPLED_TOKEN, self.active.pop(rid).token_times)

    def _wake(self) -> None:
        """Idle workers with news look for their next step (D first reserves what it can)."""
        ranks, self.dirty = sorted(self.dirty), set()
        for rank in ranks:
            worker = self.workers[rank]
            if worker.role == "decode_only":
                for entry in worker.admit(self.now):
                    self._reserved(rank, entry)
            if worker.can_step():
                duration = worker.start_step(self.now, self.roles[rank].cost)
                if duration is not None:
                    self.push(self.now + duration, STEP_END, rank)

    # -- admission and dispatch --------------------------------------------------------------------
    def _arrive(self, request: Request) -> None:
        self.log.register(request)
        reason = admission_refusal(self.cfg.cluster, request, len(self.active))
        worker = None if reason else self.front.pick(request)
        if reason or worker is None:
            self.log.reject(request, self.now, reason or "no live worker to serve it")
            return
        if request.input_len + request.output_len > self.args.max_model_len:  # as Engine.add refuses it
            raise ConfigError(f"request of {request.input_len} prompt + {request.output_len} output tokens exceeds "
                              f"model.max_model_len={self.args.max_model_len}")
        tracked = self.active[request.request_id] = Tracked(request, worker)
        load = self.loads[worker]
        load.queued_prompt_tokens += request.input_len
        load.bound_sequences += 1
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.output_len)
        self.log.event(request.request_id, Event.DISPATCHED, self.now, worker=worker)
        if self.dispatch_latency > 0:
            self.push(self.now + self.dispatch_latency, DELIVER, (tracked, seq))
        else:
            self._deliver((tracked, seq))

    def _deliver(self, payload: tuple[Tracked, Sequence]) -> None:
        """The request reaches its worker (and, bound early, its decode worker's reservation)."""
        tracked, seq = payload
        worker = tracked.worker
        self.workers[worker].scheduler.add(seq)
        if self.disagg and self.kv.binding == "early":
            decode = self._bind_decode(tracked)
            if decode is not None:
                self.workers[worker].bind(seq, decode)
        self.log.event(seq.seq_id, Event.PREFILL_QUEUED, self.now, worker=worker)
        self.dirty.add(worker)

    def _bind_decode(self, tracked: Tracked) -> Optional[int]:
        request = tracked.request
        worker = tracked.decode_worker = self.back.bind(request)
        if worker is None:
            return None
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.output_len)
        self.workers[worker].reserve(seq, tracked.worker)
        self.dirty.add(worker)
        return worker

    # -- steps -------------------------------------------------------------------------------------
    def _step_end(self, rank: int) -> None:
        worker, now, log = self.workers[rank], self.now, self.log
        result, row = worker.finish_step(now)
        self.steps.append(row)
        self.loads[rank].free_blocks = worker.block_manager.num_free_blocks
        for seq in result.handoff:
            self._send_when_ready(rank, worker.handoff(seq, now))
            self.push(now + self.kv.timeout_s, SEND_DEADLINE, (rank, seq.seq_id))
        start = worker.step_start
        for seq, _, was_prefill in result.scheduled:
            rid = seq.seq_id
            if was_prefill:
                log.event(rid, Event.PREFILL_START, start, worker=rank)
                log.event(rid, Event.PREFILL_CHUNK, start, worker=rank)
            else:
                tracked = self.active.get(rid)
                if tracked is not None and not tracked.decode_started:  # later ones change nothing
                    tracked.decode_started = True
                    log.event(rid, Event.DECODE_START, start, worker=rank)
        for seq, _ in result.tokens:
            self._on_token(seq, rank)
        if self.disagg and self.kv.binding == "late":
            for seq in result.handoff:
                tracked = self.active.get(seq.seq_id)
                if tracked is not None and tracked.decode_worker is None:
                    self._bind_decode(tracked)
        for seq in result.finished:
            self._finish(seq.seq_id)
        worker.flush_aborts()
        self.dirty.add(rank)

    def _on_token(self, seq: Sequence, rank: int) -> None:
        tracked = self.active.get(seq.seq_id)
        if tracked is None or seq.num_output_tokens - 1 != len(tracked.token_times):
            return  # a recomputed prefix re-emits tokens the client already has
        tracked.token_times.append(self.now)
        if len(tracked.token_times) == 1:
            self.log.event(seq.seq_id, Event.PREFILL_END, self.now, worker=rank)
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len

    # -- KV transfer ---------------------------------------------------------------------------------
    def _reserved(self, decode_rank: int, entry) -> None:
        self.push(self.now + self.kv.timeout_s, RECEIVE_DEADLINE, (decode_rank, entry.seq.seq_id, entry.reserved_t))
        sender = self.workers[entry.prefill_rank]
        self._send_when_ready(sender.rank, sender.ready(entry.seq.seq_id, decode_rank, self.now))

    def _send_when_ready(self, rank: int, entry: Optional[Outgoing]) -> None:
        if entry is None or entry.handoff_t is None or entry.ready_t is None or entry.start is not None:
            return
        sender = self.workers[rank]
        entry.start = max(self.now, sender.link_free_at)
        duration = transfer_time(self.roles[rank], self.roles[entry.decode_rank], self._kv_bytes(entry.seq))
        sender.link_free_at = entry.start + duration
        self.push(sender.link_free_at, KV_SENT, (sender.rank, entry.seq.seq_id))

    def _kv_bytes(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens * self.kv_bytes_per_token

    def _kv_sent(self, payload: tuple[int, int]) -> None:
        rank, rid = payload
        entry, tracked = self.workers[rank].sent(rid), self.active.get(rid)
        if entry is None or tracked is None:
            return  # failed while on the wire: P's blocks are free, D's abort frees the reservation
        now, nbytes = self.now, self._kv_bytes(entry.seq)
        self.log.event(rid, Event.KV_TRANSFER_START, entry.start, prefill_worker=rank,
                       decode_worker=entry.decode_rank, kv_bytes=nbytes)
        self.transfers[rid] = TransferRow(rid, rank, entry.decode_rank, nbytes, entry.start, now, now,
                                          max(entry.ready_t - entry.handoff_t, 0.0))
        self._leave_front(tracked)
        self.workers[entry.decode_rank].install(rid)
        self.log.event(rid, Event.KV_TRANSFER_END, now, decode_worker=entry.decode_rank)
        self.log.event(rid, Event.DECODE_QUEUED, now, worker=entry.decode_rank)
        self.dirty.update((rank, entry.decode_rank))

    def _send_deadline(self, payload: tuple[int, int]) -> None:
        rank, rid = payload
        if rid in self.workers[rank].out:
            self._fail(rid, f"KV transfer timed out after {self.kv.timeout_s:.0f} s")

    def _receive_deadline(self, payload: tuple[int, int, float]) -> None:
        rank, rid, reserved_t = payload
        entry = self.workers[rank].incoming.get(rid)
        if entry is not None and entry.reserved_t == reserved_t:
            self._fail(rid, f"KV transfer timed out after {self.kv.timeout_s:.0f} s")

    # -- endings -------------------------------------------------------------------------------------
    def _finish(self, rid: int) -> None:
        tracked = self._close(rid)
        if tracked is None:
            return
        self.log.finish(rid, self.now)
        follow_up = self.workload.next_turn(tracked.request, [SAMPLED_TOKEN] * len(tracked.token_times), self.now)
        if follow_up is not None:
            self.push(follow_up.arrival_s, ARRIVE, follow_up)

    def _fail(self, rid: int, reason: str) -> None:
        tracked = self._close(rid)
        if tracked is None:
            return
        self.log.fail(rid, self.now, reason)
        for rank in (tracked.worker, tracked.decode_worker):
            if rank is not None:
                self.workers[rank].abort(rid)
                self.dirty.add(rank)

    def _close(self, rid: int) -> Optional[Tracked]:
        tracked = self.active.pop(rid, None)
        if tracked is None:
            return None
        self.log.token_series(rid, SAMPLED_TOKEN, tracked.token_times)
        if not tracked.token_times:
            self.loads[tracked.worker].queued_prompt_tokens -= tracked.request.input_len
        self._leave_front(tracked)
        if tracked.decode_worker is not None:
            self.loads[tracked.decode_worker].bound_sequences -= 1
        return tracked

    def _leave_front(self, tracked: Tracked) -> None:
        if not tracked.left_front:
            tracked.left_front = True
            self.loads[tracked.worker].bound_sequences -= 1


def simulate(cfg: Config, profile: Optional[Mapping] = None, *, num_devices: Optional[int] = None) -> dict:
    """Simulate one serving point; the same tables and summary as a real run's serve(). The
    devices come from cfg.sim; `profile`, a loaded measured profile, stands for sim.profile."""
    started = time.perf_counter()
    sim = Simulation(cfg, profile, num_devices)
    sim.run()
    loop_s = time.perf_counter() - started
    requests, steps, transfers = requests_steps_transfers(sim.log, sim.steps, sim.transfers)
    summary = summarize(requests, steps, transfers, slo=cfg.slo, metrics=cfg.metrics, num_gpus=len(sim.plans),
                        tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo))
    summary["kv_blocks_leaked"] = {f"worker{w.rank}": w.block_manager.num_used_blocks for w in sim.workers}
    summary["workers"] = {f"worker{p.rank}": {"role": p.role, "device": p.device, "alive_at_end": True}
                          for p in sim.plans}
    summary["workload_report"] = sim.workload.report
    summary["executor"] = "sim"
    summary["sim"] = {"events": sim.num_events, "loop_s": loop_s, "unfinished": len(sim.active),
                      "profile": sim.roles[0].label,  # the first worker's (P's in disagg)
                      "profiles": {role: r.label for role, r in sim.profiles.items()}}
    wall = time.perf_counter() - started
    return {"requests": requests, "steps": steps, "transfers": transfers, "summary": summary,
            "events_per_s": sim.num_events / loop_s if loop_s > 0 else float("inf"), "wall_s": wall}
