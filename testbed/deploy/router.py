"""The testbed's router in front of a vLLM deployment: the same dispatch policies and admission
control as in front of its own engine (testbed/control/dispatch.py), speaking vLLM's P/D protocol.

A mixed deployment (colocated, chunked): each request goes to the instance the dispatch policy
picks, streamed as any OpenAI completion. A disaggregated one, per request:

    1. the prompt to a prefill instance, max_tokens=1, kv_transfer_params asking for remote decode;
       its answer (prefill done) carries the parameters that locate the KV
    2. the same request to a decode instance with those parameters, streamed: the decode instance
       pulls the KV (NIXL) and decodes; its first chunk is the client's first token

The hand-off is the time from the prefill's answer to the decode instance's first token; it is
recorded per request as the KV hand-off (kv_transfer_start_s, kv_transfer_end_s). kv_aware dispatch
scores instances by the prompts routed to them (what their prefix caches can hold, as a router that
cannot see inside the engine estimates it)."""

from __future__ import annotations

import json
import time
from typing import Optional

import aiohttp

from testbed.control.dispatch import Dispatcher, WorkerLoad, admission_refusal
from testbed.control.kv_index import KVIndex
from testbed.engine.prefix import prompt_hashes
from testbed.http.client import Replay, bearer, error_reason
from testbed.metrics.events import Event
from testbed.names import Kind
from testbed.workload import Request

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
INDEX_BLOCK = 16  # the router's granularity for kv_aware scores (vLLM's default block size)


class DeploymentReplay(Replay):
    """`urls[kind]`: the instances of each kind, in the deployment's order (their index is the
    worker id in requests.parquet). `cluster`: dispatch and admission settings."""

    def __init__(self, http, workload, model: str, urls: dict, cluster, kv_bytes_per_token: float = float("nan")):
        super().__init__(http, workload, model)
        self.urls, self.cluster, self.kv_bytes_per_token = urls, cluster, kv_bytes_per_token
        self.disagg = bool(urls.get(Kind.PREFILL))
        front = urls[Kind.PREFILL] if self.disagg else urls[Kind.MIXED]
        self.front = self._dispatcher(cluster.dispatch, len(front), for_decode=False)
        self.back = self._dispatcher(cluster.decode_dispatch, len(urls.get(Kind.DECODE, [])), for_decode=True)
        self.decode_base = len(front)  # requests.parquet numbers instances as the deployment lists them
        self.outstanding = 0
        self.refused: set[int] = set()  # refused at admission: recorded as such, not as finished
        self.lost: set[tuple] = set()  # (kind, instance index) of the instances that died
        self.redispatch = False  # a request an instance's death failed is sent once more
        self.on_kv_failure = "fail"  # a hand-off that failed with both instances alive: fail | retry | recompute
        self.kv_failures = 0
        self.hand_offs: list[dict] = []  # kv_transfers.parquet's rows

    def _dispatcher(self, policy: str, n: int, for_decode: bool) -> Dispatcher:
        workers = list(range(n))
        index = KVIndex(INDEX_BLOCK, workers) if policy == "kv_aware" else None
        return Dispatcher(policy, workers, {w: WorkerLoad() for w in workers}, for_decode, index)

    async def _stream(self, request: Request, prompt, ids: list[int], times: list[float]) -> tuple[list[float], str]:
        refusal = admission_refusal(self.cluster, request, self.outstanding)
        if refusal:
            self.log.reject(request, time.perf_counter(), refusal)
            self.refused.add(request.request_id)
            return times, ""
        self.outstanding += 1
        try:
            times, why, used = await self._attempt(request, prompt, ids, times)
            if why and self.redispatch and any(u in self.lost for u in used):  # once more, on live instances
                del ids[:], times[:]
                times, why, _ = await self._attempt(request, prompt, ids, times)
            return times, why
        finally:
            self.outstanding -= 1

    async def _attempt(self, request, prompt, ids, times) -> tuple[list[float], str, list]:
        """One try: (times, why it failed or "", the (kind, instance) it used)."""
        if self.disagg:
            return await self._disaggregated(request, prompt, ids, times)
        return await self._mixed(request, prompt, ids, times)

    def lose(self, kind: str, index: int) -> None:
        """An instance died: out of dispatch from now on."""
        if (kind, index) in self.lost:
            return
        self.lost.add((kind, index))
        dispatcher = self.back if kind == Kind.DECODE else self.front
        dispatcher.loads[index].alive = False

    def _end(self, request: Request, ids: list[int], times: list[float], why: str) -> None:
        if request.request_id in self.refused:
            self.on_finish()
            return
        super()._end(request, ids, times, why)

    async def _mixed(self, request, prompt, ids, times):
        worker = self.front.pick(request)
        if worker is None:
            return times, "no live instance to serve it", []
        load = self.front.loads[worker]
        load.queued_prompt_tokens += request.input_len
        rid = request.request_id
        sent = time.perf_counter()
        self.log.event(rid, Event.DISPATCHED, sent, prefill_worker=worker, decode_worker=worker)
        self.log.event(rid, Event.PREFILL_START, sent, worker=worker)  # as the client sees it: sent to first token
        self.log.prefilled_on(rid, Kind.MIXED)
        url = self.urls[Kind.MIXED][worker] + self.http.endpoint
        try:
            times, why = await self._counting_first(url, self.payload(request, prompt), ids, times, load, request)
        finally:
            self._remember(self.front, worker, request)
        if times:
            self.log.event(rid, Event.PREFILL_END, times[0], worker=worker)
        return times, why, [(Kind.MIXED, worker)]

    async def _counting_first(self, url, body, ids, times, load, request):
        """Stream; the prompt's tokens leave the instance's queue at its first token (or its end)."""
        try:
            return await self.stream_from(url, body, ids, times)
        finally:
            load.queued_prompt_tokens -= request.input_len

    async def _disaggregated(self, request, prompt, ids, times):
        rid = request.request_id
        p = self.front.pick(request)
        if p is None:
            return times, "no live prefill instance to serve it", []
        p_load = self.front.loads[p]
        p_load.queued_prompt_tokens += request.input_len
        sent = time.perf_counter()
        self.log.event(rid, Event.DISPATCHED, sent, prefill_worker=p)
        self.log.event(rid, Event.PREFILL_START, sent, worker=p)  # sent to the prefill's answer
        self.log.prefilled_on(rid, Kind.PREFILL)
        try:
            params, why = await self._prefill(self.urls[Kind.PREFILL][p], request, prompt)
        finally:
            p_load.queued_prompt_tokens -= request.input_len
        done = time.perf_counter()
        self.log.event(rid, Event.PREFILL_END, done, prefill_worker=p)
        self._remember(self.front, p, request)
        if why:
            return times, f"prefill on instance p{p}: {why}", [(Kind.PREFILL, p)]
        d = self._bind(request)
        if d is None:
            return times, "no live decode instance to serve it", [(Kind.PREFILL, p)]
        self.log.event(rid, Event.KV_TRANSFER_START, done, decode_worker=self.decode_base + d)
        try:
            times, why = await self._decode(d, request, prompt, params, ids, times)
            if why and not times and (Kind.DECODE, d) not in self.lost and self.on_kv_failure != "fail":
                self.kv_failures += 1  # the hand-off failed with D alive: kv_transfer.on_failure
                if self.on_kv_failure == "retry":
                    params, why = await self._prefill(self.urls[Kind.PREFILL][p], request, prompt)
                else:  # recompute: D prefills the prompt itself
                    params = None
                    self.log.prefilled_on(rid, Kind.DECODE)
                if not why:
                    times, why = await self._decode(d, request, prompt, params, ids, times)
        finally:
            self.back.loads[d].bound_sequences -= 1
            self.back.loads[d].bound_tokens -= request.input_len
            self._remember(self.back, d, request)
        if times:
            kv_bytes = self.kv_bytes_per_token * request.input_len
            self.log.event(rid, Event.KV_TRANSFER_END, times[0], decode_worker=self.decode_base + d, kv_bytes=kv_bytes)
            self.log.event(rid, Event.DECODE_START, times[0], decode_worker=self.decode_base + d)
            self.hand_offs.append(
                {
                    "request_id": rid,
                    "prefill_worker": p,
                    "decode_worker": self.decode_base + d,
                    "kv_bytes": kv_bytes,
                    "start_s": done - self.log.t0,
                    "end_s": times[0] - self.log.t0,
                }
            )
        return times, why, [(Kind.PREFILL, p), (Kind.DECODE, d)]

    async def _decode(self, d: int, request: Request, prompt, params: Optional[dict], ids, times):
        body = self.payload(request, prompt)
        if params is not None:
            body["kv_transfer_params"] = params
        return await self.stream_from(self.urls[Kind.DECODE][d] + self.http.endpoint, body, ids, times)

    async def _prefill(self, url: str, request: Request, prompt) -> tuple[Optional[dict], str]:
        """The prefill request: (the kv_transfer_params it answered, "") or (None, why it failed)."""
        body = {**self.payload(request, prompt), "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        body.pop("stream_options", None)
        body.pop("min_tokens", None)
        try:
            async with self.session.post(
                url + self.http.endpoint, json=body, headers=bearer(self.http.client_key())
            ) as response:
                text = await response.text()
                if response.status != 200:
                    return None, f"http {response.status}: {error_reason(text)}"
        except (aiohttp.ClientError, OSError) as error:
            return None, f"{type(error).__name__}: {error}"
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return None, "the prefill's answer is not a JSON object"
        if not isinstance(params, dict):
            return None, "the prefill's answer has no kv_transfer_params (is the instance a kv_producer?)"
        return params, ""

    def _bind(self, request: Request) -> Optional[int]:
        """The decode instance, its load counted (every request: the client's tokens come from it)."""
        d = self.back.pick(request)
        if d is not None:
            self.back.loads[d].bound_sequences += 1
            self.back.loads[d].bound_tokens += request.input_len
        return d

    @staticmethod
    def _remember(dispatcher: Dispatcher, worker: int, request: Request) -> None:
        if dispatcher.index is not None:
            dispatcher.index.update(worker, prompt_hashes(request.prompt_token_ids, INDEX_BLOCK), ())
