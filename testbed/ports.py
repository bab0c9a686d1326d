"""A free TCP port on the loopback interface, for a torch.distributed rendezvous.

Its own module so that code which only needs a port (the KV-transfer benchmarks, the launcher)
does not import the process and worker code that lives beside the launcher.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody holds now: picked per run, so two runs on one machine never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
