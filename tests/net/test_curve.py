"""The control plane's CURVE: only the run's ranks connect to a control port, nothing of a stranger's
reaches a handler, a frame of an earlier run is refused, and across hosts a libzmq without CURVE
is refused in one line; cluster.bind names an address or an interface."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import zmq

from testbed.errors import ConfigError
from testbed.net import curve, wire
from testbed.net.messages import Heartbeat, Stop
from testbed.net.rendezvous import World, bind_address
from testbed.net.transport import Inbox, Outbox
from tests.cluster_helpers import read_until

pytestmark = pytest.mark.skipif(not curve.available(), reason="libzmq without CURVE")
TOKEN = "c" * 32


def run_keys(ranks: int = 2) -> list[curve.Keys]:
    pairs = [zmq.curve_keypair() for _ in range(ranks)]
    peers = tuple(public for public, _ in pairs)
    return [curve.Keys(public, secret, peers) for public, secret in pairs]


def test_only_the_runs_keys_connect_and_no_strangers_frame_reaches_a_handler():
    ours, theirs = run_keys(), run_keys()  # theirs: a stranger that made keys of its own (or an earlier run)
    ctx = zmq.Context()
    guard = curve.Guard(ctx, ours[0])
    box = Inbox(ctx, "127.0.0.1", TOKEN, 0.5, "rank0", ours[0])
    good_frame = wire.encode(Stop(), TOKEN)
    plain = ctx.socket(zmq.PUSH)  # no CURVE at all, the right token: the handshake fails
    plain.connect(box.address)
    plain.send(good_frame)
    stranger = ctx.socket(zmq.PUSH)  # CURVE with the server's public key but keys the run does not know
    curve.connect(stranger, dataclasses.replace(theirs[1], peers=(ours[0].public,)), 0)
    stranger.connect(box.address)
    stranger.send(good_frame)
    earlier = Outbox(ctx, box.address, TOKEN, 0.5, "rank 1", ours[1], 0)
    earlier.sock.send(wire.encode(Stop(), "d" * 32))  # a frame recorded in an earlier run, replayed by a rank
    member = Outbox(ctx, box.address, TOKEN, 0.5, "rank 1", ours[1], 0)
    member.put(Heartbeat(1, 2.0))
    got = read_until(
        box,
        lambda got: (
            got
            and box.refused_by["authentication failed"] >= 1
            and box.refused_by["wrong or missing run token"] >= 1
            and sum(box.refused_by.values()) >= 3
        ),
    )
    assert got == [Heartbeat(1, 2.0)], got  # the run's one message, nothing of the others
    assert box.refused_by["authentication failed"] >= 1 and box.refused_by["wrong or missing run token"] == 1
    assert sum(box.refused_by.values()) >= 3, box.refused_by  # the plain one fails its handshake too
    for sock in (plain, stranger):
        sock.close(linger=0)
    earlier.close()
    member.close()
    box.close()
    guard.stop()
    ctx.term()


def test_a_sender_that_does_not_know_the_receivers_key_reaches_nobody():
    ours = run_keys()
    ctx = zmq.Context()
    guard = curve.Guard(ctx, ours[0])
    box = Inbox(ctx, "127.0.0.1", TOKEN, 0.5, "rank0", ours[0])
    wrong = dataclasses.replace(ours[1], peers=(zmq.curve_keypair()[0],))  # expects another server
    impostor = Outbox(ctx, box.address, TOKEN, 0.5, "rank 1", wrong, 0)
    impostor.put(Heartbeat(1, 1.0))
    member = Outbox(ctx, box.address, TOKEN, 0.5, "rank 1", ours[1], 0)
    member.put(Heartbeat(1, 3.0))
    assert read_until(box, lambda got: Heartbeat(1, 3.0) in got) == [Heartbeat(1, 3.0)]
    for out in (impostor, member):
        out.close()
    box.close()
    guard.stop()
    ctx.term()


def test_across_hosts_without_curve_is_one_line(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: False)
    with pytest.raises(ConfigError, match="needs CURVE") as refused:
        curve.make_keys(spans_hosts=True)
    assert "\n" not in str(refused.value)
    assert curve.make_keys(spans_hosts=False) is None  # one box: local sockets without it


def world(master: str = "10.1.2.3") -> World:
    return World(0, 4, 0, 2, 0, master, 29500, True)


def test_bind_takes_an_interface_name_and_refuses_what_peers_cannot_reach():
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    assert bind_address(loopback, world("127.0.0.1")) == "127.0.0.1"  # its address, not tcp://lo:PORT
    with pytest.raises(ConfigError, match=r"neither an address nor an interface of this host; interfaces: .*lo"):
        bind_address("eth-none", world())
    with pytest.raises(ConfigError, match="other nodes cannot reach"):  # across hosts: loopback refused
        bind_address(loopback, world())
    with pytest.raises(ConfigError, match="every interface"):
        bind_address("0.0.0.0", world())
    assert bind_address("10.1.2.4", world()) == "10.1.2.4"


class Relay:
    """A TCP relay between a sender and a message port that records what the sender put on the wire."""

    def __init__(self, target: str):
        import threading

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.seen = (host, int(port)), bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()
        self._pump(client, server, self.seen)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record) -> None:
        try:
            while data := source.recv(65536):
                if record is not None:
                    record += data
                sink.sendall(data)
        except OSError:
            pass  # either end closed


@pytest.mark.parametrize("encrypted", [True, False])
def test_no_token_in_clear_on_the_wire(encrypted):
    ours = run_keys()
    ctx = zmq.Context()
    guard = curve.Guard(ctx, ours[0] if encrypted else None)
    box = Inbox(ctx, "127.0.0.1", TOKEN, 0.5, "rank0", ours[0] if encrypted else None)
    relay = Relay(box.address)
    out = Outbox(ctx, relay.address, TOKEN, 0.5, "rank 1", ours[1] if encrypted else None, 0)
    out.put(Heartbeat(1, 4.0))
    assert read_until(box, bool) == [Heartbeat(1, 4.0)]
    wire_bytes = bytes(relay.seen)
    # with CURVE neither the token nor the message is readable; without it (one box only) both are
    assert (TOKEN.encode() in wire_bytes, b"Heartbeat" in wire_bytes) == (not encrypted, not encrypted)
    out.close()
    box.close()
    guard.stop()
    ctx.term()
