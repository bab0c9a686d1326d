"""The testbed's engine behind an OpenAI-compatible API: `/v1/completions` (streamed or whole),
`/v1/models`, `/health`.

One worker or a whole cluster in any mode serves the requests; the router runs in its own
thread (testbed/server/live.py) and aiohttp in another, so the caller's thread stays free to wait
for Ctrl-C. A client that goes away mid-stream has its request aborted on every worker, which
frees its sequence and KV. Stopping fails what is still open, stops the workers (each reports
its KV audit) and writes the run's results directory from the server's side.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import socket
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from aiohttp import web

from testbed.cluster.lifecycle import fit_to_pools, stop_cluster
from testbed.config import Config
from testbed.errors import ConfigError
from testbed.http.protocol import (
    DONE,
    BadRequest,
    Completion,
    body_limit,
    chunk,
    error_chunk,
    parse_completion,
    usage,
    usage_chunk,
)
from testbed.metrics.events import RequestLog
from testbed.server.doors import Doorman, accept_errors, connection_cap, json_error
from testbed.server.live import LiveRouter
from testbed.studies.real_cluster import start_cluster, write_point
from testbed.tracking.nvml import start_telemetry
from testbed.workload import Request

START_TIMEOUT_S = 60.0  # the web thread binding its socket; the workers have cluster.start_timeout_s
PARSE_INLINE = 64 << 10  # bytes: a larger body is parsed in a thread, so the event loop keeps every stream going
ENDED_STATUS = {"rejected": 429, "failed": 503}
SWITCH_INTERVAL_S = 0.0005
BACKLOG = 64  # connections the kernel completes before the server accepts them (and accepted in one go)


class QueueSink:
    """Hands one request's tokens from the router's thread to its handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def tokens(self, token_ids: list[int]) -> None:
        self._put(("tokens", token_ids))

    def end(self, status: str, reason: str) -> None:
        self._put(("end", status, reason))

    def _put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


class Completions:
    """The request handlers."""

    def __init__(
        self,
        cfg: Config,
        router: LiveRouter,
        t0: float,
        text: Callable[[list[int]], str],
        encode: Optional[Callable[[str], list[int]]],
    ):
        self.cfg, self.router, self.t0, self.text, self.encode = cfg, router, t0, text, encode
        self.args = cfg.model.args()
        self.key = cfg.http.server_key()
        self.max_body = body_limit(self.args.max_model_len)
        self.next_rid = 0
        self.open = 0

    def app(self, doorman: Doorman) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[doorman.middleware, self.auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    @web.middleware
    async def auth(self, request: web.Request, handler):
        key = self.key
        # a header that is not UTF-8 arrives with its bytes escaped: compared as those bytes, it matches no key
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if key and not hmac.compare_digest(given, f"Bearer {key}".encode()):
            return _error("missing or wrong API key: send `Authorization: Bearer KEY` (http.api_key)", 401)
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.http.served_model,
                        "object": "model",
                        "owned_by": "testbed",
                        "max_model_len": self.args.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        broken = self.router.error is not None
        return web.json_response(
            {
                "status": "failed" if broken else "ok",
                "open_requests": self.open,
                "active_requests": len(self.router.book),
                "mode": self.cfg.mode,
            },
            status=503 if broken else 200,
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.router.error is not None or self.router.stopping:
            return _error(f"the server is not serving: {self.router.error or 'stopping'}", 503)
        if self.open >= self.cfg.http.max_streams:
            return _error(
                f"too many concurrent requests: {self.open} open, http.max_streams={self.cfg.http.max_streams}", 429
            )
        try:
            spec = await self._parse(request)
        except BadRequest as bad:
            return _error(str(bad), bad.status)
        rid, sink = self.next_rid, QueueSink(asyncio.get_running_loop())
        self.next_rid += 1
        self.open += 1
        self.router.submit(Request(rid, time.perf_counter() - self.t0, spec.prompt_token_ids, spec.max_tokens), sink)
        try:
            response = await (
                self._stream(request, rid, spec, sink.queue) if spec.stream else self._whole(rid, spec, sink.queue)
            )
        except (asyncio.CancelledError, ConnectionResetError):
            # frees its sequence and KV on every worker; one the engine had finished is recorded as
            # not delivered (its stream broke before the end reached the client)
            self.router.cancel(rid, "client disconnected")
            raise
        finally:
            self.open -= 1
        self.router.delivered(rid)
        return response

    async def _parse(self, request: web.Request) -> Completion:
        """The request, its size checked from Content-Length before reading and by aiohttp while
        reading (client_max_size); a large body is parsed in a thread, off the event loop."""
        if request.content_length is not None and request.content_length > self.max_body:
            raise BadRequest(
                f"the body has {request.content_length} bytes; the limit is {self.max_body} "
                f"(a prompt of max_model_len {self.args.max_model_len} tokens)",
                status=413,
            )
        try:  # a client that announces a body and sends it slowly holds a connection: bounded
            body = await asyncio.wait_for(request.read(), self.cfg.http.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(
                f"the body is over the limit of {self.max_body} bytes "
                f"(a prompt of max_model_len {self.args.max_model_len} tokens)",
                status=413,
            ) from None
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the body was not sent whole within http.body_timeout_s={self.cfg.http.body_timeout_s:g} s", status=408
            ) from None
        parse = functools.partial(
            parse_completion,
            body,
            vocab_size=self.args.vocab_size,
            max_model_len=self.args.max_model_len,
            model=self.cfg.http.served_model,
            encode=self.encode,
        )
        if len(body) <= PARSE_INLINE:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(None, parse)

    async def _stream(self, request: web.Request, rid: int, spec: Completion, items: asyncio.Queue):
        item = await items.get()
        if item[0] == "end" and item[1] != "ok":  # refused or failed before any token: a plain error
            return _error(item[2], ENDED_STATUS.get(item[1], 503))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        while item[0] == "tokens":
            ids = item[1]
            sent += len(ids)
            finish = "length" if sent >= spec.max_tokens else None
            await response.write(chunk(rid, spec.model, self.text(ids), ids if spec.return_token_ids else None, finish))
            item = await items.get()
        if item[1] != "ok":
            await response.write(error_chunk(item[2]))
        elif spec.include_usage:
            await response.write(usage_chunk(rid, spec.model, len(spec.prompt_token_ids), sent))
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _whole(self, rid: int, spec: Completion, items: asyncio.Queue) -> web.Response:
        ids: list[int] = []
        item = await items.get()
        while item[0] == "tokens":
            ids += item[1]
            item = await items.get()
        if item[1] != "ok":
            return _error(item[2], ENDED_STATUS.get(item[1], 503))
        choice = {"index": 0, "text": self.text(ids), "logprobs": None, "finish_reason": "length"}
        if spec.return_token_ids:
            choice["token_ids"] = ids
        return web.json_response(
            {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": spec.model,
                "choices": [choice],
                "usage": usage(len(spec.prompt_token_ids), len(ids)),
            }
        )


_error = json_error


def ids_as_text(ids: list[int]) -> str:
    """Without a tokenizer a token is shown as its id: clients that count chunks with text see one."""
    return "".join(f" {t}" for t in ids)


class HttpServer:
    """`with HttpServer(cfg, out_dir) as server:` the workers are up and `server.url` answers;
    leaving stops everything and writes the results directory (when out_dir is given)."""

    def __init__(self, cfg: Config, out_dir: Optional[Path] = None, text=ids_as_text, encode=None):
        cfg.http.check_server()
        self.cfg, self.out_dir, self.text, self.encode = cfg, out_dir, text, encode
        self.result: Optional[dict] = None

    def __enter__(self) -> "HttpServer":
        cfg = self.cfg
        self._stack = ExitStack()
        sock = self._stack.enter_context(bind(cfg.http.host, cfg.http.port))  # before the workers load
        self.cluster = self._stack.enter_context(start_cluster(cfg))  # with the checks every real run takes
        try:
            self._start(sock)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self, sock: socket.socket) -> None:
        t0 = time.perf_counter()
        self.cfg = replace(
            self.cfg, model=fit_to_pools(self.cfg.serving, self.cluster)
        )  # an unset max_model_len lowered to the pools, in one line
        self.log, self.sampler = RequestLog(t0), start_telemetry(t0, announce=False)
        self._stack.callback(self.sampler.stop)  # a start that fails further on leaves no thread
        self.router = LiveRouter(self.cluster, self.log, self.cfg, t0)
        self.handlers = Completions(self.cfg, self.router, t0, self.text, self.encode)
        self._router_thread = threading.Thread(target=self.router.serve_forever, name="testbed-router", daemon=True)
        self._router_thread.start()
        self._stack.callback(self._router_thread.join)
        self._stack.callback(self.router.stop)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self.loop = asyncio.new_event_loop()
        self._web_thread = threading.Thread(target=self.loop.run_forever, name="testbed-http", daemon=True)
        self._web_thread.start()
        self._stack.callback(self._close_loop)
        self.doorman = Doorman(connection_cap(self.cfg.http.max_connections, BACKLOG))  # with the workers' files open
        self.loop.set_exception_handler(accept_errors(self.doorman.say))
        self._runner = web.AppRunner(
            self.handlers.app(self.doorman), handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        asyncio.run_coroutine_threadsafe(self._open(sock), self.loop).result(timeout=START_TIMEOUT_S)
        # The router's and the web server's threads hand every token to each other: at the default
        # 5 ms switch interval a hand-off can wait a whole interval for the GIL (+20% TPOT measured).
        self._stack.callback(sys.setswitchinterval, sys.getswitchinterval())
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    def _close_loop(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._web_thread.join()
        self.loop.close()

    async def _open(self, sock: socket.socket) -> None:
        await self._runner.setup()
        factory = self.doorman.handler_factory(self._runner.server, self.loop, self.cfg.http.header_timeout_s)
        await GuardedSite(self._runner, sock, factory).start()

    def __exit__(self, *exc) -> None:
        try:
            self.result = self.stop()
        finally:
            self._stack.close()

    def stop(self) -> Optional[dict]:
        """Fail what is open (its clients get an error chunk), close the socket, stop the workers,
        and write the results directory; returns what serve() returns, or None without out_dir."""
        self.router.stop()
        self._router_thread.join()
        self._close_loop()
        telemetry = stop_cluster(self.cluster, self.router, self.sampler)
        if self.router.error is not None and not isinstance(self.router.error, Exception):
            raise self.router.error
        if self.out_dir is None:
            return None
        doors = self.doors()
        return write_point(
            self.cfg,
            self.out_dir,
            self.cluster,
            self.router,
            self.log,
            telemetry,
            {"server": self.url, "requests_served": self.handlers.next_rid, **doors},
            extra_meta={"executor": "real", "served_over_http": self.url, **doors},
        )

    def doors(self) -> dict:
        """What the server turned away, by HTTP status (never in requests.parquet: no request began)."""
        return {
            "http_refused": {str(status): n for status, n in sorted(self.doorman.refused.items())},
            "http_connections_closed_idle": self.doorman.closed_idle,
            "http_clients_gone": self.doorman.clients_gone,
        }


class GuardedSite(web.SockSite):
    """aiohttp's site on our socket, whose connections are made by the doorman's factory."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, factory):
        super().__init__(runner, sock)
        self.sock, self.factory = sock, factory

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registered with the runner, which stops it
        self._server = await asyncio.get_running_loop().create_server(self.factory, sock=self.sock, backlog=BACKLOG)


@contextmanager
def bind(host: str, port: int):
    """The listening socket, or a one-line error naming the port (closed on the way out)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(
            f"http.host={host} http.port={port} cannot be bound ({error.strerror or error}); "
            f"choose another port, or http.port=0 for a free one"
        ) from None
    try:
        yield sock
    finally:
        sock.close()
