"""Where this process stands in a torchrun job, and the rendezvous store every rank shares.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and
MASTER_ADDR/MASTER_PORT (its rendezvous store). Global rank 0 makes the run's token and puts it
in the store; every message endpoint's address goes there too, so no port is fixed anywhere.
The store is the trust anchor: whoever can read it holds the token that every frame must carry.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from testbed.errors import ConfigError

POLL_S = 0.05  # how often a lookup looks at the store, and at whether its publisher is still there
STORE_BACKLOG = 512  # every rank connects at once at start-up


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
    scope: str = "none-0"  # torchrun's run id and restart count: one job's keys never meet another's

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
        return World(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env["LOCAL_RANK"]),
            int(env["LOCAL_WORLD_SIZE"]),
            int(env.get("GROUP_RANK", 0)),
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            f"{env.get('TORCHELASTIC_RUN_ID', 'none')}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        )
    except KeyError as missing:
        raise ConfigError(
            f"started by torchrun but {missing} is not set; start with torchrun --nnodes=N "
            "--nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m testbed"
        ) from None


def spans_hosts(world: World) -> bool:
    """Ranks on more than one node that meet at a rendezvous host peers reach over a network (two
    "nodes" on this host's loopback do not)."""
    return world.num_nodes > 1 and not (world.master_addr == "localhost" or _is_loopback(world.master_addr))


def bind_address(requested: str | None, world: World) -> str:
    """cluster.bind (an address, or an interface name: its address), else the interface that reaches
    the rendezvous host (never every interface by default)."""
    if requested in ("0.0.0.0", "::", "*"):
        raise ConfigError(
            f"cluster.bind={requested} would listen on every interface; name one "
            "address of this host (the one the other nodes reach it by)"
        )
    address = _address_of(requested) if requested else _route_to(world.master_addr, world.master_port)
    if spans_hosts(world) and _is_loopback(address):
        raise ConfigError(
            f"the message sockets would listen on {address}, which other nodes cannot reach "
            f"(MASTER_ADDR={world.master_addr}); set cluster.bind to this host's address on the "
            "cluster network"
        )
    return address


def _address_of(requested: str) -> str:
    """An IP address as given; an interface name as its IPv4 address; anything else refused, naming
    the interfaces there are (a name published as tcp://eth0:PORT reaches no peer)."""
    try:
        return str(ipaddress.ip_address(requested))
    except ValueError:
        pass
    names = [name for _, name in socket.if_nameindex()]
    if requested in names:
        found = _interface_ipv4(requested)
        if found:
            return found
        raise ConfigError(f"cluster.bind={requested}: that interface has no IPv4 address; name an address instead")
    raise ConfigError(
        f"cluster.bind={requested!r} is neither an address nor an interface of this host; "
        f"interfaces: {', '.join(names)}"
    )


def _interface_ipv4(name: str) -> str | None:
    """The IPv4 address of interface `name` (Linux SIOCGIFADDR), None when it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    if host == "localhost" or _is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_store(world: World, timeout_s: float):
    """A client (or, for rank 0 when torchrun's agent does not host it, the server) of the store."""
    if world.rank == 0 and not world.agent_store:
        return host_store(world.master_addr, world.master_port, world.world_size, timeout_s)
    return store_client(world.master_addr, world.master_port, timeout_s)


def host_store(host: str, port: int, world_size: int | None, timeout_s: float):
    """The store's server, listening on `host`'s interface alone: TCPStore given only a port listens
    on every interface, so it is handed a socket bound here (port 0: a free one, store.port)."""
    import torch.distributed as dist

    address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]  # a name (localhost) resolved
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(STORE_BACKLOG)
        store = dist.TCPStore(
            address,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now, and closes it
    return store


def store_client(host: str, port: int, timeout_s: float):
    """A client of the rendezvous store (every worker process, whoever hosts the store)."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def run_token(store, world: World) -> str:
    """Rank 0 makes the run's token; the others wait for it (up to the store's timeout)."""
    key = f"{world.scope}/token"
    if world.rank == 0:
        token = secrets.token_hex(16)
        publish(store, key, token)
        return token
    return lookup(store, key, float(store.timeout.total_seconds()))


def run_keys(store, world: World, find: Callable[[str, int], str] | None = None):
    """This rank's CURVE key pair and every rank's public key, exchanged through the store (only
    public halves are published); None on one box without CURVE (testbed/net/curve.py).
    `find(key, rank)` reads a key of the run (default: wait up to the store's timeout)."""
    from testbed.net import curve

    pair = curve.make_keys(spans_hosts(world))
    if pair is None:
        return None
    publish(store, f"{world.scope}/curve/{world.rank}", pair[0].decode())
    timeout_s = float(store.timeout.total_seconds())
    find = find or (lambda key, rank: lookup(store, f"{world.scope}/{key}", timeout_s))
    peers = tuple(find(f"curve/{rank}", rank).encode() for rank in range(world.world_size))
    return curve.Keys(pair[0], pair[1], peers)


def publish(store, key: str, value: str) -> None:
    store.set(f"testbed/{key}", value)


def lookup(store, key: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> str:
    """The value someone publishes under `key`; LookupError when `alive()` turns false (the one who
    should publish it is gone) or `timeout_s` passes first."""
    full = f"testbed/{key}"
    deadline = time.monotonic() + timeout_s
    while not store.check([full]):  # polled: the store's own blocking wait logs every timed-out slice
        if not alive():
            raise LookupError(f"{key}: its publisher is gone")
        if time.monotonic() > deadline:
            raise LookupError(f"{key}: not published within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return store.get(full).decode()
