"""The same workers across hosts under torchrun: one worker per rank, rank 0 also the router.

    rank 0:   Session (store, token, an agent link per rank) -> per point: TorchrunCluster
              (Launch to every rank, its own worker as a child process, router over ZeroMQ)
    rank r>0: serve_rank: wait for Launch -> run the worker in this process -> wait again,
              until Shutdown (or rank 0 is gone)

Every point's workers find each other's control addresses in the rendezvous store under
`testbed/<run>/point<N>/` and form their torch.distributed group through it (NCCL across GPUs,
gloo on CPU). A rank that dies or never joins fails the run with one line naming it and its host;
the others stop: remote workers notice the router's connection drop (ZeroMQ heartbeats).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace

import torch.multiprocessing as mp
import zmq

from testbed.cluster.launcher import Cluster
from testbed.cluster.layout import WorkerPlan
from testbed.cluster.messages import Audit, Ping, Pong, Started, Stop
from testbed.cluster.worker import RouterLost, WorkerSpec, worker_main
from testbed.errors import ConfigError, RankLost
from testbed.net import clocks
from testbed.net.rendezvous import World, bind_address, connect_store, lookup, publish, run_token
from testbed.net.transport import LINGER_MS, Inbox, Mesh, Outbox
from testbed.net.wire import Launch, Shutdown

log = logging.getLogger(__name__)
POLL_S = 0.5
PINGS = 8  # per rank: the quickest round trip sets its clock offset
GRACE_S = 2.0  # an exited worker's last frames (its audit) may still be on the way


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
    try:
        inbox = Inbox(ctx, plan.bind, plan.token, plan.heartbeat_s, f"worker{spec.rank}")
        publish(store, f"{plan.prefix}/inbox/{spec.rank}", inbox.address)
        events = Outbox(ctx, lookup(store, f"{plan.prefix}/events", plan.timeout_s), plan.token, plan.heartbeat_s,
                        "the router")
        peers = {r: Outbox(ctx, lookup(store, f"{plan.prefix}/inbox/{r}", plan.timeout_s), plan.token,
                           plan.heartbeat_s, f"worker {r}") for r in range(spec.world_size) if r != spec.rank}
        worker_main(spec, Mesh(inbox, peers, spec.rank), events, events.lost)
    except LookupError as missing:
        raise RouterLost(f"rank {spec.rank} stops: {missing}") from None
    finally:
        ctx.destroy(linger=LINGER_MS)  # every socket: the last frames (the audit) still leave


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
                   rendezvous=(world.master_addr, world.master_port, f"{world.scope}/point{point}"),
                   host=socket.gethostname(), node=plan.node, cpu_core=None)


class Session:
    """Rank 0's side of a torchrun job: `with Session(world, cluster_cfg) as s:` every rank is up."""

    def __init__(self, world: World, cluster_cfg):
        self.world, self.timeout_s, self.heartbeat_s = world, cluster_cfg.start_timeout_s, cluster_cfg.heartbeat_s
        self.bind = bind_address(cluster_cfg.bind, world)
        self.points = 0
        self.agents: dict[int, Outbox] = {}
        self.hosts = {0: socket.gethostname()}

    def __enter__(self) -> "Session":
        self.store = connect_store(self.world, self.timeout_s)
        self.token = run_token(self.store, self.world)
        self.ctx = zmq.Context()
        try:
            self.driver = Inbox(self.ctx, self.bind, self.token, self.heartbeat_s, "driver")
            publish(self.store, f"{self.world.scope}/driver", self.driver.address)
            for rank in range(1, self.world.world_size):
                address = self.lookup(f"agent/{rank}", rank)
                self.hosts[rank] = self.lookup(f"host/{rank}", rank)
                self.agents[rank] = Outbox(self.ctx, address, self.token, self.heartbeat_s, f"rank {rank}")
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        log.info(f"torchrun: {self.world.world_size} ranks on {self.world.num_nodes} nodes; control on "
                 f"{self.bind} (hosts: {', '.join(f'{r}={h}' for r, h in sorted(self.hosts.items()))})")
        return self

    def lookup(self, key: str, rank: int, alive=lambda: True) -> str:
        try:
            return lookup(self.store, f"{self.world.scope}/{key}", self.timeout_s, alive)
        except LookupError:
            where = f" (host {self.hosts[rank]})" if rank in self.hosts else ""
            what = ("stopped" if not alive() else
                    f"did not join within {self.timeout_s:.0f} s (cluster.start_timeout_s)")
            raise RankLost(f"rank {rank}{where} {what}") from None

    def cluster(self, cfg, plans: list[WorkerPlan], template: WorkerSpec) -> "TorchrunCluster":
        self.points += 1
        return TorchrunCluster(self, cfg, plans, template, self.points)

    def __exit__(self, kind, error, tb) -> None:
        why = "" if kind is None else f"{kind.__name__}: {error}"[:500]
        for agent in self.agents.values():
            try:
                agent.put(Shutdown(why))
            except RankLost:
                pass  # that rank is the one that is gone
        for agent in self.agents.values():  # Shutdown leaves before the driver link drops
            agent.close()
        self.ctx.destroy(linger=LINGER_MS)


class TorchrunCluster(Cluster):
    """One point's workers on every rank; the router's view is the single-box Cluster's, its
    reports with every worker time on rank 0's clock."""

    def __init__(self, session: Session, cfg, plans: list[WorkerPlan], template: WorkerSpec, point: int):
        self.plans, self.template, self.start_timeout_s = plans, template, session.timeout_s
        self.started: dict[int, Started] = {}
        self.audits: dict[int, Audit] = {}
        self.cores = None  # each host's own: one worker per rank, as torchrun placed them
        self.session, self.cfg, self.point = session, cfg, point
        self.prefix = f"{session.world.scope}/point{point}"
        self.offsets: dict[int, clocks.Offset] = {}  # applied (zero on rank 0's host)
        self.measured: dict[int, clocks.Offset] = {}
        self.child = None
        self.outboxes: dict[int, Outbox] = {}
        self.gone: dict[int, float] = {}  # ranks found gone while starting, and when

    def __enter__(self) -> "TorchrunCluster":
        s = self.session
        try:
            self.reports = Inbox(s.ctx, s.bind, s.token, s.heartbeat_s, "router")
            self.events = RebasedEvents(self.reports, self.offsets)
            publish(s.store, f"{self.prefix}/events", self.reports.address)
            for agent in s.agents.values():
                agent.put(Launch(self.point, dataclasses.asdict(self.cfg)))
            self._start_child()
            for rank in range(len(self.plans)):
                address = s.lookup(f"point{self.point}/inbox/{rank}", rank, lambda r=rank: self._reachable(r))
                self.outboxes[rank] = Outbox(s.ctx, address, s.token, s.heartbeat_s, f"rank {rank}")
            self.inboxes = [self.outboxes[rank] for rank in range(len(self.plans))]
            self._wait_started()
            self._measure_clocks()
        except BaseException as error:
            self.__exit__(type(error), error, None)
            raise
        return self

    def _start_child(self) -> None:
        s = self.session
        plan = ControlPlan(s.token, s.bind, s.heartbeat_s, (s.world.master_addr, s.world.master_port),
                           self.prefix, s.timeout_s)
        spec = rank_spec(self.template, self.plans[0], s.world, self.point)
        self.child = mp.get_context("spawn").Process(target=child_worker_main, args=(spec, plan), daemon=True,
                                                     name=f"testbed-worker0-{spec.role}")
        self.child.start()

    def _check_starting(self, deadline: float) -> None:
        """A rank found gone fails the start once GRACE_S has passed (its error may be on the way)."""
        now = time.monotonic()
        for rank in range(len(self.plans)):
            if not self.alive(rank) and now - self.gone.setdefault(rank, now) > GRACE_S:
                self.lose(rank, "stopped before it started")
        if now > deadline:
            missing = sorted(set(range(len(self.plans))) - set(self.started))
            self.lose(missing[0], f"did not start within {self.start_timeout_s:.0f} s (cluster.start_timeout_s)")

    def where(self, rank: int) -> str:
        return f"worker {rank} on {self.host(rank)}"

    def _measure_clocks(self) -> None:
        """Each rank's clock offset (min-RTT pings); applied where the rank's host is not rank 0's."""
        for rank in range(1, len(self.plans)):
            samples = []
            for _ in range(PINGS):
                self.inboxes[rank].put(Ping(time.perf_counter()))
                pong = self.events.wait_for(lambda m, r=rank: isinstance(m, Pong) and m.worker == r,
                                            5 * self.session.heartbeat_s)
                if pong is None:
                    self.lose(rank, "did not answer the clock pings")
                samples.append((pong.sent, pong.t, self.events.last_read))
            offset = clocks.estimate(samples)
            self.measured[rank] = offset
            self.offsets[rank] = offset if self.host(rank) != self.host(0) else clocks.Offset(0.0, offset.rtt_s)

    def host(self, rank: int) -> str:
        started = self.started.get(rank)
        return started.host if started else self.session.hosts.get(rank, "?")

    def _reachable(self, rank: int) -> bool:
        """Before its inbox is known: rank 0's child running, another rank's process connected."""
        if rank == 0:
            return self.child is not None and self.child.exitcode is None
        return not self.session.agents[rank].lost()

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

    def topology(self) -> dict:
        out = super().topology()
        for rank, offset in self.measured.items():
            out["ranks"][str(rank)].update(clock_offset_s=offset.seconds, clock_rtt_s=offset.rtt_s,
                                           clock_rebased=bool(self.offsets[rank].seconds))
        return out

    def _may_still_report(self, rank: int, gone: dict[int, float]) -> bool:
        """A worker's process leaves once its audit is sent, so a rank is given up only when its host
        process is gone (rank 0: its child exited GRACE_S ago and the audit never came)."""
        if rank:
            return not self.session.agents[rank].lost()
        if self.child.exitcode is None:
            return True
        return time.monotonic() - gone.setdefault(rank, time.monotonic()) < GRACE_S

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the others go back to waiting, and see the Shutdown that follows
            for rank, box in self.outboxes.items():
                if rank not in self.audits and self._reachable(rank):
                    try:
                        box.put(Stop())
                    except RankLost:
                        pass
        if self.child is not None:
            self.child.join(timeout=30.0 if exc[0] is None else 5.0)
            if self.child.exitcode is None:
                self.child.kill()
                self.child.join(timeout=5.0)
        for box in self.outboxes.values():
            box.close()
        if hasattr(self, "reports"):
            self.reports.close()


class RebasedEvents:
    """The router's reader of worker reports under torchrun: an Inbox whose reports come out with
    their worker times on rank 0's clock. Reports read while waiting for something else are kept."""

    def __init__(self, inbox: Inbox, offsets: dict[int, clocks.Offset]):
        self.inbox, self.offsets, self.kept = inbox, offsets, []

    @property
    def last_read(self) -> float:
        return self.inbox.last_read

    def get(self, timeout: float | None = None):
        msg = self.kept.pop(0) if self.kept else self.inbox.get(timeout)
        offset = self.offsets.get(clocks.sender(msg))
        return clocks.rebase(msg, offset.seconds) if offset else msg

    def get_nowait(self):
        return self.get(timeout=0)

    def wait_for(self, wanted, timeout_s: float):
        """The first message `wanted(msg)` accepts within timeout_s (None if none came)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self.inbox.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return None
            if wanted(msg):
                return msg
            self.kept.append(msg)
        return None


def serve_rank(world: World, cluster_cfg) -> None:
    """A rank other than 0: serve every point rank 0 launches, until it says the run is over."""
    store = connect_store(world, cluster_cfg.start_timeout_s)
    token = run_token(store, world)
    bind, beat = bind_address(cluster_cfg.bind, world), cluster_cfg.heartbeat_s
    ctx = zmq.Context()
    try:
        agent = Inbox(ctx, bind, token, beat, f"rank{world.rank}")
        publish(store, f"{world.scope}/agent/{world.rank}", agent.address)
        publish(store, f"{world.scope}/host/{world.rank}", socket.gethostname())
        driver = Outbox(ctx, lookup(store, f"{world.scope}/driver", cluster_cfg.start_timeout_s), token, beat,
                        "rank 0")
        log.info(f"torchrun rank {world.rank} (node {world.node}, host {socket.gethostname()}): "
                 f"control on {agent.address}")
        while not _serve_next(world, cluster_cfg, token, bind, agent, driver, store):
            pass
    except LookupError:
        raise RankLost(f"rank {world.rank} stops: rank 0 did not start within {cluster_cfg.start_timeout_s:.0f} s "
                       "(cluster.start_timeout_s)") from None
    finally:
        ctx.destroy(linger=LINGER_MS)


def _serve_next(world: World, cluster_cfg, token: str, bind: str, agent: Inbox, driver: Outbox, store) -> bool:
    """Wait for rank 0's next word and do it; True once the run is over."""
    try:
        msg = agent.get(timeout=POLL_S)
    except queue.Empty:
        if not driver.lost():
            return False
        try:  # rank 0 closes its end right after its Shutdown: read what it sent last
            msg = agent.get(timeout=GRACE_S)
        except queue.Empty:
            raise RankLost(f"rank {world.rank} stops: rank 0 (the router, {world.master_addr}) is gone") from None
    if isinstance(msg, Shutdown):
        if msg.error:
            raise RankLost(f"rank {world.rank} stops: rank 0 ended the run ({msg.error})")
        return True
    if isinstance(msg, Launch):
        _serve_point(world, cluster_cfg, token, bind, msg)
    return False


def _serve_point(world: World, cluster_cfg, token: str, bind: str, launch: Launch) -> None:
    from omegaconf import OmegaConf

    from testbed.cluster.layout import plan_ranks
    from testbed.cluster.point import worker_template
    from testbed.config import to_config

    cfg = to_config(OmegaConf.create(launch.config))
    plan = plan_ranks(cfg.mode, cfg.cluster, cfg.hardware, world)[world.rank]
    control = ControlPlan(token, bind, cluster_cfg.heartbeat_s, (world.master_addr, world.master_port),
                          f"{world.scope}/point{launch.point}", cluster_cfg.start_timeout_s)
    on_interrupt = signal.getsignal(signal.SIGINT)
    try:
        net_worker_main(rank_spec(worker_template(cfg), plan, world, launch.point), control)
    except RouterLost as lost:
        raise RankLost(str(lost)) from None
    finally:
        signal.signal(signal.SIGINT, on_interrupt)  # the worker ignores Ctrl-C while it serves

