"""The same workers across hosts under torchrun: one worker per rank, rank 0 also the router.

    rank 0:   Session (store, token, an agent link per rank) -> per point: TorchrunCluster
              (Launch to every rank, its own worker as a child process, router over ZeroMQ)
    rank r>0: serve_rank (testbed/cluster/rank.py): run each launched point's worker in-process

Every point's workers find each other's message addresses in the rendezvous store under
`testbed/<run>/point<N>/` and form their torch.distributed group through it (NCCL across GPUs,
gloo on CPU). A rank that dies or never joins fails the run with one line naming it and its host;
the others stop: remote workers notice the router's connection drop (ZeroMQ heartbeats).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import socket
import time

import torch.multiprocessing as mp
import zmq

from testbed.cluster.launcher import Cluster
from testbed.cluster.rank import GRACE_S, MeshPlan, child_worker_main, rank_spec
from testbed.cluster.worker import WorkerSpec
from testbed.control.layout import WorkerPlan
from testbed.errors import ConfigError, RankLost
from testbed.net import clocks
from testbed.net.curve import Guard
from testbed.net.messages import Audit, Ping, Pong, Started, Stop
from testbed.net.rendezvous import World, bind_address, connect_store, lookup, publish, run_keys, run_token
from testbed.net.transport import LINGER_MS, Inbox, Outbox, refused_counts
from testbed.net.wire import Launch, Shutdown

log = logging.getLogger(__name__)
PINGS = 8  # per rank: the quickest round trip sets its clock offset


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
        self.keys = run_keys(self.store, self.world, self.lookup)
        self.ctx = zmq.Context()
        self.guard = Guard(self.ctx, self.keys)
        try:
            self.driver = Inbox(self.ctx, self.bind, self.token, self.heartbeat_s, "driver", self.keys)
            publish(self.store, f"{self.world.scope}/driver", self.driver.address)
            for rank in range(1, self.world.world_size):
                address = self.lookup(f"agent/{rank}", rank)
                self.hosts[rank] = self.lookup(f"host/{rank}", rank)
                self.agents[rank] = Outbox(
                    self.ctx, address, self.token, self.heartbeat_s, f"rank {rank}", self.keys, rank
                )
        except BaseException:
            self.guard.stop()
            self.ctx.destroy(linger=0)
            raise
        log.info(
            f"torchrun: {self.world.world_size} ranks on {self.world.num_nodes} nodes; messages on "
            f"{self.bind} (hosts: {', '.join(f'{r}={h}' for r, h in sorted(self.hosts.items()))})"
        )
        return self

    def lookup(self, key: str, rank: int, alive=lambda: True) -> str:
        try:
            return lookup(self.store, f"{self.world.scope}/{key}", self.timeout_s, alive)
        except LookupError:
            where = f" (host {self.hosts[rank]})" if rank in self.hosts else ""
            what = "stopped" if not alive() else f"did not join within {self.timeout_s:.0f} s (cluster.start_timeout_s)"
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
        self.guard.stop()
        self.ctx.destroy(linger=LINGER_MS)


class TorchrunCluster(Cluster):
    """One point's workers on every rank; the router's view is the single-box Cluster's, its
    reports with every worker time on rank 0's clock."""

    def __init__(self, session: Session, cfg, plans: list[WorkerPlan], template: WorkerSpec, point: int):
        self.plans, self.template, self.start_timeout_s = plans, template, session.timeout_s
        self.started: dict[int, Started] = {}
        self.followers: dict[int, Started] = {}  # none: a tensor-parallel worker runs on one box
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
            self.reports = Inbox(s.ctx, s.bind, s.token, s.heartbeat_s, "router", s.keys)
            self.events = RebasedEvents(self.reports, self.offsets)
            publish(s.store, f"{self.prefix}/events", self.reports.address)
            for agent in s.agents.values():
                agent.put(Launch(self.point, dataclasses.asdict(self.cfg)))
            self._start_child()
            for rank in range(len(self.plans)):
                address = s.lookup(f"point{self.point}/inbox/{rank}", rank, lambda r=rank: self._reachable(r))
                self.outboxes[rank] = Outbox(s.ctx, address, s.token, s.heartbeat_s, f"rank {rank}", s.keys, rank)
            self.inboxes = [self.outboxes[rank] for rank in range(len(self.plans))]
            self._wait_started()
            self._measure_clocks()
        except BaseException as error:
            self.__exit__(type(error), error, None)
            raise
        return self

    @property
    def num_processes(self) -> int:
        return len(self.plans)

    def ranks_of(self, worker: int) -> list[int]:
        return [worker]

    def _start_child(self) -> None:
        s = self.session
        plan = MeshPlan(
            s.token, s.bind, s.heartbeat_s, (s.world.master_addr, s.world.master_port), self.prefix, s.timeout_s, s.keys
        )  # rank 0's keys: the child is this rank's worker
        spec = rank_spec(self.template, self.plans, 0, s.world, self.point)
        self.child = mp.get_context("spawn").Process(
            target=child_worker_main, args=(spec, plan), daemon=True, name=f"testbed-worker0-{spec.role}"
        )
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
                pong = self.events.wait_for(
                    lambda m, r=rank: isinstance(m, Pong) and m.worker == r, 5 * self.session.heartbeat_s
                )
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
        """Across hosts a lost rank fails the run: its KV group cannot be re-formed mid-point (nor can
        frames lost with a broken connection be replayed)."""
        plan = self.plans[rank]
        if rank and rank in self.outboxes and self.outboxes[rank].lost() and not self.session.agents[rank].lost():
            why = "its message connection dropped while its process still answers (frames in flight are lost)"
        raise RankLost(f"rank {rank} ({plan.role}) on node {plan.node}, host {self.host(rank)}: {why}")

    def kill(self, rank: int) -> None:
        raise ConfigError("faults.kill_worker runs on one box; under torchrun kill the rank's process instead")

    def local_pids(self) -> dict[str, int]:
        return {"worker0": self.started[0].pid} if 0 in self.started else {}

    def topology(self) -> dict:
        out = super().topology()
        for rank, offset in self.measured.items():
            out["ranks"][str(rank)].update(
                clock_offset_s=offset.seconds, clock_rtt_s=offset.rtt_s, clock_rebased=bool(self.offsets[rank].seconds)
            )
        out["messages_refused"] = self.refused()
        return out

    def refused(self) -> dict[str, dict]:
        """What each rank's message ports turned away so far, by port and reason:
        {rank: {port name: {reason: count}}} (rank 0: the router's and driver's, and its worker's)."""
        found = {"0": refused_counts()}
        for rank in range(len(self.plans)):
            try:  # published by each worker once its audit is sent
                counts = json.loads(lookup(self.session.store, f"{self.prefix}/refused/{rank}", GRACE_S))
            except LookupError:
                counts = {"unknown": {"the rank did not report": 1}}
            found.setdefault(str(rank), {}).update(counts)
        return found

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
