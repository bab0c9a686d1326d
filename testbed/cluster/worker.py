"""A worker process: one engine pinned to one device, driven by its inbox.

    loop: read the inbox -> move KV (connector) -> engine.step() -> report the step to the router

Roles: `colocated` / `chunked` (mixed), `prefill_only` (P: sends KV), `decode_only` (D: receives KV).
On an emulated device (hardware.emulate) each step is held to its modelled time before it is
reported, and P's KV hand-offs to the modelled link time (testbed/cluster/pacing.py).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from testbed.cluster.connector import KVSender
from testbed.cluster.emulation import Emulation, role_pacers
from testbed.cluster.follower import Follower
from testbed.cluster.kv_ipc import PoolHandle, export_pool, release, shared_pool
from testbed.cluster.pacing import hold
from testbed.cluster.receiver import KVReceiver
from testbed.cluster.tensor_group import Groups, Halt, Mirror, export_to_prefill, new_groups, prefill_processes
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence, StepResult
from testbed.errors import PeerLost, TestbedError
from testbed.model.config import ModelConfig
from testbed.model.tensor_parallel import shard_model
from testbed.names import KIND_OF, Granularity, Kind, Role
from testbed.net.faults import FaultsConfig, KVFaults, Stall
from testbed.net.messages import (
    Abort,
    Audit,
    Heartbeat,
    KVAck,
    KVBegin,
    KVDone,
    KVFence,
    KVPart,
    KVPoolAttached,
    KVPoolExport,
    Ping,
    Pong,
    Ready,
    Reserve,
    Serve,
    Started,
    StepEvents,
    Stop,
    WorkerError,
)
from testbed.net.rendezvous import store_client

GIL_SWITCH_S = 0.0002
WATCH_S = 0.2  # how often a worker under torchrun checks that the router is still there
IDLE_WAIT_S = 0.002  # inbox wait when there is nothing to step; short so KV polling stays prompt
# at the end of a run, how long P waits for acknowledgements already on their way (well inside
# the launcher's wait for every audit, STOP_TIMEOUT_S)
ACK_WAIT_S = 10.0


class RouterLost(PeerLost):
    """Under torchrun: the connection to rank 0's router dropped."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's place in the run, and the configs it reads, whole (a new knob is read off them
    where it is used: nothing is copied here)."""

    rank: int
    world_size: int
    role: Role  # scheduler policy
    device: str  # "cpu" or "cuda:i"
    port: int
    model: ModelConfig
    engine: EngineConfig
    scheduler: SchedulerConfig
    kv: KVTransferConfig
    cluster: ClusterConfig  # heartbeat_s, start_timeout_s
    faults: FaultsConfig  # the KV faults P injects
    seed: int  # the run's
    emulation: Optional[Emulation] = None  # pace steps and KV sends to an emulated device
    cpu_core: Optional[int] = None  # CPU workers: the core this worker is pinned to (None: not pinned)
    report_cache: bool = False  # step reports carry prefix-cache changes (KV-aware dispatch)
    kv_store: Optional[object] = None  # the run's shared KV store (testbed/engine/host_store.py)
    # under torchrun: (store host, store port, key prefix of this point) of the rendezvous store the
    # process group forms through; None: the single-box launcher's tcp://127.0.0.1:port
    rendezvous: Optional[tuple] = None
    host: str = ""  # where the worker runs (meta.json's hosts and links)
    node: int = 0
    roles: tuple = ()  # every process rank's role: P and D warm their links up before the run's clock starts
    groups: Optional[Groups] = None  # tensor-parallel workers' processes (None: one process per worker)


def worker_main(spec: WorkerSpec, inboxes, events, lost_router=lambda: False) -> None:
    """Process entry point. Ctrl-C reaches the whole process group: the driver alone handles it.
    `lost_router()` turns true when the router's host is gone (under torchrun): the worker stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a queue's feeder thread (KV headers, Ready) must not wait out the default 5 ms GIL interval
    # behind a step
    sys.setswitchinterval(GIL_SWITCH_S)
    pool = None
    try:
        engine, group = _setup(spec)
        pool = _export_pool(spec, engine)
        leader = _leader(spec)
        events.put(
            Started(
                worker=spec.rank,
                role=spec.role,
                device=spec.device,
                num_blocks=engine.runner.num_blocks,
                pid=os.getpid(),
                host=spec.host or socket.gethostname(),
                node=spec.node,
                attention_backend=engine.runner.backend.name,
            )
        )
        with torch.inference_mode():  # one mode for every tensor the worker touches, KV buffers included
            if spec.rank == leader:
                Worker(spec, engine, inboxes, events, lost_router, pool, group).loop()
            else:
                Follower(spec, engine, inboxes, events, pool, group).loop()
    except RouterLost:
        raise  # nobody left to report to: the rank's own process says it
    except PeerLost as lost:  # another worker stopped taking messages: the router fails the run
        _tell(events, WorkerError(_leader(spec), str(lost)))
    except TestbedError as error:  # bad input found where the engine is built: still one line
        _tell(events, WorkerError(_leader(spec), str(error), bad_input=True))
    except Exception:  # noqa: BLE001 - the driver reports it and shuts the run down
        _tell(events, WorkerError(_leader(spec), traceback.format_exc()))
    finally:
        release(pool)
        if dist.is_initialized():
            dist.destroy_process_group()


def _tell(events, error: WorkerError) -> None:
    """The worker's error, to a router that may be gone: another worker's error ended the run
    first (the same bad input found by every worker), and a traceback of the closed pipe here
    would bury the one line the router printed."""
    try:
        events.put(error)
    except (OSError, EOFError):
        pass


def _leader(spec: WorkerSpec) -> int:
    """The worker this process is a rank of (its own rank for a leader): errors name it."""
    return spec.rank if spec.groups is None else spec.groups.place(spec.rank)[0]


def _export_pool(spec: WorkerSpec, engine: Engine) -> Optional[PoolHandle]:
    """ipc, on a decode worker: the pool P writes into, exported once (on CPU moved into shared
    memory first; the KV in it is the warm-up's, which no request reads)."""
    if not (spec.kv.direct and spec.role == Role.DECODE_ONLY):
        return None
    runner = engine.runner
    if runner.device.type == "cuda":
        return export_pool(runner.kv_cache)
    pool, handle = shared_pool(tuple(runner.kv_cache.shape), runner.dtype)
    runner.adopt_pool(pool)
    return handle


def _setup(spec: WorkerSpec) -> tuple[Engine, object]:
    """The worker's engine, warmed up, and its tensor-parallel group (None: one process)."""
    # what the fork server imported (torch, the testbed) is long-lived: out of the cyclic
    # collector's sight before start-up, so the collection below walks start-up's objects alone
    # (walking torch's took 150-200 ms of every CPU worker's start on this machine, now 1 ms)
    gc.freeze()
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # all GPUs stay visible: NCCL keeps its NVLink paths
    else:
        torch.set_num_threads(1)
        _pin(spec.cpu_core)
        # the trade between the router's promptness and the workers' share of a busy host:
        # cluster.cpu_worker_nice (testbed/control/config.py)
        os.nice(spec.cluster.cpu_worker_nice)
    # ipc moves no KV over the group, and NCCL cannot pair two ranks on one GPU (P and D may share one)
    _init_group(spec, "nccl" if device.type == "cuda" and not spec.kv.direct else "gloo")
    # a TP group's ranks are on distinct devices: NCCL pairs them even where ipc keeps the world on gloo
    tp_group = new_groups(spec.groups, spec.rank, "nccl" if device.type == "cuda" else None)
    if not spec.kv.direct:
        warm_links(spec.rank, spec.roles, device)
    # model.max_model_len unset: fitted to this pool, which Started reports; the driver says it once
    # for every worker (testbed/cluster/lifecycle.py: fit_to_pools)
    fit = spec.model.max_model_len is None
    if fit:
        logging.getLogger("testbed.engine.model_runner").setLevel(logging.ERROR)
    engine = Engine.build(
        spec.model.args(),
        spec.engine,
        spec.scheduler,
        spec.role,
        device,
        dtype=spec.model.dtype,
        path=spec.model.path,
        seed=spec.model.seed,
        fit_max_model_len=fit,
        shard=_shard(spec, tp_group),
    )
    engine.warmup()
    # what start-up built (the model, torch's modules, the warm-up's tensors) out of the cyclic
    # collector's sight, as vLLM does: else a full collection of it, some 60 requests into a
    # disaggregated run on this machine, holds a tiny model's step for 140 ms
    gc.collect()
    gc.freeze()
    if spec.report_cache and spec.rank == _leader(spec):  # after the warm-up: its prompts are nobody's prefix
        engine.track_cache_changes()
    if spec.kv_store is not None:
        engine.attach_store(spec.kv_store)
    return engine, tp_group


def _shard(spec: WorkerSpec, group):
    """A tensor-parallel rank's model from the full one (each rank builds the same full model from
    its seed or checkpoint, then keeps its shard); None for a worker of one process."""
    if group is None:
        return None
    worker, index = spec.groups.place(spec.rank)
    return lambda full: shard_model(full, index, spec.groups.tp(worker), group)


def _init_group(spec: WorkerSpec, backend: str) -> None:
    timeout = timedelta(seconds=spec.cluster.start_timeout_s)
    if backend == "nccl":
        # the KV transfers fail after kv_transfer.timeout_s on the host (completion.py); the NCCL
        # watchdog, at the group's timeout, then aborts only the communicator, not this process
        # (its default, 3, tears the process down: a lost peer would take the worker with it)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if spec.rendezvous is None:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{spec.port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
        return
    host, port, prefix = spec.rendezvous
    store = store_client(host, port, spec.cluster.start_timeout_s)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{prefix}/group", store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
    )


def warm_links(rank: int, roles: tuple, device: torch.device) -> None:
    """One small message over every P -> D pair, so the run's first KV transfer does not pay the
    link's set-up (NCCL builds a communicator per pair on first use; gloo connects lazily)."""
    pairs = [
        (p, d)
        for p, rp in enumerate(roles)
        if rp == Role.PREFILL_ONLY
        for d, rd in enumerate(roles)
        if rd == Role.DECODE_ONLY
    ]
    probe = torch.zeros(1, device=device)
    pending = [
        dist.isend(probe, dst=d) if rank == p else dist.irecv(torch.zeros(1, device=device), src=p)
        for p, d in pairs
        if rank in (p, d)
    ]
    for work in pending:  # all posted first: no pair waits on another
        work.wait()


def _pin(core: Optional[int]) -> None:
    """Keep a CPU worker on its own core, so workers do not migrate onto each other (Linux only)."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


class Worker:
    def __init__(
        self,
        spec: WorkerSpec,
        engine: Engine,
        inboxes,
        events,
        lost_router=lambda: False,
        pool: Optional[PoolHandle] = None,
        group=None,
    ):
        self.spec, self.inbox, self.events = spec, inboxes[spec.rank], events
        others = spec.groups.ranks[spec.rank][1:] if spec.groups is not None else ()
        # a tensor-parallel worker's other ranks take every call that changes the engine
        self.engine = Mirror(engine, [inboxes[r] for r in others], group) if others else engine
        self.pool = pool  # ipc, D: this worker's exported pool, until every P process has mapped it
        self.unattached = prefill_processes(spec.roles) if pool else set()
        self.lost_router = lost_router
        self.last_watch = time.perf_counter()
        self.sender = self.receiver = None
        if spec.role == Role.PREFILL_ONLY:
            faults = KVFaults(spec.faults, seed=spec.seed * 1000 + spec.rank)
            self.sender = KVSender(self.engine, spec.rank, inboxes, events, spec.kv, faults, groups=spec.groups)
            if spec.kv.granularity == Granularity.LAYER:
                engine.after_layer = self.sender.stream_layer
        if spec.role == Role.DECODE_ONLY:
            self.receiver = KVReceiver(self.engine, spec.rank, inboxes, events, spec.kv, groups=spec.groups)
            if pool is not None:
                export_to_prefill(spec.groups, spec.roles, spec.rank, inboxes, pool)
        self.pacer = self.link = None
        if spec.emulation is not None:
            # the full model's KV per token (every head once), what a hand-off's reported bytes count
            real_kv_bytes = spec.model.args().kv_bytes_per_token * engine.runner.dtype.itemsize
            c = spec.cluster
            tp = c.tp_of(KIND_OF.get(spec.role, Kind.MIXED))
            self.pacer, self.link = role_pacers(
                spec.emulation,
                spec.role,
                spec.model,
                real_kv_bytes,
                spec.kv.backend,
                tp,
                c.decode_tp,
                spec.kv,
                spec.engine.block_size,
            )
            if self.sender is not None:
                self.sender.link = self.link
        self.paced_until: Optional[float] = None  # the last paced step's end while work kept coming
        self.stopping = False
        self.last_report = time.perf_counter()

    def loop(self) -> None:
        while not self.stopping:
            ready = self._can_step()
            if not ready:
                self.paced_until = None  # idle: the next step's pace counts from its own start
            self._drain_inbox(block=not ready)
            self._poll_transfers()
            if self._can_step():
                self._step()
            elif time.perf_counter() - self.last_report > self.spec.cluster.heartbeat_s:
                self._report(Heartbeat(self.spec.rank, time.perf_counter()))
            self._watch_router()
        if self.receiver is not None:
            self.receiver.close()
        self.events.put(self._audit())
        if isinstance(self.engine, Mirror):
            self.engine.tell(Halt())

    def _watch_router(self) -> None:
        now = time.perf_counter()
        if now - self.last_watch > WATCH_S:
            self.last_watch = now
            if self.lost_router():
                raise RouterLost(f"rank {self.spec.rank} stops: the router (rank 0) is gone")

    def _audit(self) -> Audit:
        """What this worker still holds at the end. Pieces still on the wire settle first (each
        within the transfer timeout: a dead peer fails them), so their buffers count as returned;
        P takes in the acknowledgements D sent before the run ended (a dead D's never come)."""
        sides = [side for side in (self.sender, self.receiver) if side is not None]
        start = time.perf_counter()
        while self._settling(sides, time.perf_counter() - start):
            self._drain_inbox(block=True)
            self._poll_transfers()
        return Audit(
            self.spec.rank,
            self.engine.num_used_blocks,
            sum(len(side.buffers.loaned) for side in sides),
            sum(side.buffers.loaned_bytes for side in sides),
            self.engine.num_cached_blocks,
            self.engine.store_stats,
            self.sender.bytes_moved if self.sender is not None else 0,
            self.receiver.bytes_moved if self.receiver is not None else 0,
        )

    def _settling(self, sides: list, waited_s: float) -> bool:
        if waited_s < self.spec.kv.timeout_s and any(side.in_flight for side in sides):
            return True
        return waited_s < ACK_WAIT_S and self.sender is not None and self.sender.awaits_ack

    def _can_step(self) -> bool:
        if self.sender is not None and self.sender.blocked(self.spec.kv.max_pending):
            return False  # back-pressure: prefilled KV waits for decode workers
        return self.engine.has_work()

    def _drain_inbox(self, block: bool) -> None:
        busy = any(side.busy for side in (self.sender, self.receiver) if side is not None)
        timeout = IDLE_WAIT_S if busy else 0.05
        try:
            msg = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
            while True:
                self._handle(msg)
                msg = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, msg) -> None:
        if isinstance(msg, Serve):
            seq = Sequence(msg.rid, list(msg.prompt), msg.max_tokens)
            self.engine.add(seq)
            if self.sender is not None:
                self.sender.serve(seq, msg.decode_rank)
        elif isinstance(msg, Reserve):
            self.receiver.reserve(msg)
        elif isinstance(msg, Ready):
            self.sender.ready(msg)
        elif isinstance(msg, KVBegin):
            self.receiver.on_begin(msg)
        elif isinstance(msg, KVPart):
            self.receiver.on_part(msg)
        elif isinstance(msg, KVDone):
            self.receiver.on_done(msg)
        elif isinstance(msg, KVAck):
            self.sender.ack(msg)
        elif isinstance(msg, KVPoolExport):
            self.sender.attach(msg)
        elif isinstance(msg, KVPoolAttached):
            self.unattached.discard(msg.src)
            if not self.unattached:  # every P has it mapped: the file's name is no longer needed
                release(self.pool)
        elif isinstance(msg, KVFence):
            self.receiver.on_fence(msg)
        elif isinstance(msg, Abort):
            self._abort(msg)
        elif isinstance(msg, Stop):
            self.stopping = True
        elif isinstance(msg, Ping):
            self.events.put(Pong(self.spec.rank, msg.t, time.perf_counter()))
        elif isinstance(msg, Stall):
            time.sleep(msg.seconds)  # injected: unresponsive, as a hung kernel or a paused process

    def _abort(self, msg: Abort) -> None:
        """Wherever the request is here: the connector's records first (they own its buffers),
        then the engine's queues."""
        if self.sender is not None and self.sender.abort(msg.rid):
            return
        if self.receiver is not None and self.receiver.abort(msg.rid):
            return
        self.engine.abort(msg.rid)

    def _poll_transfers(self) -> None:
        if self.sender is not None:
            self.sender.poll()
        if self.receiver is not None:
            self.receiver.poll()

    def _step(self) -> None:
        step = self.engine.step()
        if step.record is None:
            return
        record = step.record if self.pacer is None else self._pace(step.record)
        t = time.perf_counter()
        self._report(self._step_events(step.result, record, t))  # the first token leaves before its KV
        for seq in step.result.handoff:
            if self.link is not None:  # the paced prefill a layer-wise push overlaps
                self.link.prefilled(seq.seq_id, record.modelled_s)
            self.sender.handoff(seq, t)

    def _pace(self, record):
        """Hold the step until the emulated device would have finished it (the tokens leave then);
        the KV link keeps moving meanwhile."""
        pace = self.pacer.pace(record, self.paced_until)
        if pace.sleep_s > 0:
            wake = self.link.next_due if self.sender is not None else (lambda now: None)
            hold(pace.until, time.perf_counter, time.sleep, self._poll_transfers, wake)
        end = time.perf_counter() if pace.sleep_s > 0 else record.end
        self.paced_until = end
        # the row keeps the step's real start (a request's prefill never starts before it arrived);
        # its end is the modelled one, counted from the previous step's end while work kept coming
        return record._replace(end=end, modelled_s=pace.modelled_s, pace_overrun=pace.lost(end))

    def _step_events(self, result: StepResult, record, t: float) -> StepEvents:
        engine = self.engine
        return StepEvents(
            worker=self.spec.rank,
            t=t,
            record=record,
            report=result.by_id(),
            cached=engine.cache_changes(),
            free_blocks=engine.num_free_blocks,
            num_running=engine.num_running,
            sent=time.perf_counter(),
        )

    def _report(self, msg) -> None:
        self.events.put(msg)
        self.last_report = time.perf_counter()
