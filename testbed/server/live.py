"""The router of a server: requests come from HTTP handlers while the run lasts, instead of
from a workload at its arrival times, and their tokens go back to each handler as the steps
report them.

It runs in a thread of its own. Handlers hand it requests through a queue and wake it with a
byte on a pipe it waits on beside the workers' report pipes, so a new request is admitted at
once, not at the next poll. Every rule (admission, dispatch, binding, token order, endings)
stays in the request book, as for a replayed workload.
"""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing import Pipe
from typing import Optional, Protocol

from testbed.cluster.launcher import Cluster
from testbed.cluster.router import LIVENESS_CHECK_S, Router
from testbed.config import Config
from testbed.control.request import Tracked
from testbed.metrics.events import RequestLog
from testbed.workload import Request
from testbed.workload.builder import empty_workload


class Sink(Protocol):
    """Where one request's tokens go (called in the router's thread)."""

    def tokens(self, token_ids: list[int]) -> None: ...

    def end(self, status: str, reason: str) -> None: ...


class Wake:
    """The byte that wakes the router: look at the queue of submissions."""


class LiveRouter(Router):
    def __init__(self, cluster: Cluster, log: RequestLog, cfg: Config, t0: float):
        super().__init__(
            cluster,
            empty_workload(),
            log,
            cfg.mode,
            cfg.cluster,
            cfg.kv_transfer,
            t0,
            cfg.faults,
            block_size=cfg.engine.block_size,
            tenants=cfg.workload.tenants,
        )
        reader, self._bell = Pipe(duplex=False)
        cluster.events.add(reader)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, tuple[Sink, int]] = {}  # rid -> (its sink, tokens handed over)
        self.handed_over: set[int] = set()  # requests the engine finished whose last tokens went to their handler
        self.stopping = False
        self.error: Optional[BaseException] = None
        self._closed = False  # the router thread has ended: a submission would wait forever
        self._gate = threading.Lock()  # orders a submission against that ending

    # -- called from the HTTP thread ------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        with self._gate:
            if not self._closed:
                self._post(("submit", request, sink))
                return
        sink.end("failed", f"server stopped: {self.error or 'shutting down'}")

    def cancel(self, rid: int, reason: str) -> None:
        self._post(("cancel", rid, reason))

    def delivered(self, rid: int) -> None:
        """Its handler sent the whole answer: a later cancel changes nothing."""
        self._post(("delivered", rid))

    def stop(self) -> None:
        self._post(("stop",))

    def _post(self, item: tuple) -> None:
        self._inbox.put(item)
        self._bell.send(Wake())

    # -- the router's thread ----------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Until stop(): admit, pump reports, hand tokens over; a crash ends every open stream."""
        try:
            while not self.stopping:
                self._pump(LIVENESS_CHECK_S)
                now = time.perf_counter()
                self._inject(now - self.t0)
                self._watch(now)
        except BaseException as error:  # a worker crashed: no stream may wait forever
            self.error = error
        finally:
            self._close()

    def _close(self) -> None:
        """End every stream, open or still queued; later submissions end at once (submit)."""
        with self._gate:
            self._closed = True
        reason = f"server stopped: {self.error or 'shutting down'}"
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "submit":
                item[2].end("failed", reason)
        for rid in list(self.streams):
            self._end(rid, "failed", reason)

    def handle(self, msg) -> None:
        if isinstance(msg, Wake):
            self._drain()
        else:
            super().handle(msg)

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submit":
                self._submit(item[1], item[2])
            elif item[0] == "cancel":
                self._cancel(item[1], item[2])
            elif item[0] == "delivered":
                self.handed_over.discard(item[1])
            else:
                self.stopping = True
                for rid in list(self.book.active):
                    self._fail(rid, time.perf_counter(), "server stopping")

    def _cancel(self, rid: int, reason: str) -> None:
        """The client went away: a running request is failed (its KV freed on every worker); one the
        engine had finished but whose stream never reached the client is recorded as failed too (the
        log lets a failure override "ok"), so the record does not depend on which came first."""
        if self.book.get(rid) is not None:
            self._fail(rid, time.perf_counter(), reason)
        elif rid in self.handed_over:
            self.handed_over.discard(rid)
            self.log.fail(rid, time.perf_counter(), reason)

    def _submit(self, request: Request, sink: Sink) -> None:
        if self.stopping:  # behind the stop in the queue: never admitted, so nothing to abort
            sink.end("failed", "server stopping")
            return
        self.streams[request.request_id] = (sink, 0)
        self._admit(request)
        if self.book.get(request.request_id) is None and request.request_id in self.streams:
            self._end(request.request_id, "rejected", "refused by the server's admission control")

    def _on_step(self, ev) -> None:
        super()._on_step(ev)
        for rid in list(self.streams):
            tracked = self.book.get(rid)
            if tracked is not None:
                self._hand_over(rid, tracked)

    def _hand_over(self, rid: int, tracked: Tracked) -> None:
        sink, sent = self.streams[rid]
        if len(tracked.output) > sent:
            sink.tokens(list(tracked.output[sent:]))
            self.streams[rid] = (sink, len(tracked.output))

    # -- endings ----------------------------------------------------------------------------------
    def _finished(self, tracked: Tracked, t: float) -> None:
        self.on_finish()
        if tracked.rid in self.streams:
            self._hand_over(tracked.rid, tracked)
            self._end(tracked.rid, "ok", "")
            self.handed_over.add(tracked.rid)

    def _fail(self, rid: int, t: float, reason: str) -> None:
        super()._fail(rid, t, reason)
        if rid in self.streams:
            self._end(rid, "failed", reason)

    def _end(self, rid: int, status: str, reason: str) -> None:
        sink, _ = self.streams.pop(rid)
        sink.end(status, reason)
