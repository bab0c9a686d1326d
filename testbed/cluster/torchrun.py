"""The same workers across hosts under torchrun: one worker per rank, rank 0 also the router.

    rank 0:   Session (store, token, an agent link per rank) -> per point: TorchrunCluster
              (Launch to every rank, its own worker as a child process, router over ZeroMQ)
    rank r>0: serve_rank: wait for Launch -> run the worker in this process -> wait again,
              until Shutdown (or rank 0 is gone)

Every point's workers find each other's control addresses in the rendezvous store under
`testbed/point<N>/` and form their torch.distributed group through it (NCCL across GPUs, gloo on
CPU). A rank that dies or never joins fails the run with one line naming it and its host; the
others stop: remote workers notice the router's connection drop (ZeroMQ heartbeats).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import sys
import time
from dataclasses import dataclass, replace

import torch.multiprocessing as mp
import zmq

from testbed.cluster.launcher import Cluster
from testbed.cluster.layout import WorkerPlan
from testbed.cluster.messages import Started, Stop, WorkerError
from testbed.cluster.worker import RouterLost, WorkerSpec, worker_main
from testbed.errors import ConfigError, RankLost
from testbed.net.rendezvous import World, bind_address, connect_store, lookup, publish, run_token
from testbed.net.transport import Inbox, Mesh, Outbox
from testbed.net.wire import Launch, Shutdown

log = logging.getLogger(__name__)
POLL_S = 0.5


@dataclass(frozen=True)
class ControlPlan:
    """What a worker process needs to join one point's control mesh (picklable: a spawned child)."""

    token: str
    bind: str
    heartbeat_s: float
    store: tuple  # (host, port) of the rendezvous store
    prefix: str  # this point's keys in the store
    timeout_s: float


def net_worker_main(spec: WorkerSpec, plan: ControlPlan) -> None:
    """A worker whose inbox, peers and router are ZeroMQ endpoints found through the store."""
    store = connect_client(plan.store, plan.timeout_s)
    ctx = zmq.Context()
    inbox = Inbox(ctx, plan.bind, plan.token, plan.heartbeat_s, f"worker{spec.rank}")
    publish(store, f"{plan.prefix}/inbox/{spec.rank}", inbox.address)
    events = Outbox(ctx, lookup(store, f"{plan.prefix}/events"), plan.token, plan.heartbeat_s)
    peers = {r: Outbox(ctx, lookup(store, f"{plan.prefix}/inbox/{r}"), plan.token, plan.heartbeat_s)
             for r in range(spec.world_size) if r != spec.rank}
    mesh = Mesh(inbox, peers, spec.rank)
    try:
        worker_main(spec, mesh, events, events.lost)
    finally:
        mesh.close()
        events.close()
        ctx.term()


def child_worker_main(spec: WorkerSpec, plan: ControlPlan) -> None:
    """Rank 0's own worker, a child of the router's process: a lost router is one line, not a traceback."""
    try:
        net_worker_main(spec, plan)
    except RouterLost as lost:
        print(f"error: {lost}", file=sys.stderr)
        sys.exit(1)


def connect_client(address: tuple, timeout_s: float):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(address[0], address[1], None, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def rank_spec(template: WorkerSpec, plan: WorkerPlan, world: World, point: int) -> WorkerSpec:
    return replace(template, rank=plan.rank, world_size=world.world_size, role=plan.role, device=plan.device,
                   rendezvous=(world.master_addr, world.master_port, f"testbed/point{point}"),
                   host=socket.gethostname(), node=plan.node, cpu_core=None)


def _lookup_rank(store, key: str, rank: int, timeout_s: float) -> str:
    try:
        return lookup(store, key)
    except RuntimeError:  # the store's timeout (DistStoreError)
        raise RankLost(f"rank {rank} did not join within {timeout_s:.0f} s (cluster.start_timeout_s)") from None


class Session:
    """Rank 0's side of a torchrun job: `with Session(world, cluster_cfg) as s:` every rank is up."""

    def __init__(self, world: World, cluster_cfg):
        self.world, self.timeout_s, self.heartbeat_s = world, cluster_cfg.start_timeout_s, cluster_cfg.heartbeat_s
        self.bind = bind_address(cluster_cfg.bind, world)
        self.points = 0

    def __enter__(self) -> "Session":
        self.store = connect_store(self.world, self.timeout_s)
        self.token = run_token(self.store, self.world)
        self.ctx = zmq.Context()
        self.driver = Inbox(self.ctx, self.bind, self.token, self.heartbeat_s, "driver")
        publish(self.store, "driver", self.driver.address)
        self.hosts = {0: socket.gethostname()}
        self.agents: dict[int, Outbox] = {}
        try:
            for rank in range(1, self.world.world_size):
                address = _lookup_rank(self.store, f"agent/{rank}", rank, self.timeout_s)
                self.hosts[rank] = lookup(self.store, f"host/{rank}")
                self.agents[rank] = Outbox(self.ctx, address, self.token, self.heartbeat_s)
        except BaseException:
            self._close()
            raise
        log.info(f"torchrun: {self.world.world_size} ranks on {self.world.num_nodes} nodes; control on "
                 f"{self.bind} (hosts: {', '.join(f'{r}={h}' for r, h in sorted(self.hosts.items()))})")
        return self

    def cluster(self, cfg, plans: list[WorkerPlan], template: WorkerSpec) -> "TorchrunCluster":
        self.points += 1
        return TorchrunCluster(self, cfg, plans, template, self.points)

    def __exit__(self, kind, error, tb) -> None:
        why = "" if kind is None else f"{kind.__name__}: {error}"[:500]
        for agent in self.agents.values():
            agent.put(Shutdown(why))
        self._close()

    def _close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.driver.close()
        self.ctx.term()


class TorchrunCluster(Cluster):
    """One point's workers on every rank; the router's view is the single-box Cluster's."""

    def __init__(self, session: Session, cfg, plans: list[WorkerPlan], template: WorkerSpec, point: int):
        super().__init__(plans, template, session.timeout_s)
        self.session, self.cfg, self.point, self.cores = session, cfg, point, None
        self.prefix = f"testbed/point{point}"

    def __enter__(self) -> "TorchrunCluster":
        s = self.session
        self.events = Inbox(s.ctx, s.bind, s.token, s.heartbeat_s, "router")
        publish(s.store, f"{self.prefix}/events", self.events.address)
        for agent in s.agents.values():
            agent.put(Launch(self.point, dataclasses.asdict(self.cfg)))
        plan = ControlPlan(s.token, s.bind, s.heartbeat_s, (s.world.master_addr, s.world.master_port), self.prefix,
                           s.timeout_s)
        spec = rank_spec(self.template, self.plans[0], s.world, self.point)
        self.child = mp.get_context("spawn").Process(target=child_worker_main, args=(spec, plan), daemon=True,
                                                     name=f"testbed-worker0-{spec.role}")
        self.child.start()
        self.outboxes = {rank: Outbox(s.ctx, _lookup_rank(s.store, f"{self.prefix}/inbox/{rank}", rank, s.timeout_s),
                                      s.token, s.heartbeat_s) for rank in range(len(self.plans))}
        self.inboxes = [self.outboxes[rank] for rank in range(len(self.plans))]
        self._wait_started()
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while len(self.started) < len(self.plans):
            try:
                msg = self.events.get(timeout=POLL_S)
            except queue.Empty:
                for rank in range(len(self.plans)):
                    if not self.alive(rank):
                        self.lose(rank, "stopped before it started")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(len(self.plans))) - set(self.started))
                    self.lose(missing[0], f"did not start within {self.start_timeout_s:.0f} s (cluster.start_timeout_s)")
                continue
            if isinstance(msg, WorkerError) and msg.bad_input:
                raise ConfigError(msg.error)
            if isinstance(msg, WorkerError):
                raise RuntimeError(f"worker {msg.worker} on {self.host(msg.worker)} failed to start:\n{msg.error}")
            if isinstance(msg, Started):
                self.started[msg.worker] = msg

    def host(self, rank: int) -> str:
        return self.session.hosts.get(rank, "?")

    def alive(self, rank: int) -> bool:
        if rank == 0:
            return self.child.exitcode is None
        return not (self.outboxes[rank].lost() or self.session.agents[rank].lost())

    def lose(self, rank: int, why: str) -> None:
        """Across hosts a lost rank fails the run: its KV group cannot be re-formed mid-point."""
        plan = self.plans[rank]
        raise RankLost(f"rank {rank} ({plan.role}) on node {plan.node}, host {self.host(rank)}: {why}")

    def kill(self, rank: int) -> None:
        raise ConfigError("faults.kill_worker runs on one box; under torchrun kill the rank's process instead")

    def local_pids(self) -> dict[str, int]:
        return {"worker0": self.started[0].pid} if 0 in self.started else {}

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the others go back to waiting, and see the Shutdown that follows
            for rank in range(len(self.plans)):
                if rank not in self.audits and self.alive(rank):
                    self.inboxes[rank].put(Stop())
        self.child.join(timeout=30.0 if exc[0] is None else 5.0)
        if self.child.exitcode is None:
            self.child.kill()
            self.child.join(timeout=5.0)
        for box in self.outboxes.values():
            box.close()
        self.events.close()


def serve_rank(world: World, cluster_cfg) -> None:
    """A rank other than 0: serve every point rank 0 launches, until it says the run is over."""
    from omegaconf import OmegaConf

    from testbed.cluster.layout import plan_ranks
    from testbed.cluster.point import worker_template
    from testbed.config import to_config

    store = connect_store(world, cluster_cfg.start_timeout_s)
    token = run_token(store, world)
    bind, beat = bind_address(cluster_cfg.bind, world), cluster_cfg.heartbeat_s
    ctx = zmq.Context()
    agent = Inbox(ctx, bind, token, beat, f"rank{world.rank}")
    publish(store, f"agent/{world.rank}", agent.address)
    publish(store, f"host/{world.rank}", socket.gethostname())
    driver = Outbox(ctx, lookup(store, "driver"), token, beat)
    log.info(f"torchrun rank {world.rank} (node {world.node}, host {socket.gethostname()}): control on {agent.address}")
    try:
        while True:
            try:
                msg = agent.get(timeout=POLL_S)
            except queue.Empty:
                if driver.lost():
                    raise RankLost(f"rank {world.rank} stops: rank 0 (the router, {world.master_addr}) is gone")
                continue
            if isinstance(msg, Shutdown):
                if msg.error:
                    raise RankLost(f"rank {world.rank} stops: rank 0 ended the run ({msg.error})")
                return
            if isinstance(msg, Launch):
                cfg = to_config(OmegaConf.create(msg.config))
                plan = plan_ranks(cfg.mode, cfg.cluster, cfg.hardware, world)[world.rank]
                control = ControlPlan(token, bind, beat, (world.master_addr, world.master_port),
                                      f"testbed/point{msg.point}", cluster_cfg.start_timeout_s)
                try:
                    net_worker_main(rank_spec(worker_template(cfg), plan, world, msg.point), control)
                except RouterLost as lost:
                    raise RankLost(str(lost)) from None
    finally:
        driver.close()
        agent.close()
        ctx.term()
