"""Start one process per worker, pinned to one device, in one torch.distributed group; stop them all.

GPUs: `cuda:i` with every GPU visible, NCCL. No CUDA: CPU processes on gloo, one thread each,
so `hardware.num_devices=4` stands for four GPUs, each pinned to a core of its own when there are
enough (else one line, once per process, warns that they share cores). A free port is picked per run, so two runs on
one machine never collide. Every wait has a timeout; a worker that does not stop is killed.
Which worker runs where is planned in `testbed.cluster.layout`, which holds no process code.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass, replace

import torch.multiprocessing  # noqa: F401 - its pickler reductions: a tensor put on an inbox travels in shared memory

from testbed.cluster.fork_server import worker_context
from testbed.cluster.memory import ModelMemory, plan_kv_memory
from testbed.cluster.tensor_group import Groups
from testbed.cluster.worker import WorkerSpec, worker_main
from testbed.control.layout import WorkerPlan
from testbed.errors import ConfigError
from testbed.names import KVBackend, Role
from testbed.net.channel import ReportReader, ReportWriter
from testbed.net.messages import Audit, Started, Stop, WorkerError
from testbed.net.rendezvous import host_store
from testbed.notices import warn_once

STOP_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorePlan:
    """How CPU workers share this machine's cores: a distinct core each when there are enough."""

    cores_per_worker: float
    pins: tuple  # a core per rank, or None per rank when the workers share cores


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_cores(plans: list[WorkerPlan], paced: bool) -> CorePlan | None:
    """None for GPU workers. With more CPU worker processes (a tensor-parallel worker's ranks each
    count) than cores, one line says the contention will show as interference, since every
    worker's steps then slow each other down."""
    if not plans or plans[0].device != "cpu":
        return None
    cores, n = available_cores(), sum(p.tp for p in plans)
    if n <= len(cores):
        return CorePlan(round(len(cores) / n, 3), tuple(cores[:n]))
    hint = "" if paced else "; hardware.emulate paces steps to a device model instead"
    shared = f"{n} CPU workers share {len(cores)} cores: cross-worker contention will appear as interference"
    warn_once(log, shared + hint)
    return CorePlan(round(len(cores) / n, 3), (None,) * n)


def processes(plans: list[WorkerPlan], groups: Groups) -> list[tuple[int, WorkerPlan, str]]:
    """(process rank, its worker's plan, its device) of every process, in rank order."""
    placed = [(rank, plan, device) for plan in plans for rank, device in zip(groups.ranks[plan.rank], plan.devices)]
    return sorted(placed, key=lambda p: p[0])


class Cluster:
    """Context manager: `with Cluster(plans, template) as cluster:` workers are up inside."""

    def __init__(self, plans: list[WorkerPlan], template: WorkerSpec, start_timeout_s: float):
        self.plans, self.template, self.start_timeout_s = plans, template, start_timeout_s
        self.processes: list = []  # in process rank order: the workers (leaders), then their other ranks
        self.started: dict[int, Started] = {}  # by worker (its leader's Started)
        self.followers: dict[int, Started] = {}  # tensor-parallel ranks other than leaders, by process rank
        self.audits: dict[int, Audit] = {}
        self.cores = plan_cores(plans, template.emulation is not None)
        # each device's memory split among the workers on it: refused here, before any starts, if they cannot fit
        self.kv_mib = plan_kv_memory(
            plans,
            template.engine,
            lambda device: ModelMemory.of(template.model, template.engine, template.scheduler.max_running, device),
        )

    def __enter__(self) -> "Cluster":
        ctx = worker_context()
        tps = [p.tp for p in self.plans]
        groups = Groups.of(tps, self.template.model.args().num_kv_heads) if max(tps) > 1 else None
        placed = processes(self.plans, groups or Groups.of(tps, 1))
        self.leader_of = [plan.rank for _, plan, _ in placed]
        self.inboxes = [ctx.Queue() for _ in placed]
        pipes = [ctx.Pipe(duplex=False) for _ in placed]
        self.events = ReportReader([reader for reader, _ in pipes])
        # the group's rendezvous, hosted here on the loopback alone (a worker's own would listen everywhere)
        self.store = host_store("127.0.0.1", 0, None, self.start_timeout_s)
        rendezvous = ("127.0.0.1", self.store.port, "local")
        for (rank, plan, device), (_, writer) in zip(placed, pipes):
            engine = self.template.engine
            if self.kv_mib[plan.rank] is not None:
                engine = replace(engine, kv_cache_mib=self.kv_mib[plan.rank])
            spec = replace(
                self.template,
                rank=rank,
                world_size=len(placed),
                role=plan.role,
                engine=engine,
                roles=tuple(p.role for _, p, _ in placed),
                device=device,
                rendezvous=rendezvous,
                cpu_core=self.cores.pins[rank] if self.cores else None,
                groups=groups,
            )
            name = f"testbed-worker{plan.rank}-{plan.role}" + (f"-tp{rank}" if rank != plan.rank else "")
            proc = ctx.Process(
                target=worker_main,
                args=(spec, self.inboxes, ReportWriter(writer)),
                daemon=True,
                name=name,
            )
            proc.start()
            writer.close()  # the worker holds the only writing end: its exit closes the pipe
            self.processes.append(proc)
        self._wait_started()
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while len(self.started) + len(self.followers) < self.num_processes:
            try:
                msg = self.events.get(timeout=0.5)
            except queue.Empty:
                self._check_starting(deadline)
                continue
            if isinstance(msg, WorkerError) and msg.bad_input:
                raise ConfigError(msg.error)
            if isinstance(msg, WorkerError):
                raise RuntimeError(f"{self.where(msg.worker)} failed to start:\n{msg.error}")
            if isinstance(msg, Started) and msg.worker < len(self.plans):
                self.started[msg.worker] = msg
            elif isinstance(msg, Started):
                self.followers[msg.worker] = msg

    def where(self, rank: int) -> str:
        return f"worker {rank}"

    def _check_starting(self, deadline: float) -> None:
        """Nothing arrived for a while: a worker that exited, or the deadline, fails the start."""
        dead = [p.name for p in self.processes if p.exitcode is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"workers failed to start: {dead or 'timed out'}")

    def alive(self, rank: int) -> bool:
        return self.processes[rank].exitcode is None

    @property
    def num_processes(self) -> int:
        return len(self.processes)

    def ranks_of(self, worker: int) -> list[int]:
        """A worker's process ranks: its own, then its tensor-parallel ranks'."""
        return [rank for rank, leader in enumerate(self.leader_of) if leader == worker]

    def group(self, rank: int) -> list:
        """A worker's processes."""
        return [self.processes[r] for r in self.ranks_of(rank)]

    def lose(self, rank: int, why: str) -> None:
        """A worker found dead or silent: make sure it is gone; its requests are the router's to settle."""
        for proc in self.group(rank):
            proc.kill()

    def kill(self, rank: int) -> None:
        """Fault injection: the worker's processes die now."""
        for proc in self.group(rank):
            proc.kill()

    def local_pids(self) -> dict[str, int]:
        """The workers' processes whose memory this host can sample."""
        return {f"worker{rank}": s.pid for rank, s in {**self.started, **self.followers}.items()}

    def topology(self) -> dict:
        """meta.json's hosts, ranks and P -> D links, from what each worker said when it started."""
        ranks = {
            str(r): {
                "host": s.host,
                "node": s.node,
                "device": s.device,
                "role": s.role,
                "pid": s.pid,
                "attention_backend": s.attention_backend,
            }
            for r, s in sorted(self.started.items())
        }
        hosts: dict[str, list[int]] = {}
        for r, s in sorted(self.started.items()):
            hosts.setdefault(s.host, []).append(r)
        links = [
            {
                "prefill": p,
                "decode": d,
                "crosses_nodes": self.started[p].node != self.started[d].node,
                "backend": self._link_backend(p),
            }
            for p, sp in sorted(self.started.items())
            if sp.role == Role.PREFILL_ONLY
            for d, sd in sorted(self.started.items())
            if sd.role == Role.DECODE_ONLY
        ]
        return {"hosts": hosts, "ranks": ranks, "links": links}

    def _link_backend(self, prefill_rank: int) -> str:
        """How KV moves on a P -> D link: ipc (P writes into D's mapped pool), else the process group's."""
        if self.template.kv.direct:
            return KVBackend.IPC
        return "nccl" if self.started[prefill_rank].device.startswith("cuda") else "gloo"

    def stop(self, leftover_events: list) -> dict[int, int]:
        """Ask every live worker for its KV audit and to exit; returns {rank: allocated blocks}."""
        for rank in range(len(self.plans)):  # a leader stops its other ranks after its own audit
            if self.alive(rank):
                self.inboxes[rank].put(Stop())
        deadline = time.monotonic() + STOP_TIMEOUT_S
        expected = set(range(self.num_processes))
        gone: dict[int, float] = {}
        while not expected <= set(self.audits) and time.monotonic() < deadline:
            try:
                msg = self.events.get(timeout=0.2)
            except queue.Empty:
                expected = {r for r in expected if r in self.audits or self._may_still_report(r, gone)}
                continue
            if isinstance(msg, Audit):
                self.audits[msg.worker] = msg
            else:
                leftover_events.append(msg)
        return {rank: audit.used_blocks for rank, audit in self.audits.items()}

    def _may_still_report(self, rank: int, gone: dict[int, float]) -> bool:
        """While stopping: a process whose audit may still come (a pipe keeps what its writer sent)."""
        return self.processes[rank].exitcode is None

    def __exit__(self, *exc) -> None:
        for proc in self.processes:
            proc.join(timeout=STOP_TIMEOUT_S if exc[0] is None else 1.0)
        for proc in self.processes:
            if proc.exitcode is None:
                proc.terminate()
                proc.join(timeout=5.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=5.0)
        for q in getattr(self, "inboxes", []):
            q.cancel_join_thread()  # never block exit on undelivered messages
            q.close()
        self.store = None  # its server stops with it: nothing of the run listens any more
        if hasattr(self, "events"):
            self.events.close()
