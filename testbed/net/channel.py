"""Worker -> router reports over one pipe per worker.

A pipe write happens in the caller's thread: no feeder thread that, behind a busy step, waits
out the interpreter's GIL switch interval (milliseconds of harness delay on a token event).
"""

from __future__ import annotations

import queue
import time
from abc import ABC, abstractmethod
from collections import deque
from multiprocessing.connection import Connection, wait


class ReportWriter:
    """The worker's end: `put(msg)` sends at once."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send(msg)


class Reports(ABC):
    """`get(timeout)` like a queue over messages a subclass's `_fill(timeout)` reads into `ready`
    as (message, when it came off the wire); `last_read` is that time for the message `get`
    returned (for the harness-delay breakdown)."""

    def __init__(self):
        self.ready: deque = deque()
        self.last_read = 0.0

    def get(self, timeout: float | None = None):
        if not self.ready:
            self._fill(timeout)
        if not self.ready:
            raise queue.Empty
        msg, self.last_read = self.ready.popleft()
        return msg

    def get_nowait(self):
        return self.get(timeout=0)

    @abstractmethod
    def _fill(self, timeout: float | None) -> None:
        """Read what has arrived (waiting up to `timeout`) into `ready`."""


class ReportReader(Reports):
    """The router's end: messages from every worker's pipe."""

    def __init__(self, conns: list[Connection]):
        super().__init__()
        self.conns = list(conns)

    def add(self, conn: Connection) -> None:
        """One more source: a server's request handlers wake the router through it."""
        self.conns.append(conn)

    def _fill(self, timeout: float | None) -> None:
        for conn in wait(self.conns, timeout):
            self._read(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                self.ready.append((conn.recv(), time.perf_counter()))
        except (EOFError, OSError):  # the worker is gone; the liveness check reports it
            self.conns.remove(conn)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
