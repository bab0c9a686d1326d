"""One rank's worker under torchrun: its message mesh (ZeroMQ endpoints found through the
rendezvous store) and, on ranks other than 0, the loop that serves every point rank 0 launches.

    rank r>0: serve_rank: wait for Launch -> run the worker in this process -> wait again,
              until Shutdown (or rank 0 is gone)
    rank 0:   the same worker in a child process of the router's (child_worker_main)
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import socket
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import zmq

from testbed.cluster.worker import RouterLost, WorkerSpec, worker_main
from testbed.control.layout import WorkerPlan
from testbed.errors import RankLost
from testbed.net.curve import Guard, Keys
from testbed.net.rendezvous import (
    World,
    bind_address,
    connect_store,
    lookup,
    publish,
    run_keys,
    run_token,
    store_client,
)
from testbed.net.transport import LINGER_MS, Inbox, Mesh, Outbox, refused_counts
from testbed.net.wire import Launch, Shutdown

log = logging.getLogger(__name__)
POLL_S = 0.5
GRACE_S = 2.0  # an exited process's last frames (its audit, rank 0's Shutdown) may still be on the way


@dataclass(frozen=True)
class MeshPlan:
    """What a worker process needs to join one point's message mesh (picklable: a spawned child)."""

    token: str
    bind: str
    heartbeat_s: float
    store: tuple  # (host, port) of the rendezvous store
    prefix: str  # this point's keys in the store
    timeout_s: float
    keys: Optional[Keys] = None  # this rank's CURVE keys and the run's public keys (None: one box without CURVE)


def net_worker_main(spec: WorkerSpec, plan: MeshPlan) -> None:
    """A worker whose inbox, peers and router are ZeroMQ endpoints found through the store."""
    store = store_client(*plan.store, plan.timeout_s)
    ctx = zmq.Context()
    guard = Guard(ctx, plan.keys)
    try:
        inbox = Inbox(ctx, plan.bind, plan.token, plan.heartbeat_s, f"worker{spec.rank}", plan.keys)
        publish(store, f"{plan.prefix}/inbox/{spec.rank}", inbox.address)
        events = Outbox(
            ctx,
            lookup(store, f"{plan.prefix}/events", plan.timeout_s),
            plan.token,
            plan.heartbeat_s,
            "the router",
            plan.keys,
            0,
        )
        peers = {
            r: Outbox(
                ctx,
                lookup(store, f"{plan.prefix}/inbox/{r}", plan.timeout_s),
                plan.token,
                plan.heartbeat_s,
                f"worker {r}",
                plan.keys,
                r,
            )
            for r in range(spec.world_size)
            if r != spec.rank
        }
        worker_main(spec, Mesh(inbox, peers, spec.rank), events, events.lost)
        # what this process's message ports turned away, for rank 0's meta.json (after the audit)
        publish(store, f"{plan.prefix}/refused/{spec.rank}", json.dumps(refused_counts()))
    except LookupError as missing:
        raise RouterLost(f"rank {spec.rank} stops: {missing}") from None
    finally:
        guard.stop()
        ctx.destroy(linger=LINGER_MS)  # every socket: the last frames (the audit) still leave


def child_worker_main(spec: WorkerSpec, plan: MeshPlan) -> None:
    """Rank 0's own worker, a child of the router's process: a lost router is one line, not a traceback."""
    try:
        net_worker_main(spec, plan)
    except RouterLost as lost:
        print(f"error: {lost}", file=sys.stderr)
        sys.exit(1)


def rank_spec(template: WorkerSpec, plans: list[WorkerPlan], rank: int, world: World, point: int) -> WorkerSpec:
    """Rank `rank`'s worker for point `point`, knowing every rank's role (its links to warm up)."""
    plan = plans[rank]
    return replace(
        template,
        rank=plan.rank,
        world_size=world.world_size,
        role=plan.role,
        device=plan.device,
        roles=tuple(p.role for p in plans),
        rendezvous=(world.master_addr, world.master_port, f"{world.scope}/point{point}"),
        host=socket.gethostname(),
        node=plan.node,
        cpu_core=None,
    )


def serve_rank(world: World, cluster_cfg, read_config: Callable[[dict], Any]) -> None:
    """A rank other than 0: serve every point rank 0 launches, until it says the run is over.
    `read_config`: a point's Serving from the dict rank 0 sends (handed in: the root config is above)."""
    store = connect_store(world, cluster_cfg.start_timeout_s)
    token = run_token(store, world)
    bind, beat = bind_address(cluster_cfg.bind, world), cluster_cfg.heartbeat_s
    keys = run_keys(store, world)
    ctx = zmq.Context()
    guard = Guard(ctx, keys)
    try:
        agent = Inbox(ctx, bind, token, beat, f"rank{world.rank}", keys)
        publish(store, f"{world.scope}/agent/{world.rank}", agent.address)
        publish(store, f"{world.scope}/host/{world.rank}", socket.gethostname())
        driver = Outbox(
            ctx, lookup(store, f"{world.scope}/driver", cluster_cfg.start_timeout_s), token, beat, "rank 0", keys, 0
        )
        log.info(
            f"torchrun rank {world.rank} (node {world.node}, host {socket.gethostname()}): messages on {agent.address}"
        )
        while not _serve_next(world, cluster_cfg, (token, keys), bind, agent, driver, store, read_config):
            pass
    except LookupError:
        raise RankLost(
            f"rank {world.rank} stops: rank 0 did not start within {cluster_cfg.start_timeout_s:.0f} s "
            "(cluster.start_timeout_s)"
        ) from None
    finally:
        guard.stop()
        ctx.destroy(linger=LINGER_MS)


def _serve_next(
    world: World,
    cluster_cfg,
    secrets: tuple,
    bind: str,
    agent: Inbox,
    driver: Outbox,
    store,
    read_config: Callable[[dict], Any],
) -> bool:
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
        _serve_point(world, cluster_cfg, secrets, bind, msg, read_config)
    return False


def _serve_point(
    world: World, cluster_cfg, secrets: tuple, bind: str, launch: Launch, read_config: Callable[[dict], Any]
) -> None:
    """(secrets: the run token and this rank's CURVE keys)"""
    from testbed.cluster.layout import plan_ranks
    from testbed.cluster.lifecycle import worker_template

    cfg = read_config(launch.config)
    plans = plan_ranks(cfg.mode, cfg.cluster, cfg.hardware, world)
    mesh = MeshPlan(
        secrets[0],
        bind,
        cluster_cfg.heartbeat_s,
        (world.master_addr, world.master_port),
        f"{world.scope}/point{launch.point}",
        cluster_cfg.start_timeout_s,
        secrets[1],
    )
    on_interrupt = signal.getsignal(signal.SIGINT)
    try:
        net_worker_main(rank_spec(worker_template(cfg), plans, world.rank, world, launch.point), mesh)
    except RouterLost as lost:
        raise RankLost(str(lost)) from None
    finally:
        signal.signal(signal.SIGINT, on_interrupt)  # the worker ignores Ctrl-C while it serves
