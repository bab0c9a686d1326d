"""Where this process stands in a torchrun job, and the rendezvous store every rank shares.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and
MASTER_ADDR/MASTER_PORT (its rendezvous store). Global rank 0 makes the run's token and puts it
in the store; every control endpoint's address goes there too, so no port is fixed anywhere.
The store is the trust anchor: whoever can read it holds the token that every frame must carry.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta

from testbed.errors import ConfigError

TOKEN_KEY = "testbed/token"


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (every rank is its client)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        """torchrun numbers ranks node by node: rank = node * nproc_per_node + local rank."""
        return rank // self.local_world_size


def torchrun_world(env=os.environ) -> World | None:
    """This process's place in a torchrun job; None when not started by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env:
        return None
    try:
        return World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]),
                     int(env.get("GROUP_RANK", 0)), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                     env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    except KeyError as missing:
        raise ConfigError(f"started by torchrun but {missing} is not set; start with torchrun --nnodes=N "
                          "--nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m testbed") from None


def bind_address(requested: str | None, world: World) -> str:
    """cluster.bind, else the interface that reaches the rendezvous host (never every interface by default)."""
    if requested:
        if requested in ("0.0.0.0", "::", "*"):
            raise ConfigError(f"cluster.bind={requested} would listen on every interface; name one "
                              "address of this host (the one the other nodes reach it by)")
        return requested
    host = world.master_addr
    if host == "localhost" or _is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet sent: routing only
        probe.connect((host, world.master_port))
        return probe.getsockname()[0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_store(world: World, timeout_s: float):
    """A client (or, for rank 0 when torchrun's agent does not host it, the server) of the store."""
    import torch.distributed as dist

    is_server = world.rank == 0 and not world.agent_store
    return dist.TCPStore(world.master_addr, world.master_port, world.world_size if is_server else None,
                         is_master=is_server, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def run_token(store, world: World) -> str:
    """Rank 0 makes the run's token; the others wait for it (up to the store's timeout)."""
    if world.rank == 0:
        token = secrets.token_hex(16)
        store.set(TOKEN_KEY, token)
        return token
    return store.get(TOKEN_KEY).decode()


def publish(store, key: str, value: str) -> None:
    store.set(f"testbed/{key}", value)


def lookup(store, key: str) -> str:
    """Blocks until someone publishes `key` (or the store's timeout passes)."""
    return store.get(f"testbed/{key}").decode()
