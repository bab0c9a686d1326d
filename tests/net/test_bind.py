"""Bind where asked (issue 43): the rendezvous store and every other socket of a run listen on the
interface the run was given, never on every interface (torch's TCPStore, given only a port, does)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from testbed.net.rendezvous import World, connect_store
from testbed.ports import free_port
from tests.cluster_helpers import make_config, small_workload

LISTEN = "0A"  # the TCP state in /proc/net/tcp


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed while listing
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.append((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """/proc/net's hex form (each 32-bit word in host order, little-endian here) as an address."""
    raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    return str(ipaddress.ip_address(raw))


def wildcard(found: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(a, p) for a, p in found if ipaddress.ip_address(a).is_unspecified]


def test_rank_0s_store_listens_on_the_rendezvous_address_alone():
    port = free_port()
    world = World(0, 2, 0, 1, 0, "127.0.0.1", port, agent_store=False)
    store = connect_store(world, 10.0)
    try:
        ours = [(a, p) for a, p in listening([os.getpid()]) if p == port]
        assert ours == [("127.0.0.1", port)]
    finally:
        del store


def test_a_clusters_processes_listen_on_the_loopback_alone():
    """One box: the driver's and every worker's listening sockets (the process group's store among
    them) are on 127.0.0.1."""
    from testbed.studies.real_cluster import start_cluster

    cfg = make_config(*small_workload(), "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1")
    with start_cluster(cfg) as cluster:
        found = listening([os.getpid(), *(p.pid for p in cluster.processes)])
        assert found and not wildcard(found), found
        cluster.stop([])


class ChildStarts(Exception):
    """Raised where a benchmark would start its other processes: the test looks at what listens then."""


def test_the_benchmarks_host_their_rendezvous_on_the_loopback_alone(monkeypatch):
    """python -m testbed.measure.kv_transfer and testbed.bench.messages: the store their processes meet through
    listens on 127.0.0.1 alone, hosted before the other processes start and handed to them by port."""
    import multiprocessing

    import torch.multiprocessing

    from testbed.bench import messages
    from testbed.measure import kv_transfer

    handed = []

    def start(target, args, **_):
        handed.append((target.__name__, args[0], listening([os.getpid()])))
        raise ChildStarts

    class Spawn:
        def Process(self, target, args, daemon):  # noqa: N802 - multiprocessing's name
            return type("Child", (), {"start": lambda _: start(target, args)})()

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start)
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: Spawn())
    for bench in (
        lambda: kv_transfer.measure(1, 1, ipc=False),
        lambda: messages.time_store(1),
        lambda: messages.time_gloo(1),
    ):
        with pytest.raises(ChildStarts):
            bench()
    assert [name for name, _, _ in handed] == ["run_rank", "echo_store", "echo_gloo"]
    for name, port, found in handed:
        assert [address for address, p in found if p == port] == ["127.0.0.1"], (name, found)
