"""The request book: the control plane's per-request state, with no clock and no I/O.

The router (testbed/cluster/router.py) and the simulator (testbed/sim/simulator.py) are thin
drivers over it: they turn worker messages or simulated events into calls here, stamp the
times, and do the sending. The book admits or refuses, picks workers (Dispatcher), keeps each
worker's load, binds decode workers, hands the client its tokens in order across P and D, and
writes every lifecycle event to the RequestLog: one set of rules for real and simulated runs.
Each tracked request's two sides are small state machines (testbed/control/request.py);
every change goes through `_front` / `_back`, which refuse an edge not drawn there and keep
the loads in step.
"""

from __future__ import annotations

from typing import Callable, Optional

from testbed.control.dispatch import Dispatcher, WorkerLoad, admission_refusal
from testbed.control.kv_index import KVIndex
from testbed.control.limits import Routes, TenantLimits
from testbed.control.request import BACK_EDGES, FRONT_EDGES, Back, Front, RunReport, StepNews, Tracked, WorkerStep
from testbed.engine.prefix import prompt_hashes
from testbed.engine.scheduler import StepReport
from testbed.errors import StateError
from testbed.metrics.events import Event, RequestLog
from testbed.names import KIND_OF, Binding, Role
from testbed.workload import Request


def follows_caches(cluster, kv, disagg: bool) -> bool:
    """Routing asks where prompts are cached (KV-aware dispatch, PPD, prefill on D): the workers
    report their prefix-cache changes and the request book keeps an index of them."""
    return cluster.kv_aware or (disagg and kv.follows_caches)


class RequestBook:
    def __init__(
        self, cluster, kv, disagg: bool, roles: dict[int, Role], log: RequestLog, block_size: int = 16, tenants=()
    ):
        self.cluster, self.kv, self.disagg, self.log = cluster, kv, disagg, log
        # decided once: a step report asks for late binding on every call
        self.binds_early = disagg and kv.decode_binding == Binding.EARLY
        self.binds_late = disagg and kv.decode_binding == Binding.LATE
        self.loads = {rank: WorkerLoad() for rank in roles}
        self.roles = roles
        # where the prompt blocks are, from the workers' reports: only cache-following rules ask
        self.index = KVIndex(block_size, roles) if follows_caches(cluster, kv, disagg) else None
        weight = cluster.kv_aware_load_weight
        self.front = Dispatcher(
            cluster.dispatch,
            [r for r, role in roles.items() if role != Role.DECODE_ONLY],
            self.loads,
            index=self.index,
            load_weight=weight,
        )
        self.back = Dispatcher(
            cluster.decode_dispatch,
            [r for r, role in roles.items() if role == Role.DECODE_ONLY],
            self.loads,
            for_decode=True,
            index=self.index,
            load_weight=weight,
        )
        self.active: dict[int, Tracked] = {}
        self.limits = TenantLimits(tenants)
        self.routes = Routes(cluster, tenants, self.front.workers)

    def __len__(self) -> int:
        return len(self.active)

    def get(self, rid: int) -> Optional[Tracked]:
        return self.active.get(rid)

    # -- admission and binding -------------------------------------------------------------
    def admit(self, request: Request, t: float) -> Optional[Tracked]:
        """Admit and dispatch a request (bound early to its decode worker when so configured),
        or refuse it: None."""
        self.log.register(request)
        reason = admission_refusal(self.cluster, request, len(self.active)) or self.limits.refusal(
            request.tenant, request.input_len, t
        )
        worker = None if reason else self._route(request)
        if worker is None:
            if not reason:  # admitted by its tenant's limit, but nowhere to go: not charged
                self.limits.refund(request.tenant, request.input_len)
            self.log.reject(request, t, reason or "no live worker to serve it")
            return None
        tracked = Tracked(request, worker, local=self.disagg and self.roles[worker] == Role.DECODE_ONLY)
        self.active[request.request_id] = tracked
        self._count_front(tracked)
        self.log.event(request.request_id, Event.DISPATCHED, t, worker=worker)
        self.log.prefilled_on(request.request_id, KIND_OF[self.roles[worker]])
        if self.binds_early and not tracked.local:
            self.bind_decode(tracked)
        return tracked

    def _route(self, request: Request) -> Optional[int]:
        """Its decode worker when that one prefills it itself, else a front worker of its route."""
        local = self._local_decode(request)
        if local is not None:
            return local
        return self.front.pick(request, self.routes.allowed(request.tenant, request.input_len))

    def _local_decode(self, request: Request) -> Optional[int]:
        """The decode worker that prefills the request itself (the one whose cache holds most of
        the prompt, then the least loaded), when the hand-off rules say so; else None: P."""
        live = self.back.live() if self.disagg and self.index is not None else []
        if not live:
            return None
        hashes = prompt_hashes(request.prompt_token_ids, self.index.block_size)
        cached, _, worker = max((self.index.cached_tokens(w, hashes), -self.loads[w].bound_sequences, -w) for w in live)
        if self.kv.prefills_on_decode(request.turn, request.input_len, cached):
            return -worker
        return None

    def reject_workload(self, rejected, t0: float = 0.0) -> None:
        """The workload's own refusals ((request, reason) pairs), each at its arrival time."""
        for request, reason in rejected:
            self.log.reject(request, t0 + request.arrival_s, reason, by="workload")

    def queued(self, tracked: Tracked, t: float) -> None:
        """The request reached its worker's queue."""
        self.log.event(tracked.rid, Event.PREFILL_QUEUED, t, worker=tracked.worker)

    def deliver(
        self,
        tracked: Tracked,
        reserve: Callable[[Tracked], None],
        serve: Callable[[Tracked], None],
        clock: Callable[[], float],
    ) -> None:
        """An admitted request goes to its workers, in the order every executor keeps: bound early,
        its decode worker reserves first (D holds the blocks while P queues the prefill), then its
        worker gets it; queued at `clock()` once it has."""
        if tracked.decode_worker is not None:
            reserve(tracked)
        serve(tracked)
        self.queued(tracked, clock())

    def bind_decode(self, tracked: Tracked) -> Optional[int]:
        """Pick the decode worker for the request's KV (None: it ends on P, or none is alive)."""
        worker = self.back.bind(tracked.request)
        if worker is not None:
            tracked.decode_worker = worker
            self._back(tracked, Back.BOUND)
        return worker

    # -- step reports ----------------------------------------------------------------------
    def on_step(self, step: WorkerStep, received_t: float) -> StepNews:
        """One step of a worker (its tokens stamped on the worker and, `received_t`, on receipt)."""
        news = StepNews()
        worker, start, worker_t, report = step.worker, step.start, step.end, step.report
        self.loads[worker].free_blocks = step.free_blocks
        active = self.active  # the loops below run once per sequence per step: locals, no calls
        for rid, _, was_prefill in report.scheduled:
            if was_prefill:
                self.log.event(rid, Event.PREFILL_START, start, worker=worker)
                self.log.event(rid, Event.PREFILL_CHUNK, start, worker=worker)
                continue
            tracked = active.get(rid)
            if tracked is not None and not tracked.decode_started:  # later decode steps change nothing
                tracked.decode_started = True
                self.log.event(rid, Event.DECODE_START, start, worker=worker)
        for rid, index, token in report.tokens:
            tracked = active.get(rid)
            if (
                tracked is not None
                and index == len(tracked.output)
                and index
                and tracked.front is not Front.QUEUED
                and not tracked.early
                and not tracked.finished_early
            ):  # _in_order, inlined: the common case
                tracked.output.append(token)
                tracked.worker_times.append(worker_t)
                tracked.received_times.append(received_t)
            elif tracked is not None:
                self._token(tracked, index, token, worker, worker_t, received_t, news)
        if self.binds_late:
            for rid in report.handoff:
                tracked = self.active.get(rid)
                if tracked is not None and tracked.back is Back.NONE and self.bind_decode(tracked) is not None:
                    news.bound.append(tracked)
        for rid in report.finished:
            tracked = self.active.get(rid)
            if tracked is not None and len(tracked.output) < tracked.request.output_len:
                tracked.finished_early = True  # D's report overtook P's tokens: wait for them
            elif tracked is not None:
                news.finished.append(self.finish(rid, received_t))
        return news

    def on_run(self, worker: int, seqs, run: RunReport, token: int) -> None:
        """Quiet decode steps of `worker` reported at once (the simulator's decode runs): each
        of `seqs`, (rid, output tokens it had), got `token` a step and none finished. As on_step,
        step by step."""
        if not run.starts:
            return
        found = [self.active.get(rid) for rid, _ in seqs]
        if not all(tracked is not None and _in_order(tracked, had) for tracked, (_, had) in zip(found, seqs)):
            for i, start in enumerate(run.starts):  # out of order somewhere: the general path
                report = StepReport(
                    [(rid, 1, False) for rid, _ in seqs], [(rid, had + i, token) for rid, had in seqs], [], [], []
                )
                self.on_step(WorkerStep(worker, start, run.ends[i], run.free_blocks[i], report), run.received[i])
            return
        self.report_free(worker, run.free_blocks[-1])
        tokens = [token] * len(run.starts)
        for tracked in found:
            if not tracked.decode_started:
                tracked.decode_started = True
                self.log.event(tracked.rid, Event.DECODE_START, run.starts[0], worker=worker)
            tracked.output.extend(tokens)
            tracked.worker_times.extend(run.ends)
            tracked.received_times.extend(run.received)

    def report_free(self, worker: int, free_blocks: int) -> None:
        """A step's report of the worker's free KV blocks (decode dispatch breaks ties on them)."""
        self.loads[worker].free_blocks = free_blocks

    def step_report(self, step: WorkerStep, received_t: float, reserve: Callable[[Tracked], None]) -> list[Tracked]:
        """A worker's step report, received at `received_t`, taken in the order every executor keeps:
        its prefix-cache changes and hits, then the step itself; a decode worker bound by it reserves
        (`reserve`). Returns the requests that finished."""
        if step.cached is not None:
            self.cache_report(step.worker, *step.cached)
        self.prefix_hits(step.report.hits)
        news = self.on_step(step, received_t)
        for tracked in news.bound:
            reserve(tracked)
        return news.finished

    def prefix_hits(self, hits) -> None:
        """(rid, prompt tokens found cached) of the requests whose first prefill ran this step."""
        for rid, tokens in hits:
            self.log.prefix_hit(rid, tokens)

    def cache_report(self, worker: int, stored: list[int], removed: list[int]) -> None:
        """A step's changes to the worker's prefix cache (block hashes registered, evicted)."""
        if self.index is not None:
            self.index.update(worker, stored, removed)

    def free_blocks(self, worker: int) -> int:
        """The worker's free KV blocks as its last report had them."""
        return self.loads[worker].free_blocks

    def _token(
        self, tracked: Tracked, index: int, token: int, worker: int, worker_t: float, received_t: float, news: StepNews
    ) -> None:
        if index < len(tracked.output):
            return  # a recomputed prefix re-emitting tokens the client already has
        if tracked.front is Front.QUEUED and worker == tracked.worker:
            self._front(tracked, Front.PREFILLED)
        self._reorder(tracked, index, token, worker, worker_t, received_t)
        if tracked.finished_early and len(tracked.output) == tracked.request.output_len:
            news.finished.append(self.finish(tracked.rid, received_t))

    def _reorder(
        self, tracked: Tracked, index: int, token: int, worker: int, worker_t: float, received_t: float
    ) -> None:
        # P's and D's reports may travel on different pipes: D's first decode can overtake P's
        # first token. The client sees tokens in order, so a later one waits for its predecessors.
        tracked.early[index] = (token, worker_t, worker)
        while len(tracked.output) in tracked.early:
            token, at, by = tracked.early.pop(len(tracked.output))
            if not tracked.output:
                self.log.event(tracked.rid, Event.PREFILL_END, at, worker=by)
            tracked.output.append(token)
            tracked.worker_times.append(at)
            tracked.received_times.append(received_t)

    # -- the KV hand-off -------------------------------------------------------------------
    def kv_sent(self, rid: int, prefill: int, decode: int, start: float, kv_bytes: int, moved: bool) -> None:
        """P's sends of an attempt have left (`moved`: data went, not dropped or broken)."""
        tracked = self.active.get(rid)
        # an ended request still logs its transfer's start: P's report travels on P's pipe, and D may
        # have decoded the request to its end first (a loaded P reports late)
        worker = tracked.worker if tracked is not None else self.log.prefill_worker(rid)
        if worker != prefill:
            return  # re-dispatched away from that worker
        if moved:
            self.log.event(
                rid, Event.KV_TRANSFER_START, start, prefill_worker=prefill, decode_worker=decode, kv_bytes=kv_bytes
            )
        if tracked is not None and tracked.front is not Front.LEFT:
            self._front(tracked, Front.LEFT)

    def kv_arrived(self, rid: int, decode: int, t: float) -> None:
        tracked = self.active.get(rid)
        if tracked is None or tracked.decode_worker != decode:
            return
        self.log.event(rid, Event.KV_TRANSFER_END, t, decode_worker=decode)
        self.log.event(rid, Event.DECODE_QUEUED, t, worker=decode)
        self._back(tracked, Back.HOLDS)

    def decode_recomputes(self, rid: int, decode: int) -> None:
        """D gave up on the KV and prefills the request itself: late, not lost."""
        tracked = self.active.get(rid)
        if tracked is not None and tracked.decode_worker == decode and tracked.back is Back.BOUND:
            self._back(tracked, Back.HOLDS)

    def involves(self, rid: int, worker: int) -> Optional[Tracked]:
        """The request, if it is open and `worker` is one of its two workers."""
        tracked = self.active.get(rid)
        return tracked if tracked is not None and worker in (tracked.worker, tracked.decode_worker) else None

    # -- endings ---------------------------------------------------------------------------
    def finish(self, rid: int, t: float) -> Optional[Tracked]:
        tracked = self._close(rid)
        if tracked is not None:
            self.log.finish(rid, t)
        return tracked

    def fail(self, rid: int, t: float, reason: str) -> Optional[Tracked]:
        """Close the request as failed; the driver aborts it on the workers it names."""
        tracked = self._close(rid)
        if tracked is not None:
            self.log.fail(rid, t, reason)
        return tracked

    def _close(self, rid: int) -> Optional[Tracked]:
        tracked = self.active.pop(rid, None)
        if tracked is not None:
            self.log.token_series(rid, tracked.output, tracked.worker_times, tracked.received_times)
            self._unbind(tracked)
        return tracked

    def flush_open(self) -> None:
        """End of a run with requests still open: they keep the tokens they got (unfinished)."""
        for tracked in self.active.values():
            self.log.token_series(tracked.rid, tracked.output, tracked.worker_times, tracked.received_times)

    # -- lost workers ----------------------------------------------------------------------
    def lose_worker(self, rank: int) -> list[int]:
        """Mark a worker dead; the open requests that needed it."""
        self.loads[rank].alive = False
        if self.index is not None:
            self.index.forget(rank)
        return [rid for rid, tracked in self.active.items() if self.depends_on(tracked, rank)]

    def depends_on(self, tracked: Tracked, rank: int) -> bool:
        """Its decode worker, and its prefill worker until the KV has left (or, where P keeps
        the KV for resends, until D holds the request)."""
        if tracked.decode_worker == rank:
            return True
        resendable = self.kv.failure_policy().holds_until_ack and tracked.back is not Back.HOLDS
        return tracked.worker == rank and (tracked.front is not Front.LEFT or resendable)

    def redispatch(self, rid: int) -> Optional[tuple[Tracked, list[int]]]:
        """Start the request over on live workers: (it, the old workers still alive to abort it
        on), or None when no worker can take it. The client keeps the tokens it has."""
        tracked = self.active[rid]
        request = tracked.request
        worker = self.front.pick(request, self.routes.allowed(request.tenant, request.input_len))
        if worker is None:
            return None
        old = [w for w in (tracked.worker, tracked.decode_worker) if w is not None and self.loads[w].alive]
        self._unbind(tracked)
        tracked.worker = worker
        tracked.decode_started = False
        tracked.local = False  # over again through a front worker
        self.log.prefilled_on(rid, KIND_OF[self.roles[worker]])
        self._front(tracked, Front.QUEUED)
        if self.binds_early:
            self.bind_decode(tracked)
        return tracked, old

    # -- the two state machines, and the loads they carry -----------------------------------
    def _unbind(self, tracked: Tracked) -> None:
        if tracked.front is not Front.LEFT:
            self._front(tracked, Front.LEFT)
        if tracked.back is not Back.NONE:
            self._back(tracked, Back.NONE)

    def _front(self, tracked: Tracked, new: Front) -> None:
        old = tracked.front
        if new not in FRONT_EDGES[old]:
            raise StateError(f"request {tracked.rid}: front {old.name} -> {new.name} is not an edge")
        load = self.loads[tracked.worker]
        if old is Front.QUEUED:
            load.queued_prompt_tokens -= tracked.request.input_len
        if new is Front.LEFT:
            load.bound_sequences -= 1
            if tracked.local:  # prefilled on a decode worker: its prompt's KV stays there
                load.bound_tokens -= tracked.request.input_len
        if new is Front.QUEUED:
            self._count_front(tracked)
        tracked.front = new

    def _count_front(self, tracked: Tracked) -> None:
        """A request joins its front worker: its prompt queues there and it is bound to it."""
        load = self.loads[tracked.worker]
        load.queued_prompt_tokens += tracked.request.input_len
        load.bound_sequences += 1
        if tracked.local:
            load.bound_tokens += tracked.request.input_len

    def _back(self, tracked: Tracked, new: Back) -> None:
        old = tracked.back
        if new not in BACK_EDGES[old]:
            raise StateError(f"request {tracked.rid}: back {old.name} -> {new.name} is not an edge")
        if new is Back.NONE:
            load = self.loads[tracked.decode_worker]
            load.bound_sequences -= 1
            load.bound_tokens -= tracked.request.input_len
            tracked.decode_worker = None
        tracked.back = new


def _in_order(tracked: Tracked, index: int) -> bool:
    """Token `index` (not the first) is the next one the client waits for, with nothing held
    back: it goes straight to the client."""
    return (
        index == len(tracked.output)
        and index > 0
        and tracked.front is not Front.QUEUED
        and not tracked.early
        and not tracked.finished_early
    )
