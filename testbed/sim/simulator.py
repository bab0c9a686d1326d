"""Discrete-event simulation of the serving cluster: simulate(cfg) -> the tables of a run.

The router's control plane on a virtual clock: the same request book (testbed/control/book.py)
and, in each `SimWorker`, the same hand-off ledger, Scheduler and BlockManager, with the forward
pass replaced by its role's step time (testbed/sim/devices.py: a measured profile or an
analytical GPU). Open-loop arrivals; closed-loop session turns and users (testbed/workload/
closed_loop.py), whose next request arrives a think time after the last one's end reached the
router. A KV transfer takes `transfer_time(bytes)` of the slower link of its two ends (or,
between workers on different nodes of hardware.num_nodes, of the network between them), one at
a time per prefill worker, as the connector's mechanism has it (testbed/sim/handoff.py). Events
at one instant are all delivered before idle workers look for their next step, as a real worker
drains its inbox before stepping. The host around the engine (dispatch hop, step
gap, report delay, contention) is drawn as testbed/sim/host.py says; a worker's quiet decode
steps go in one event (testbed/sim/decode_run.py), with the results of stepping one at a time.

Simplifications: granularity=layer moves the KV after the prefill, like granularity=request
(kv_transfer.mechanism=push_layerwise times a push that overlaps the prefill);
workers never die and transfers never fail; a KV send costs the prefill worker no compute.
"""

from __future__ import annotations

import copy
import heapq
import os
from collections import OrderedDict
from typing import Mapping, Optional

from testbed.control.book import RequestBook
from testbed.control.layout import plan_on_devices
from testbed.control.ledger import Outgoing
from testbed.control.request import Tracked, WorkerStep
from testbed.control.transfers import TransferLog
from testbed.engine.kv_store import HashStore, StoreView, store_blocks
from testbed.engine.sequence import check_fits
from testbed.errors import ConfigError
from testbed.metrics.events import RequestLog
from testbed.metrics.steps import StepLog
from testbed.names import KIND_OF, Mode, Role
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.devices import resolve_roles, role_blocks
from testbed.sim.handoff import SimHandoff
from testbed.sim.host import HostSide
from testbed.sim.worker import SAMPLED_TOKEN, SimWorker
from testbed.workload import Request, build_workload
from testbed.workload.config import WorkloadError
from testbed.workload.traces import resolve_trace_path
from testbed.workload.workload import Workload

ARRIVE, DELIVER, STEP_END, KV_SENT, RESUME, RUN_END, FREE, RELEASE, SEND, KV_READY = range(10)


def node_of(plans, num_devices: Optional[int], num_nodes: int) -> list[int]:
    """Each worker's node: the devices split evenly over hardware.num_nodes, in order (P's groups
    first, so with as many nodes as roles P and D sit on different nodes)."""
    if num_nodes <= 1:
        return [0] * len(plans)
    devices = num_devices or max(int(p.device.split(":")[1]) + p.tp for p in plans)
    per_node = max(devices // num_nodes, 1)
    return [int(p.device.split(":")[1]) // per_node for p in plans]


# open-loop workloads built lately, by what builds them: a study runs its configurations on the
# same requests at each rate and seed, and building the prompts cost it a fifth of its time
_BUILT: OrderedDict = OrderedDict()
KEEP_WORKLOADS = 8
KEEP_TOKENS = 4_000_000  # a workload with more prompt tokens than this is built each time (memory)


def workload_for(cfg, seed: int, vocab_size: int, max_model_len: int) -> Workload:
    """build_workload(cfg, ...), the requests of an open loop of single turns shared with the last
    runs that built the same (frozen Requests; a fresh report). Sessions and closed loops, whose
    workloads hold state, are built each time."""
    if cfg.turns > 1 or cfg.concurrency:
        return build_workload(cfg, seed=seed, vocab_size=vocab_size, max_model_len=max_model_len)
    trace = None
    if cfg.path:
        try:
            stat = os.stat(path := resolve_trace_path(cfg.path))
        except (WorkloadError, OSError):  # build_workload says what is wrong, in its words
            return build_workload(cfg, seed=seed, vocab_size=vocab_size, max_model_len=max_model_len)
        trace = (str(path), stat.st_mtime_ns, stat.st_size)
    key = (repr(cfg), trace, seed, vocab_size, max_model_len)
    built = _BUILT.get(key)
    if built is None:
        workload = build_workload(cfg, seed=seed, vocab_size=vocab_size, max_model_len=max_model_len)
        if sum(r.input_len for r in workload.requests) <= KEEP_TOKENS:
            _BUILT[key] = (workload.requests, workload.rejected, copy.deepcopy(workload.report), workload._planner)
            while len(_BUILT) > KEEP_WORKLOADS:
                _BUILT.popitem(last=False)
        return workload
    _BUILT.move_to_end(key)
    requests, rejected, report, planner = built
    return Workload(list(requests), list(rejected), copy.deepcopy(report), planner)


class Simulation:
    def __init__(
        self, cfg: Serving, sim: SimConfig, profile: Optional[Mapping] = None, num_devices: Optional[int] = None
    ):
        cfg.validate()
        self.args = cfg.model.args()
        available = num_devices if num_devices is not None else cfg.hardware.num_devices
        self.plans = plan_on_devices(
            cfg.mode, cfg.cluster, "sim", available, f"the simulation was given num_devices={available}"
        )
        self.profiles = resolve_roles(cfg, sim, {KIND_OF[p.role] for p in self.plans}, profile)
        self.roles = [self.profiles[KIND_OF[p.role]] for p in self.plans]  # by rank
        self.nodes = node_of(self.plans, available, cfg.hardware.num_nodes)
        self.handoff = SimHandoff(cfg, self.roles, self.nodes, self.args.num_layers)
        self.prefill_s: dict[tuple[int, int], float] = {}  # (P, request): its last prefill step (a push overlaps it)
        self.kv_bytes_per_token = self.args.kv_bytes_per_token * next(iter(self.profiles.values())).dtype_bytes
        blocks = role_blocks(cfg, self.profiles)
        block_bytes = self.kv_bytes_per_token * cfg.engine.block_size
        slots = store_blocks(cfg.kv_store.capacity_mib, block_bytes)  # 0 (off, or not one block): as the real run
        store = HashStore(slots) if slots > 0 else None
        self.workers = [
            SimWorker(
                p.rank,
                p.role,
                blocks[KIND_OF[p.role]],
                cfg.engine,
                cfg.scheduler,
                cfg.kv_transfer,
                cfg.kv_store,
                sim,
                cfg.follows_caches,
                StoreView(store, block_bytes) if store else None,
            )
            for p in self.plans
        ]
        if sim.num_scheduler_steps > 1 and cfg.mode == Mode.DISAGG:
            raise ConfigError(
                "sim.num_scheduler_steps > 1 (multi-step scheduling) is modelled for mixed workers "
                "(mode=colocated or chunked), not mode=disagg"
            )
        self.workload = workload_for(cfg.workload, cfg.seed, self.args.vocab_size, self.args.max_model_len)
        self.log = RequestLog(0.0)
        self.book = RequestBook(
            cfg.cluster,
            cfg.kv_transfer,
            cfg.mode == Mode.DISAGG,
            {p.rank: p.role for p in self.plans},
            self.log,
            cfg.engine.block_size,
            cfg.workload.tenants,
        )
        measured = [r.measured for r in self.roles]
        self.host = HostSide.of(sim.host_model(next(filter(None, measured), None)), measured, cfg.seed)
        # quiet decode steps in one event (testbed/sim/decode_run.py); not where the router follows
        # the caches, whose changes each step reports, nor with a store, which each step fills
        # nor under multi-step scheduling, whose windows step one at a time
        self.runs = sim.decode_runs and not cfg.follows_caches and store is None and sim.num_scheduler_steps == 1
        self.frontend_s = sim.frontend_s(analytical=all(r.measured is None for r in self.roles))
        self.paused: set[int] = set()  # workers in their gap between steps
        self.handing_off: set[tuple[int, int]] = set()  # (P, request): KV sends waiting out their hand-off
        self.queue: list = []
        self.counter = 0
        self.now = 0.0
        self.dirty: set[int] = set()
        self.steps = StepLog()
        self.transfers = TransferLog(0.0)
        self.num_events = 0

    # -- the event loop --------------------------------------------------------------------------
    def push(self, t: float, kind: int, payload) -> None:
        self.counter += 1  # ties break in push order: the same seed gives the same run
        heapq.heappush(self.queue, (t, self.counter, kind, payload))

    def run(self) -> None:
        self.book.reject_workload(self.workload.rejected)
        for request in self.workload.initial():  # open loop: all; closed loop: each user's first
            self.push(request.arrival_s, ARRIVE, request)
        # a local, not an attribute: bound methods held by the simulation would make it a cycle,
        # freed only by a full collection over its millions of objects
        handlers = {
            ARRIVE: self._arrive,
            DELIVER: self._deliver,
            STEP_END: self._step_end,
            KV_SENT: self._kv_sent,
            RESUME: self._resume,
            RUN_END: self._run_end,
            FREE: self._free,
            RELEASE: self._release,
            SEND: self._handed_off,
            KV_READY: self._kv_ready,
        }
        queue = self.queue
        while queue:
            self.now, _, kind, payload = heapq.heappop(queue)
            handlers[kind](payload)
            self.num_events += 1
            if self.dirty and (not queue or queue[0][0] > self.now):
                self._wake()
        self.book.flush_open()  # stuck requests are recorded as unfinished with the tokens they got

    def _wake(self) -> None:
        """Idle workers with news look for their next step (D first reserves what it can)."""
        ranks, self.dirty = sorted(self.dirty), set()
        decode_only = Role.DECODE_ONLY  # a local: a member read off its class costs more than the compare
        for rank in ranks:
            worker = self.workers[rank]
            if worker.role == decode_only and worker.receiver.queued:  # none queued: none to admit
                for entry in worker.admit(self.now):
                    sender = self.workers[entry.prefill_rank]
                    self._send_when_ready(
                        sender.rank, sender.ready(entry.seq.seq_id, rank, self.now, entry.seq.num_cached_tokens)
                    )
            if rank not in self.paused and worker.can_step():
                self._start(rank, worker)

    def _start(self, rank: int, worker: SimWorker) -> None:
        cost, draws, scales = self.roles[rank].cost, self.host.draws[rank], self.host.scales[rank]
        run = worker.start_run(self.now, cost, scales[0], self.host.model, draws) if self.runs else None
        if run is not None:
            self.push(run.end, RUN_END, (rank, run))
            for i, free in run.free_changes(worker.block_manager.num_blocks, self.book.free_blocks(rank)):
                self.push(run.ends[i], FREE, (rank, run, i, free))
            return
        after_prefill = worker.after_prefill  # the last step prefilled: this one runs on cold caches
        duration = worker.start_step(self.now, cost)
        if duration is not None:
            scale = scales[1] if worker.shape.prefill_tokens > 0 else scales[2] if after_prefill else scales[0]
            self.push(self.now + duration * draws.contention(scale), STEP_END, rank)

    def _resume(self, rank: int) -> None:
        self.paused.discard(rank)
        self.dirty.add(rank)

    # -- admission and dispatch --------------------------------------------------------------------
    def _arrive(self, request: Request) -> None:
        """The request's arrival: the router lets it in after its lateness (in-situ: measured)."""
        late = self.host.router.sample(self.host.model.release)
        if late > 0:
            self.push(self.now + late, RELEASE, request)
        else:
            self._release(request)

    def _release(self, request: Request) -> None:
        tracked = self.book.admit(request, self.now)
        if tracked is None:  # refused: a closed loop's user sends its next request
            self._follow(self.workload.ended(request, self.now))
            return
        check_fits(request.input_len, request.output_len, self.args.max_model_len)  # as Engine.add refuses it
        delay = self.host.router.sample(self.host.model.dispatch) + self.frontend_s
        if delay > 0:
            self.push(self.now + delay, DELIVER, tracked)
        else:
            self._deliver(tracked)

    def _deliver(self, tracked: Tracked) -> None:
        """The request reaches its worker (and, bound early, its decode worker's reservation)."""
        self.book.deliver(tracked, self._reserve, self._serve, lambda: self.now)

    def _serve(self, tracked: Tracked) -> None:
        self._interrupt(tracked.worker)
        self.workers[tracked.worker].serve(tracked.request, tracked.decode_worker)
        self.dirty.add(tracked.worker)

    def _reserve(self, tracked: Tracked) -> None:
        self._interrupt(tracked.decode_worker)
        self.workers[tracked.decode_worker].reserve(tracked.request, tracked.worker)
        self.dirty.add(tracked.decode_worker)

    # -- steps -------------------------------------------------------------------------------------
    def _step_end(self, rank: int) -> None:
        worker, now, draws = self.workers[rank], self.now, self.host.draws[rank]
        result, record = worker.finish_step(now)
        self.steps.add(rank, record)
        cached = worker.block_manager.drain_changes() if self.book.index is not None else None  # before the hand-offs
        for seq in result.handoff:
            if self.handoff.rule.layerwise:
                self.prefill_s[(rank, seq.seq_id)] = now - record.start
            self._send_when_ready(rank, worker.handoff(seq, now))
        worker.deferred.append(
            WorkerStep(rank, record.start, now, worker.block_manager.num_free_blocks, result.by_id(), cached)
        )
        if not worker.window_open():  # a multi-step window's tokens leave together at its end
            model = self.host.model
            received = now + draws.sample(model.first_report if worker.first_token else model.report)
            steps, worker.deferred = worker.deferred, []
            for step in steps:
                self._report(step, received)
        self._pause(rank, now + draws.gap(self.host.model.gap_after(worker.shape.prefill_tokens > 0)))

    def _report(self, step: WorkerStep, received: float) -> None:
        for tracked in self.book.step_report(step, received, self._reserve):
            self._follow(self.workload.next_turn(tracked.request, tracked.output, received))  # its end, as recorded

    def _follow(self, follow_up: Optional[Request]) -> None:
        """A session's next turn or a closed loop's next request arrives at its time."""
        if follow_up is not None:
            self.push(follow_up.arrival_s, ARRIVE, follow_up)

    def _pause(self, rank: int, resume_at: float) -> None:
        if resume_at > self.now:  # the worker reports, reads its inbox and polls its KV before its next step
            self.paused.add(rank)
            self.push(resume_at, RESUME, rank)
        self.dirty.add(rank)

    # -- decode runs (a run's end, or a message to its worker, cuts it) ---------------------------
    def _run_end(self, payload: tuple) -> None:
        if self.workers[payload[0]].run is payload[1]:  # else a message cut it already
            self._interrupt(payload[0])

    def _free(self, payload: tuple) -> None:
        rank, run, step, free = payload
        if step < run.valid:  # a step of the run that stands: its report's free blocks
            self.book.report_free(rank, free)

    def _interrupt(self, rank: int) -> None:
        worker = self.workers[rank]
        if worker.run is None:
            return
        run, done, in_flight = worker.end_run(self.now, self.host.draws[rank])
        if done:  # a run cut before its first step ended records and reports nothing
            num_blocks = worker.block_manager.num_blocks
            self.steps.add_many(rank, done, **run.step_fields(done, worker.role, num_blocks))
            self.book.on_run(rank, run.quiet.seqs, run.report(done, num_blocks), SAMPLED_TOKEN)
        if in_flight and run.ends[done] == self.now:  # the run's finishing step ends now
            self._step_end(rank)
        elif in_flight:
            self.push(run.ends[done], STEP_END, rank)
        elif done:
            self._pause(rank, run.ends[done - 1] + run.gaps[done - 1])
        else:
            self.dirty.add(rank)

    # -- KV transfer ---------------------------------------------------------------------------------
    def _send_when_ready(self, rank: int, entry: Optional[Outgoing]) -> None:
        if entry is None or not entry.sendable or entry.start is not None:
            return
        key = (rank, entry.seq.seq_id)
        if key in self.handing_off:
            return
        # bind, Reserve, Ready, P between its steps: the send waits that long, the link does not
        wait = self.host.draws[rank].sample(self.host.model.handoff) if self.handoff.waits_for_host else 0.0
        if wait > 0:
            self.handing_off.add(key)
            self.push(self.now + wait, SEND, (rank, entry))
        else:
            self._send(rank, entry)

    def _handed_off(self, payload: tuple) -> None:
        rank, entry = payload
        self.handing_off.discard((rank, entry.seq.seq_id))
        if entry.sendable and entry.start is None:
            self._send(rank, entry)

    def _send(self, rank: int, entry: Outgoing) -> None:
        worker, rid = self.workers[rank], entry.seq.seq_id
        slot = self.handoff.slot(
            rank,
            entry.decode_rank,
            self._kv_bytes(entry),
            entry.seq.num_prompt_tokens - entry.skip,
            self.now,
            worker.link_free_at,
            self.host.draws[rank].sample(self.host.transfer_scales[rank]),  # both ends' contention
            entry.handoff_t,
            self.prefill_s.pop((rank, rid), 0.0),
            entry.ready_t,
        )
        self.push(worker.hold_link(entry, slot.start, slot.end), KV_SENT, (rank, rid))

    def _kv_bytes(self, entry: Outgoing) -> int:
        return (entry.seq.num_prompt_tokens - entry.skip) * self.kv_bytes_per_token

    def _kv_sent(self, payload: tuple[int, int]) -> None:
        rank, rid = payload
        entry = self.workers[rank].sent(rid)
        decode, now, nbytes = entry.decode_rank, self.now, self._kv_bytes(entry)
        self.transfers.sent(rid, rank, decode, entry.attempt, nbytes, entry.start, now, entry.wait_s)
        self.book.kv_sent(rid, rank, decode, entry.start, nbytes, moved=True)
        self.dirty.add(rank)
        ready = (rank, decode, rid, entry.attempt)
        path = self.handoff.rule.first_token_path_s
        if path > 0:  # D's own path from the KV landing to its first decode (the transfer's end_s)
            self.push(now + path, KV_READY, ready)
        else:
            self._kv_ready(ready)

    def _kv_ready(self, payload: tuple[int, int, int, int]) -> None:
        rank, decode, rid, attempt = payload
        self.transfers.arrived(rid, rank, decode, attempt, self.now)
        self._interrupt(decode)  # before the install: D's steps until now ran without it
        self.workers[decode].install(rid)
        self.book.kv_arrived(rid, decode, self.now)
        self.dirty.add(decode)
