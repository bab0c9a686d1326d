"""An OpenAI-shaped stub server for tests: the handlers' /v1/models and /v1/completions served
from a thread of the test's process on a free port of the loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from aiohttp import web

START_S = 60  # a guard against a hang, not a pace


@contextlib.contextmanager
def served(handlers):
    """Yields the stub's URL while it serves `handlers` (`models`, `completions` coroutines)."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/v1/completions", handlers.completions)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def start():
        await runner.setup()
        await web.SockSite(runner, sock).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=START_S)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=START_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
