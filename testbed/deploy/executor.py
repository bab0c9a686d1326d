"""`executor=vllm`: one point served by a vLLM deployment from the pool (started on first use,
reused by the points of the same shape), driven by the testbed's router with its own workload.
Returns the tables and the summary; the studies layer writes the results directory.

Measured from both sides: the client's token times (TTFT, TPOT, ITL, E2E as for every executor),
and each instance's Prometheus /metrics, scraped before, during (every METRICS_EVERY_S) and after
the point (queue, prefill and decode time, KV cache usage, preemptions, prefix-cache hits, NIXL's
transfer time and bytes). An instance that dies mid-point is taken out of dispatch at once; its
requests fail (cluster.on_worker_failure=fail) or are sent once more to live instances
(redispatch); the point's finished requests are written, then the point fails in one line."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
from tqdm import tqdm

from testbed.deploy import prometheus
from testbed.deploy.config import VllmConfig
from testbed.deploy.deployment import Deployment, Deployments, Shape, dtype
from testbed.deploy.router import DeploymentReplay
from testbed.http.client import session_for
from testbed.http.config import HttpConfig
from testbed.http.executor import interrupted
from testbed.metrics.events import TRANSFER_COLUMNS, RequestLog
from testbed.metrics.summary import summarize
from testbed.names import Kind
from testbed.workload import build_workload

METRICS_EVERY_S = 2.0
LIVENESS_EVERY_S = 0.5
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PointSettings:
    """What one vLLM point reads of the configuration (the executor never sees the root record)."""

    mode: str
    seed: int
    cluster: object  # ClusterConfig: the split, the TP degrees, dispatch and admission
    chunk_size: int
    workload: object  # WorkloadConfig
    slo: object  # SLOConfig
    metrics: object  # MetricsConfig
    tenant_slos: dict = field(default_factory=dict)
    on_kv_failure: str = "fail"  # kv_transfer.on_failure: a failed hand-off fails, is retried, or D recomputes
    http: HttpConfig = field(default_factory=HttpConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


def serve_point(pool: Deployments, point: PointSettings, progress: bool = True, stop=None) -> dict:
    shape = Shape.of(point.mode, point.cluster, point.chunk_size, point.vllm.prefix_caching)
    deployment = pool.get(shape)
    model = ModelFacts.read(pool.model, dtype(point.vllm, pool.host))
    before = scrape_all(deployment) if point.vllm.metrics else {}
    log, replay, samples, cut = asyncio.run(_drive(deployment, point, model, progress, stop))
    after = scrape_all(deployment) if point.vllm.metrics else {}
    requests = log.table()
    transfers = pd.DataFrame(replay.hand_offs, columns=TRANSFER_COLUMNS)
    devices = sum(shape.tp) if pool.host.device == "cuda" else len(shape.tp) * point.vllm.cores_per_instance
    summary = summarize(
        requests, None, transfers, slo=point.slo, metrics=point.metrics, num_gpus=devices, tenant_slos=point.tenant_slos
    )
    summary["executor"] = "vllm"
    summary["workload_report"] = replay.workload.report
    summary["vllm"] = {
        "deployment": shape.label(),
        "instances": {
            i.spec.name: prometheus.point_figures(before[i.spec.name], after[i.spec.name], samples[i.spec.name])
            for i in deployment.instances
            if i.spec.name in before and i.spec.name in after
        },
        "dead_instances": [i.spec.name for i in deployment.dead()],
        "errors": dict(replay.errors),
        "kv_failures": replay.kv_failures,
    }
    if cut is not None:
        summary["partial"], summary["interrupted"] = True, cut
    meta = {"executor": "vllm", "vllm": deployment_meta(deployment, pool)}
    summary["vllm"]["version"], summary["vllm"]["connector"] = meta["vllm"]["version"], meta["vllm"]["connector"]
    return {"requests": requests, "transfers": transfers, "summary": summary, "prompts": log.prompts, "meta": meta}


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    kv_bytes_per_token: float  # K and V of every layer, in the served dtype

    @classmethod
    def read(cls, model: str, served_dtype: str) -> "ModelFacts":
        """From the checkpoint's config.json, read as the testbed's loader reads it (a hub id without a
        local copy: a vocabulary of 32000, no KV size)."""
        from testbed.model.config import ModelConfig

        if not (Path(model) / "config.json").is_file():
            return cls(32000, float("nan"))
        args = ModelConfig(name="hf", path=model).args()
        width = 4 if served_dtype == "float32" else 2
        return cls(args.vocab_size, 2.0 * args.num_layers * args.num_kv_heads * args.head_dim * width)


async def _drive(deployment: Deployment, point: PointSettings, model: ModelFacts, progress: bool, stop):
    urls = {kind: [i.spec.url for i in deployment.of(kind)] for kind in (Kind.MIXED, Kind.PREFILL, Kind.DECODE)}
    workload = build_workload(
        point.workload, seed=point.seed, vocab_size=model.vocab_size, max_model_len=point.vllm.max_model_len
    )
    name, per_token = point.vllm.served_name, model.kv_bytes_per_token
    replay = DeploymentReplay(point.http, workload, name, urls, point.cluster, per_token)
    replay.redispatch = point.cluster.on_worker_failure == "redispatch"
    replay.on_kv_failure = point.on_kv_failure
    samples: dict = {i.spec.name: [] for i in deployment.instances}
    log = RequestLog(time.perf_counter())
    async with session_for(point.http) as session:
        watch = asyncio.create_task(_watch(deployment, replay, samples, point.vllm.metrics))
        with tqdm(total=len(workload.requests), desc=f"vLLM {deployment.shape.label()}", unit="req",
                  leave=False, disable=not progress) as bar:  # fmt: skip
            replay.on_finish = lambda: bar.update(1)
            try:
                await replay.run(session, log, stop)
                stopped = stop is not None and stop.is_set() and (replay.pending or replay.tasks)
                cut = await interrupted(replay, log.t0) if stopped else None
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
    return log, replay, samples, cut


async def _watch(deployment: Deployment, replay: DeploymentReplay, samples: dict, metrics: bool) -> None:
    """Liveness every LIVENESS_EVERY_S (a dead instance leaves dispatch at once), gauges every METRICS_EVERY_S."""
    last = 0.0
    while True:
        for instance in deployment.dead():
            replay.lose(Kind(instance.spec.role), deployment.of(instance.spec.role).index(instance))
        if metrics and time.monotonic() - last >= METRICS_EVERY_S:
            last = time.monotonic()
            for instance in deployment.instances:
                if instance.alive():
                    scraped = await asyncio.to_thread(scrape, instance.spec.url)
                    if scraped is not None:
                        samples[instance.spec.name].append(scraped)
        await asyncio.sleep(LIVENESS_EVERY_S)


def scrape(url: str) -> Optional[prometheus.Scrape]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            return prometheus.parse(response.read(prometheus.MAX_BYTES).decode(errors="replace"))
    except (OSError, ValueError):
        return None


def scrape_all(deployment: Deployment) -> dict:
    out = {}
    for instance in deployment.instances:
        scraped = scrape(instance.spec.url) if instance.alive() else None
        if scraped is not None:
            out[instance.spec.name] = scraped
    return out


def version(url: str) -> Optional[str]:
    try:
        with urllib.request.urlopen(url + "/version", timeout=SCRAPE_TIMEOUT_S) as response:
            return json.loads(response.read(65536)).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def deployment_meta(deployment: Deployment, pool: Deployments) -> dict:
    """vLLM's version, each instance's exact launch line and environment, the connector: meta.json's `vllm`."""
    first = deployment.instances[0]
    return {
        "version": version(first.spec.url),
        "python": pool.python,
        "model": pool.model,
        "device": pool.host.device,
        "connector": pool.vllm.connector if deployment.shape.mode == "disagg" else None,
        "deployment": deployment.shape.label(),
        "instances": {
            i.spec.name: {
                "role": i.spec.role,
                "port": i.spec.port,
                "launch": i.spec.shell_line(pool.python),
                "env": i.spec.env,
                "log": str(i.log_path),
            }  # fmt: skip
            for i in deployment.instances
        },
        "starts": pool.starts,
    }
