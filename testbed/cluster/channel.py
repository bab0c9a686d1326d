"""Worker -> router reports over one pipe per worker.

A pipe write happens in the caller's thread: no feeder thread that, behind a busy step, waits
out the interpreter's GIL switch interval (milliseconds of harness delay on a token event).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from multiprocessing.connection import Connection, wait


class ReportWriter:
    """The worker's end: `put(msg)` sends at once."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send(msg)


class ReportReader:
    """The router's end: messages from every worker, `get(timeout)` like a queue. `last_read` is
    when the message `get` returned came off its pipe (for the harness-delay breakdown)."""

    def __init__(self, conns: list[Connection]):
        self.conns = list(conns)
        self.ready: deque = deque()
        self.last_read = 0.0

    def add(self, conn: Connection) -> None:
        """One more source: a server's request handlers wake the router through it."""
        self.conns.append(conn)

    def get(self, timeout: float | None = None):
        if not self.ready:
            for conn in wait(self.conns, timeout):
                self._read(conn)
        if not self.ready:
            raise queue.Empty
        msg, self.last_read = self.ready.popleft()
        return msg

    def get_nowait(self):
        return self.get(timeout=0)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                self.ready.append((conn.recv(), time.perf_counter()))
        except (EOFError, OSError):  # the worker is gone; the liveness check reports it
            self.conns.remove(conn)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
