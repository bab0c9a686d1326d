"""`executor=http`: one point replayed against a server (`replay_point`), with the requests table
and the summary of a built-in run; testbed/studies/executors.py writes them as the same results
directory (steps and transfers stay empty: the server's insides are not visible from here)."""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from testbed.http.client import Replay, served_model, session_for
from testbed.http.config import HttpConfig
from testbed.http.prompts import TextPrompts, need_tokenizer
from testbed.metrics.events import RequestLog
from testbed.metrics.slo import tenant_slos
from testbed.metrics.summary import summarize
from testbed.serving import Serving
from testbed.workload import build_workload


def replay_point(cfg: Serving, http: HttpConfig, progress: bool = True, stop=None) -> dict:
    """The workload replayed against http.url: {"requests", "summary", "prompts", "meta"}.
    `stop` (a threading.Event, set by a signal): the replay ends, the requests open are cut, and
    summary.json says `"partial": true` with the counts under `interrupted`."""
    http.check_client()
    prompts = TextPrompts(need_tokenizer(http.tokenizer or cfg.model.path)) if http.prompt == "text" else None
    log, replay, listing, cut = asyncio.run(_replay(cfg, http, prompts, progress, stop))
    requests = log.table()
    summary = summarize(
        requests,
        slo=cfg.slo,
        metrics=cfg.metrics,
        num_gpus=http.num_gpus,
        tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo),
    )
    summary["executor"] = "http"
    summary["workload_report"] = replay.workload.report
    summary["http"] = {
        "url": http.url,
        "model": replay.model,
        "prompt": http.prompt,
        "errors": dict(replay.errors),
        "refused": refused_by_status(replay.errors),
    }
    if cut is not None:
        summary["partial"], summary["interrupted"] = True, cut
    meta = {"executor": "http", "url": http.url, "model": replay.model, "models": listing}
    return {"requests": requests, "summary": summary, "prompts": log.prompts, "meta": meta}


async def _replay(cfg: Serving, http: HttpConfig, prompts, progress: bool, stop):
    async with session_for(http) as session:
        model, listing = await served_model(http, session)
        workload = build_workload(
            cfg.workload, seed=cfg.seed, vocab_size=_vocab(cfg, prompts), max_model_len=_max_model_len(cfg, listing)
        )
        replay = Replay(http, workload, model, prompts)
        log = RequestLog(time.perf_counter())
        with tqdm(
            total=len(workload.requests),
            desc=f"{http.label} requests",
            unit="req",
            leave=False,
            disable=not progress,
        ) as bar:
            replay.on_finish = lambda: bar.update(1)
            await replay.run(session, log, stop)
            stopped = stop is not None and stop.is_set() and (replay.pending or replay.tasks)  # else it had ended
            cut = await interrupted(replay, log.t0) if stopped else None
    return log, replay, listing, cut


async def interrupted(replay: Replay, t0: float) -> dict:
    """Cut the open requests of a stopped replay; summary.json's `interrupted` counts, as a real
    run's (planned: the workload's requests at the start; a session's later turns come as it goes)."""
    at_s = time.perf_counter() - t0
    cut = await replay.interrupt()
    workload = replay.workload
    return {
        "at_s": at_s,
        "requests_planned": len(workload.requests) + len(workload.rejected),
        "requests_cut": cut,
        "requests_not_sent": len(replay.pending) + workload.unsent,  # a closed loop's too
    }


def refused_by_status(errors) -> dict[str, int]:
    """The requests the server answered with an HTTP error, by status ({"429": 3}): a load test the
    server turned away must not read as a clean one."""
    out: dict[str, int] = {}
    for why, n in errors.items():
        if why.startswith("http ") and why[5:].isdigit():
            out[why[5:]] = out.get(why[5:], 0) + n
    return out


def _vocab(cfg: Serving, prompts) -> int:
    return prompts.vocab_size if prompts is not None else cfg.model.args().vocab_size


def _max_model_len(cfg: Serving, listing: dict) -> int:
    """The served model's limit when /v1/models says it (vLLM and this testbed do), else the
    configured model's: prompts are clipped to what the server accepts."""
    for model in listing.get("data", []):
        if isinstance(model, dict) and isinstance(model.get("max_model_len"), int):
            return model["max_model_len"]
    return cfg.model.args().max_model_len
