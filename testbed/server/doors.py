"""The server's connections under abuse: how many it holds, how long an idle one may stay, what a
malformed request gets back, and what reaches the log.

- At most `cap` connections are open (http.max_connections, lowered to what `ulimit -n` leaves):
  past it the oldest connection with no request under way is closed (holding one costs a client
  nothing, so idle ones must not lock out /health), and with none such the newcomer gets 503.
- A connection with no whole request header for http.header_timeout_s is closed (aiohttp's
  keep-alive timer, which also runs from the moment a connection opens).
- Every error answer is OpenAI's JSON error object, aiohttp's own included, and is counted by status.
- The log gets one line per kind of trouble per interval, with a count, and never the client's bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from collections import Counter, OrderedDict
from typing import Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from testbed.errors import ConfigError
from testbed.http.protocol import error_body

log = logging.getLogger("testbed.server")
LOG_INTERVAL_S = 10.0  # one line per kind of trouble per interval, with the count since the last
FD_RESERVE = 32  # file descriptors kept for everything but client connections (the log, /proc reads, pipes)
MIN_CONNECTIONS = 4


class Throttled:
    """log.warning at most once per `interval_s` per kind, saying how often it happened meanwhile."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.unsaid: Counter = Counter()

    def warn(self, kind: str, line: str) -> None:
        self.unsaid[kind] += 1
        now = time.monotonic()
        if now - self.last.get(kind, -self.interval_s) < self.interval_s:
            return
        times = self.unsaid.pop(kind)
        self.last[kind] = now
        log.warning(f"{line} ({times} time{'s' if times > 1 else ''} since the last such line)")


def connection_cap(wanted: int, burst: int) -> int:
    """http.max_connections, lowered so that connections cannot exhaust the file descriptors.
    `burst`: connections accepted at once before any closing one lets its descriptor go (the
    event loop accepts up to the listen backlog per turn)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = soft - _fds_in_use() - FD_RESERVE - burst
    if room < MIN_CONNECTIONS:
        raise ConfigError(
            f"ulimit -n is {soft} and {_fds_in_use()} files are open: no room for HTTP connections; "
            f"raise it (ulimit -n 4096)"
        )
    if room < wanted:
        log.warning(
            f"http.max_connections={wanted} lowered to {room}: ulimit -n is {soft} and "
            f"{_fds_in_use()} files are open already"
        )
    return min(wanted, room)


def _fds_in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: count none, FD_RESERVE still stands
        return 0


class Doorman:
    """The open connections, oldest first, and what was turned away (status -> count)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.open: OrderedDict[Handler, None] = OrderedDict()
        self.refused: Counter = Counter()
        self.closed_idle = 0  # connections closed to make room for a newer one
        self.clients_gone = 0  # responses cut because the client hung up: not a refusal
        self.say = Throttled()

    def enter(self, handler: "Handler") -> bool:
        """Room for `handler`'s connection (made by closing the oldest idle one); False: none."""
        if len(self.open) >= self.cap:
            idle = next((h for h in self.open if not h.busy), None)
            if idle is None:
                self.refused[503] += 1
                self.say.warn("cap", f"a connection was refused: all http.max_connections={self.cap} are busy")
                return False
            self.open.pop(idle)
            self.closed_idle += 1
            idle.close_idle()
        self.open[handler] = None
        return True

    def leave(self, handler: "Handler") -> None:
        self.open.pop(handler, None)

    def handler_factory(self, server: web.Server, loop: asyncio.AbstractEventLoop, header_timeout_s: float):
        """What the listening socket makes each connection's protocol with (aiohttp's, guarded)."""
        return lambda: Handler(
            self, server, loop=loop, keepalive_timeout=header_timeout_s, access_log=None, logger=QUIET
        )

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Outermost: a request under way keeps its connection; every error answer is JSON, counted."""
        protocol = request.protocol
        if isinstance(protocol, Handler):
            protocol.busy += 1
        try:
            response = await handler(request)
        except web.HTTPException as error:  # aiohttp's own answers: 404, 405, 413 (client_max_size)
            response = json_error(_says(error), error.status)
        finally:
            if isinstance(protocol, Handler):
                protocol.busy -= 1
        if response.status >= 400:
            self.refused[response.status] += 1
        return response


def _says(error: web.HTTPException) -> str:
    """What aiohttp's own answer means, without the request's path or body in it."""
    if error.status == 404:
        return "no such endpoint; served here: POST /v1/completions, GET /v1/models, GET /health"
    if error.status == 405:
        return f"method not allowed here; allowed: {', '.join(sorted(getattr(error, 'allowed_methods', ())))}"
    return error.reason


def json_error(reason: str, status: int) -> web.Response:
    return web.Response(status=status, text=json.dumps(error_body(reason, status)), content_type="application/json")


class Handler(RequestHandler):
    """aiohttp's protocol for one connection, admitted by the doorman; `busy`: requests under way."""

    def __init__(self, doorman: Doorman, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.doorman, self.busy = doorman, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.doorman.enter(self):
            body = json.dumps(error_body("too many connections; retry later", 503)).encode()
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            transport.close()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.doorman.leave(self)
        super().connection_lost(exc)

    def close_idle(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def handle_error(
        self, request, status: int = 500, exc: Optional[BaseException] = None, message: Optional[str] = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (4xx) or a handler that raised (500): JSON, counted, and
        one line in the log naming the kind of error, never the client's bytes. A client that hung
        up mid-response was not refused: it is counted apart."""
        if isinstance(exc, ConnectionResetError):
            self.doorman.clients_gone += 1
        else:
            self.doorman.refused[status] += 1
        kind = type(exc).__name__ if exc is not None else "error"
        if status >= 500:
            self.doorman.say.warn(f"500 {kind}", f"a request failed inside the server: {kind}{_where(exc)}")
            reason = "internal server error"
        else:
            self.doorman.say.warn(f"{status} {kind}", f"a malformed request was answered {status} ({kind})")
            reason = f"malformed HTTP request ({kind})"
        if request.writer.output_size > 0:  # the answer had begun: the connection is all there is to end
            raise ConnectionError("an error after the response began")
        response = json_error(reason, status)
        response.force_close()
        return response


def _where(exc: Optional[BaseException]) -> str:
    """The innermost frame of a traceback, file and line only (its message may hold request content)."""
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}" if tb is not None else ""


def quiet_logger() -> logging.Logger:
    """aiohttp's server logger for our connections: its own lines (with tracebacks that quote the
    request) are replaced by handle_error's."""
    logger = logging.getLogger("testbed.server.aiohttp")
    logger.propagate = False
    logger.addHandler(logging.NullHandler())
    return logger


QUIET = quiet_logger()


def accept_errors(say: Throttled):
    """The event loop's exception handler: a failed accept (out of file descriptors) is one line per
    interval with a count, not a traceback per attempt; anything else as asyncio would say it."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if context.get("message", "").startswith("socket.accept()") and isinstance(error, OSError):
            say.warn("accept", f"accepting a connection failed: {error.strerror or error}")
            return
        loop.default_exception_handler(context)

    return handle
