"""Messages between hosts over ZeroMQ: one bound PULL socket per receiver, one PUSH
socket per (sender, receiver) pair, every frame in the versioned JSON of `testbed.net.wire`.

Why ZeroMQ (measured in `python -m testbed.bench.messages`, README "Across hosts"): its I/O thread
frames, queues and reconnects without the sender waiting on the receiver, which a worker in the
middle of a step needs; and its own heartbeats (ZMTP PING/PONG, answered by that thread even while
Python is busy) notice a dead or unreachable peer. A frame that does not decode is dropped, counted
by reason and logged; a connection that does not speak ZMTP (a port scanner, a stray `nc`), or
that lacks the run's CURVE keys (testbed/net/curve.py), never gets past ZeroMQ's handshake, and
the socket monitor counts and logs it. `refused_counts()` is this process's tally for meta.json.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

from testbed.errors import PeerLost
from testbed.net import curve, wire
from testbed.net.channel import Reports

log = logging.getLogger("testbed.control")
LINGER_MS = 2000  # a closing socket still delivers its last frames (the KV audit), but never hangs a stop
MAX_LOGGED = 20  # refused frames logged one by one; beyond that only counted
MAX_FRAME = wire.MAX_FRAME  # a larger frame (from anyone) is refused before it is buffered or parsed
REFUSED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a ZeroMQ peer",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
}


def _options(sock: zmq.Socket, heartbeat_s: float) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    # a full queue towards a peer that stopped reading fails a send after the heartbeats would have
    # declared it dead, instead of blocking the sender forever
    sock.setsockopt(zmq.SNDTIMEO, int(5 * heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(5 * heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(5 * heartbeat_s * 1000))
    return sock


# this process's refusals so far: inbox name -> {reason: count} (the results' meta.json reports them)
REFUSED: dict[str, Counter] = {}


def refused_counts() -> dict[str, dict[str, int]]:
    """Every inbox of this process that turned something away: {name: {reason: count}}."""
    return {name: dict(counts) for name, counts in REFUSED.items() if counts}


class Inbox(Reports):
    """A bound PULL socket: `get(timeout)` / `get_nowait()` like a queue (testbed/net/channel.py);
    `refused` counts the frames and connections turned away, `refused_by` the same by reason."""

    def __init__(
        self, ctx: zmq.Context, host: str, token: str, heartbeat_s: float, name: str, keys: curve.Keys | None = None
    ):
        super().__init__()
        self.token, self.name = token, name
        self.sock = _options(ctx.socket(zmq.PULL), heartbeat_s)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        curve.serve(self.sock, keys)  # with keys: only the run's ranks get past the handshake (curve.Guard)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.monitor = self.sock.get_monitor_socket(sum(REFUSED_EVENTS))
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.refused_by: Counter = Counter()  # this inbox's own (REFUSED: the process's, by inbox name)

    @property
    def refused(self) -> int:
        return sum(self.refused_by.values())

    def _fill(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            events = dict(self.poller.poll(None if left is None else int(left * 1000)))
            if self.monitor in events:
                self._log_refused_connections()
            if self.sock in events:
                self._take_frames()
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _take_frames(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.ready.append((wire.decode(frame, self.token), time.perf_counter()))
            except wire.BadMessage as why:
                self._refuse(why.reason, f"a {len(frame)}-byte frame: {why}")

    def _log_refused_connections(self) -> None:
        """A connection that fails ZeroMQ's handshake (it sent something else) is refused."""
        while self.monitor.poll(0):
            reason = REFUSED_EVENTS[recv_monitor_message(self.monitor)["event"]]
            self._refuse(reason, f"a connection: {reason}")

    def _refuse(self, reason: str, what: str) -> None:
        self.refused_by[reason] += 1
        REFUSED.setdefault(self.name, Counter())[reason] += 1
        if self.refused <= MAX_LOGGED:
            log.warning(f"messages {self.name} ({self.address}) dropped {what} (refused so far: {self.refused})")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()


class Outbox:
    """A PUSH socket connected to one receiver's Inbox: `put(msg)` hands the frame to ZeroMQ's I/O
    thread at once. `lost()` is true once the connection to a receiver that was reached has dropped
    (the process died, or its host stopped answering heartbeats)."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        token: str,
        heartbeat_s: float,
        peer: str = "a peer",
        keys: curve.Keys | None = None,
        rank: int | None = None,
    ):
        self.token, self.address, self.peer, self.timeout_s = token, address, peer, 5 * heartbeat_s
        self.sock = _options(ctx.socket(zmq.PUSH), heartbeat_s)
        curve.connect(self.sock, keys, rank)  # with keys: the receiver must hold rank `rank`'s secret key
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.connected = self.disconnected = False

    def put(self, msg) -> None:
        try:
            self.sock.send(wire.encode(msg, self.token))
        except zmq.Again:
            raise PeerLost(
                f"{self.peer} ({self.address}) took no message for {self.timeout_s:.0f} s (5 x cluster.heartbeat_s)"
            ) from None

    def lost(self) -> bool:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.connected = self.connected or event == zmq.EVENT_CONNECTED
            self.disconnected = self.disconnected or (self.connected and event == zmq.EVENT_DISCONNECTED)
        return self.disconnected

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()


class Mesh:
    """One process's message endpoints for one serving point: its own Inbox and an Outbox to each
    peer it sends to, indexed like the single-box launcher's queue list (`mesh[rank].put(msg)`,
    `mesh[own rank].get()`), so the worker and the KV connector do not know which they hold."""

    def __init__(self, inbox: Inbox, outboxes: dict[int, Outbox], own: int):
        self.inbox, self.outboxes, self.own = inbox, outboxes, own

    def __getitem__(self, rank: int):
        return self.inbox if rank == self.own else self.outboxes[rank]

    def close(self) -> None:
        for box in self.outboxes.values():
            box.close()
        self.inbox.close()
