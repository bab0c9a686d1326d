"""CURVE on the control plane: every frame between ranks authenticated and encrypted.

Each rank makes its own key pair when the run starts and publishes only the public half in the
rendezvous store (the secret never leaves its process; rank 0's worker, a local child, is handed
rank 0's pair through its spawn arguments). Every inbox is a CURVE server whose ZAP handler accepts
only the run's public keys, and every outbox names the public key of the rank it sends to, so a
stranger can neither connect nor be connected to, and nothing on the wire (the run token in
the frames included) is in clear. A frame recorded in an earlier run is refused twice over: its
connection's keys are not this run's, and its token is another run's.

Without CURVE in the installed libzmq a run whose ranks span hosts is refused in one line; one box
(every rank on this host's loopback) runs without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from testbed.errors import ConfigError

log = logging.getLogger("testbed.control")


@dataclass(frozen=True)
class Keys:
    """This process's key pair and every rank's public key (index: the rank)."""

    public: bytes
    secret: bytes = field(repr=False)
    peers: tuple = ()


def available() -> bool:
    return bool(zmq.has("curve"))


def make_keys(spans_hosts: bool) -> tuple[bytes, bytes] | None:
    """A fresh key pair; None on one box without CURVE; ConfigError across hosts without it."""
    if available():
        return zmq.curve_keypair()
    if spans_hosts:
        raise ConfigError(
            f"the control plane across hosts needs CURVE, which this libzmq ({zmq.zmq_version()}) "
            "lacks; install a pyzmq wheel (it bundles libzmq with CURVE) or run on one host"
        )
    return None


def serve(sock: zmq.Socket, keys: Keys | None) -> None:
    """A bound socket as a CURVE server (before bind)."""
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = keys.secret, keys.public, True


def connect(sock: zmq.Socket, keys: Keys | None, rank: int | None) -> None:
    """A connecting socket as a CURVE client of rank `rank`'s inbox (before connect)."""
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.curve_serverkey = keys.peers[rank]


class Guard:
    """The ZAP handler of one ZeroMQ context: a connection is accepted only with one of the run's
    public keys (a refused one never reaches the socket; its monitor counts it)."""

    def __init__(self, ctx: zmq.Context, keys: Keys | None):
        self.allowed = frozenset(keys.peers) if keys is not None else frozenset()
        self.auth = None
        if keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("testbed.control.zap"))
            self.auth.start()
            self.auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
