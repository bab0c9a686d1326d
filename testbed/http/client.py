"""`executor=http`: the workload replayed against an OpenAI-compatible `/v1/completions`.

Open loop as for the built-in engine: each request is sent at its arrival time whatever the
server's state (up to http.max_concurrency in flight; a later one waits, and its wait counts in
its TTFT); a session's next turn is sent a think time after its previous turn's last chunk.
Closed loop (workload.concurrency = N, testbed/workload/closed_loop.py), as `vllm bench serve
--max-concurrency N`: N users, each sending its next request a think time after its last one
ended however it ended, so no more than N are in flight. Token times are the receipt times of
the stream's chunks, so TTFT, TPOT and ITL mean what they mean for a built-in run. Every
failure (an HTTP error, a stream that stops or goes silent, a timeout) is recorded on its
request, and every request ends within http.timeout_s of being sent.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import Counter
from dataclasses import replace
from typing import Optional

import aiohttp

from testbed.errors import ConfigError, PeerLost
from testbed.http.config import HttpConfig
from testbed.http.protocol import read_event
from testbed.metrics.events import Event, RequestLog
from testbed.stopping import INTERRUPTED
from testbed.workload import Request, Workload

STOP_POLL_S = 0.1  # how soon a stopped replay notices the signal


class Replay:
    def __init__(self, http: HttpConfig, workload: Workload, model: str, prompts=None, on_finish=None):
        self.http, self.workload, self.model = http, workload, model
        self.prompts = prompts  # TextPrompts for http.prompt=text, else None (ids are sent)
        # text made before the clock starts: tokenizing on the loop would delay the chunks' stamps
        self.ready = {r.request_id: self._as_sent(r) for r in workload.requests} if prompts is not None else {}
        self.url = (self.http.url or "").rstrip("/") + self.http.endpoint  # a subclass may route per request
        self.pending = [(r.arrival_s, r.request_id, r) for r in workload.initial()]
        heapq.heapify(self.pending)
        self.tasks: set[asyncio.Task] = set()
        self.errors: Counter = Counter()
        self.on_finish = on_finish or (lambda: None)
        self.refused: set[int] = set()  # refused by a router in front (DeploymentReplay): no session goes on

    async def run(self, session: aiohttp.ClientSession, log: RequestLog, stop=None) -> None:
        """Replay everything; `log` holds the run's clock (its t0) and every request's events.
        `stop` (a threading.Event: a signal): once set the loop ends and `interrupt` cuts what is open."""
        self.session, self.log, self.wake = session, log, asyncio.Event()
        self.slots = asyncio.Semaphore(self.http.max_concurrency)
        for request, reason in self.workload.rejected:
            self.log.reject(request, self.log.t0, reason, by="workload")
        while (self.pending or self.tasks) and not (stop is not None and stop.is_set()):
            delay = self._release()
            if stop is not None:  # a signal sets a thread's event, not the loop's: look at it this often
                delay = STOP_POLL_S if delay is None else min(delay, STOP_POLL_S)
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def interrupt(self) -> int:
        """Cut every request in flight or waiting for a slot: each is recorded failed (reason
        `interrupted`) with the tokens that came; returns how many."""
        open_tasks = list(self.tasks)
        for task in open_tasks:
            task.cancel()
        await asyncio.gather(*open_tasks, return_exceptions=True)
        return len(open_tasks)

    def _release(self) -> Optional[float]:
        """Send what has arrived; seconds to the next arrival (None: wait for a finish)."""
        now = time.perf_counter() - self.log.t0
        while self.pending and self.pending[0][0] <= now:
            request = heapq.heappop(self.pending)[2]
            ready = self.ready.pop(request.request_id, None)  # its text, made at its open-loop time
            request = (replace(ready[0], arrival_s=request.arrival_s), ready[1]) if ready else self._as_sent(request)
            task = asyncio.create_task(self._one(request))
            self.tasks.add(task)
            task.add_done_callback(self._done)
        return self.pending[0][0] - now if self.pending else None

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.wake.set()

    def _as_sent(self, request: Request) -> tuple[Request, object]:
        """The request as the server will read it, and the prompt field that carries it."""
        if self.prompts is None:
            return request, list(request.prompt_token_ids)
        text, ids = self.prompts.text(request.prompt_token_ids)
        return replace(request, prompt_token_ids=ids), text

    def payload(self, request: Request, prompt) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.http.ignore_eos:
            body["ignore_eos"] = True
        if self.http.min_tokens:
            body["min_tokens"] = request.output_len
        if self.http.token_ids:
            body["return_token_ids"] = True
        return body

    async def _one(self, sent: tuple[Request, object]) -> None:
        request, prompt = sent
        self.log.register(request)
        ids: list[int] = []
        times: list[float] = []  # what arrived: kept however the request ends
        try:
            async with self.slots:
                self.log.event(request.request_id, Event.DISPATCHED, time.perf_counter())
                try:
                    times, why = await asyncio.wait_for(self._stream(request, prompt, ids, times), self.http.timeout_s)
                except asyncio.TimeoutError:
                    why = f"no end within http.timeout_s={self.http.timeout_s:g} s"
                except Exception as error:  # whatever breaks one request is that request's failure
                    why = f"{type(error).__name__}: {error}"
        except asyncio.CancelledError:  # interrupt(): the run was stopped
            why = INTERRUPTED
        self._end(request, ids, times, why)
        self._follow(request, ids, times, why)

    async def _stream(self, request: Request, prompt, ids: list[int], times: list[float]) -> tuple[list[float], str]:
        """Fills `ids` and `times` (one receipt time per token); (the times, with any tokens only
        the usage counted, and why it failed or "")."""
        return await self.stream_from(self.url, self.payload(request, prompt), ids, times)

    async def stream_from(self, url: str, body: dict, ids: list[int], times: list[float]) -> tuple[list[float], str]:
        """POST `body` to `url` and read its stream into `ids` and `times` (see _stream)."""
        headers = bearer(self.http.client_key())
        try:
            async with self.session.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    return times, f"http {response.status}: {error_reason(await response.text())}"
                used = None  # the usage chunk's completion_tokens, when the server sends one
                async for line in response.content:
                    t = time.perf_counter()
                    delta = read_event(line)
                    if delta is None:
                        continue
                    used = delta.usage_tokens if delta.usage_tokens is not None else used
                    if delta.error or delta.done:
                        return _counted(times, ids, used), delta.error
                    ids += delta.token_ids or []
                    times += [t] * delta.count
        except aiohttp.ServerTimeoutError:
            return times, f"no chunk for http.stall_timeout_s={self.http.stall_timeout_s:g} s"
        return times, "the stream ended without [DONE]"

    def _end(self, request: Request, ids: list[int], times: list[float], why: str) -> None:
        rid = request.request_id
        self.log.token_series(rid, ids, times, times)
        end = times[-1] if times else time.perf_counter()
        if why:
            self.errors[why.split(":")[0]] += 1
            self.log.fail(rid, end, why)
        else:
            short = (
                f"stopped after {len(times)} of {request.output_len} tokens" if len(times) < request.output_len else ""
            )
            self.log.event(rid, Event.FINISHED, end, reason=short)
        self.on_finish()

    def _follow(self, request: Request, ids: list[int], times: list[float], why: str) -> None:
        """After any ending: a session's next turn (after a finish) or a closed loop's next request."""
        end = (times[-1] if times else time.perf_counter()) - self.log.t0
        if why or request.request_id in self.refused:
            follow_up = self.workload.ended(request, end)
        else:
            follow_up = self.workload.next_turn(request, ids or [0] * len(times), end)
        if follow_up is not None:
            heapq.heappush(self.pending, (follow_up.arrival_s, follow_up.request_id, follow_up))


def _counted(times: list[float], ids: list[int], used) -> list[float]:
    """Without ids, a chunk with text counted one token; a larger usage count (chunks that carried
    several) puts the rest at the last chunk's time, as vLLM's benchmark takes its count from usage."""
    if ids or not used or used <= len(times) or not times:
        return times
    return times + [times[-1]] * (int(used) - len(times))


def error_reason(body: str) -> str:
    """The first line of an error body (an OpenAI error object's message when it is one)."""
    try:
        error = json.loads(body).get("error", body)
        body = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        pass
    return (body.strip().splitlines() or [""])[0][:200]


def bearer(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def session_for(http: HttpConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=http.connect_timeout_s, sock_read=http.stall_timeout_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=http.max_concurrency))


class ServerUnreachable(PeerLost, ConfigError):
    """executor=http: nothing answers at http.url (checked before the first request). A PeerLost
    (exit status 1), so a study ends at once instead of recording every point as failed."""


async def served_model(http: HttpConfig, session: aiohttp.ClientSession) -> tuple[str, dict]:
    """(the model to ask for, what GET /v1/models answered). The endpoint is checked before any
    request is sent, whatever is set: a server that cannot be reached (neither /v1/models nor
    /health answers) is a one-line error, never a run of failed requests."""
    base = http.url.rstrip("/")
    headers = bearer(http.client_key())
    try:
        status, body = await _get(session, base + "/v1/models", headers)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
        why = f"{type(error).__name__}: {_first_line(error)}"
        try:  # a server without /v1/models may still answer /health
            await _get(session, base + "/health", headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            raise ServerUnreachable(
                f"http.url={http.url}: no server answers: GET /v1/models failed ({why}), "
                f"and so did GET /health; start the server or fix http.url"
            ) from None
        if http.model:
            return http.model, {}
        raise ConfigError(f"http.url={http.url}: GET /v1/models failed ({why}); set http.model") from None
    try:
        listing = json.loads(body) if status == 200 else {}
    except ValueError:
        listing = None
    if status in (401, 403) or (status != 200 and not http.model):
        hint = " (check http.api_key or OPENAI_API_KEY)" if status in (401, 403) else "; or set http.model"
        raise ConfigError(f"http.url={http.url}: GET /v1/models answered {status}: {error_reason(body)}{hint}")
    if listing is None and not http.model:
        raise ConfigError(
            f"http.url={http.url}: GET /v1/models answered with no JSON: {error_reason(body)}; set http.model"
        )
    listing = listing if isinstance(listing, dict) else {}
    models = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    if http.model:
        return http.model, listing
    if not models:
        raise ConfigError(f"http.url={http.url}: /v1/models lists no model; set http.model")
    return models[0], listing


async def _get(session: aiohttp.ClientSession, url: str, headers: dict) -> tuple[int, str]:
    async with session.get(url, headers=headers) as response:
        return response.status, await response.text()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]
