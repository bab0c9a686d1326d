"""Chaos across hosts, under the two-"node" torchrun run on 127.0.0.1: a stranger on every message
port of the run (raw garbage, ZeroMQ frames without keys: garbage, too deep, too large, a frame
replayed from an earlier run; CURVE with keys the run does not know) while the run serves. The run
completes with every request served, no rank dies, the KV audit is clean, and meta.json counts
what each rank turned away. (A killed node: tests/cluster/test_torchrun.py.)"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest
import zmq

from testbed.net import wire
from testbed.net.messages import Stop
from tests.cluster.test_torchrun import DEADLINE_S, WORKLOAD, finish, torchrun
from tests.paths import error_lines

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")]
SCOPE = "none-0"  # torchrun's run id under a static rendezvous, restart 0
LONG = [o for o in WORKLOAD if not o.startswith(("workload.num_requests", "workload.rate"))] + [
    "workload.num_requests=240",
    "workload.rate=24",
]


def store_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=DEADLINE_S), wait_for_workers=False
    )


def read(store, key: str) -> str:
    """A key of the run, once it is published (polled, like the ranks do)."""
    deadline = time.monotonic() + DEADLINE_S
    while not store.check([f"testbed/{SCOPE}/{key}"]):
        assert time.monotonic() < deadline, f"{key} was never published"
        time.sleep(0.1)
    return store.get(f"testbed/{SCOPE}/{key}").decode()


def attack(address: str, server_key: bytes) -> None:
    """Everything a stranger on the network can send to one message port; returns once each ZeroMQ
    connection has had its answer: turned away by the port (its handshake failed), or refused because
    the port has closed (its point ended: nothing left to attack), or a minute has passed."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(os.urandom(1 << 16))
    except ConnectionRefusedError:
        return  # the port has closed (its point ended): nothing left to attack
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PUSH)  # no keys
    keyed = ctx.socket(zmq.PUSH)  # CURVE, the port's public key, keys of its own
    keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
    keyed.curve_serverkey = server_key
    monitors = [sock.get_monitor_socket(FAILED | REFUSED) for sock in (plain, keyed)]
    for sock in (plain, keyed):
        sock.connect(address)
    frames = (os.urandom(512), b"[" * 100_000, b"x" * (wire.MAX_FRAME + 1), wire.encode(Stop(), "e" * 32))
    for sock, frame in [(plain, f) for f in frames] + [(keyed, frames[-1])]:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # nowhere to queue it: the handshake has not let it through
            pass
    deadline = time.monotonic() + 60
    for monitor in monitors:
        monitor.poll(max(0, 1000 * (deadline - time.monotonic())))
        monitor.close(linger=0)
    for sock in (plain, keyed):
        sock.close(linger=0)
    ctx.term()


FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# a connection attempt that did not connect (the port has closed: refused); ZeroMQ retries it forever
REFUSED = zmq.EVENT_CLOSED


def test_a_stranger_on_every_message_port_changes_nothing(tmp_path):
    from testbed.ports import free_port

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    port = free_port()
    nodes = [
        torchrun(n, port, cwd, tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "mode=disagg", *LONG) for n in (0, 1)
    ]
    try:
        store = store_client(port)
        keys = {rank: read(store, f"curve/{rank}").encode() for rank in (0, 1)}
        ports = {
            "router": (read(store, "point1/events"), keys[0]),  # first: read while the point runs
            "worker0": (read(store, "point1/inbox/0"), keys[0]),
            "worker1": (read(store, "point1/inbox/1"), keys[1]),
            "driver": (read(store, "driver"), keys[0]),
            "agent1": (read(store, "agent/1"), keys[1]),
        }
        for address, key in ports.values():
            attack(address, key)
    finally:
        codes = finish(nodes)
    assert codes == [0, 0], (tmp_path / "node0.err").read_text()[-3000:]
    run = tmp_path / "run"
    requests = pd.read_parquet(run / "requests.parquet")
    assert len(requests) == 240 and (requests.status == "ok").all()
    summary = json.loads((run / "summary.json").read_text())
    assert not any(summary["kv_blocks_leaked"].values())
    refused = json.loads((run / "meta.json").read_text())["messages_refused"]
    router = refused["0"].get("router", {})
    assert sum(router.values()) >= 2, refused  # the raw and the keyless connections, at least
    assert set(refused) == {"0", "1"}


def test_a_message_connection_reset_mid_run_is_survived_or_one_line(tmp_path):
    """Rank 0's connections to rank 1's worker inbox reset mid-run (`ss -K`, as a middlebox or a
    flapping link would): ZeroMQ reconnects; the run either completes, every request ending with
    its status and reason, or fails in one line naming the rank, and leaves nothing running."""
    import shutil
    import subprocess

    from testbed.ports import free_port
    from tests.cluster.test_torchrun import descendants, left_running, wait_for

    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to reset a connection")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    port = free_port()
    nodes = [
        torchrun(n, port, cwd, tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "mode=disagg", *LONG) for n in (0, 1)
    ]
    try:
        inbox = read(store_client(port), "point1/inbox/1")
        wait_for(tmp_path / "node0.err", "disagg requests")  # the router is replaying the workload
        family = descendants(nodes[0].pid) | descendants(nodes[1].pid)
        target = inbox.removeprefix("tcp://").rsplit(":", 1)[1]
        reset = subprocess.run(
            ["ss", "-K", "-t", "dst", "127.0.0.1", "dport", "=", f":{target}"], capture_output=True, text=True
        )
        if "ESTAB" not in reset.stdout:
            pytest.skip(f"this kernel cannot reset a connection from outside: {reset.stderr.strip()}")
    finally:
        codes = finish(nodes)
    errors = error_lines((tmp_path / "node0.err").read_text())
    if codes == [0, 0]:
        requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
        assert len(requests) == 240 and (requests.status == "ok").sum() + (requests.reason != "").sum() == 240
    else:
        assert len(errors) == 1 and "rank 1" in errors[0], (tmp_path / "node0.err").read_text()[-3000:]
        assert "message connection dropped" in errors[0], errors  # not "its process is gone": it is not
    assert not left_running(family)
    print(f"connection reset: exit codes {codes}; {errors[0] if errors else 'completed'}")
