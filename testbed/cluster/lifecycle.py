"""What every cluster run does around its router, whoever feeds it (a replayed workload, or an
HTTP server's clients): the workers' template and shared KV store, stopping the workers with
their KV audits; studies/real_cluster.py writes the results directory."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from testbed.cluster.emulation import Emulation, emulated_pool
from testbed.cluster.launcher import Cluster
from testbed.cluster.layout import cuda_count
from testbed.cluster.router import Router
from testbed.cluster.worker import WorkerSpec
from testbed.engine.host_store import create_store
from testbed.engine.kv_pool import host_available_bytes, kv_block_shape
from testbed.errors import KVLeakError
from testbed.metrics.latency import distribution
from testbed.model.config import ModelConfig
from testbed.model.loader import resolve_dtype
from testbed.names import KIND_OF, Kind, Mode, Role
from testbed.net.messages import Audit
from testbed.serving import Serving

_log = logging.getLogger("testbed")


def kv_store(cfg: Serving, plans) -> Optional[object]:
    """The run's shared KV store (kv_store.capacity_mib), in the workers' KV dtype; None when off."""
    if cfg.kv_store.capacity_mib <= 0:
        return None
    args = cfg.model.args()
    dtype = resolve_dtype(cfg.model.dtype, torch.device(plans[0].device))
    return create_store(cfg.kv_store.capacity_mib, kv_block_shape(args, cfg.engine.block_size), dtype)


def emulated_engine(cfg: Serving, engine):
    """CPU workers paced to an emulated device get that device's KV pool (cluster/emulation.py)."""
    emulation = Emulation.from_hardware(cfg.hardware)
    if emulation is None or cuda_count(cfg.hardware):
        return engine
    c = cfg.cluster
    roles = (
        [Role.PREFILL_ONLY] * c.num_prefill + [Role.DECODE_ONLY] * c.num_decode
        if cfg.mode == Mode.DISAGG
        else [Kind.MIXED] * c.num_workers
    )
    args = cfg.model.args()
    real = args.kv_bytes_per_token * resolve_dtype(cfg.model.dtype, torch.device("cpu")).itemsize
    blocks, line = emulated_pool(
        emulation,
        cfg.model,
        engine,
        cfg.hardware,
        roles,
        real,
        host_available_bytes(),
        fill_tokens=cfg.scheduler.max_running * args.max_model_len,
        tps={role: c.tp_of(KIND_OF.get(role, Kind.MIXED)) for role in roles},
    )
    if line:
        logging.getLogger("testbed").warning(line)
    return engine if blocks is None else dataclasses.replace(engine, num_kv_blocks=blocks)


def fit_to_pools(cfg: Serving, cluster) -> ModelConfig:
    """`cfg.model` with model.max_model_len set to what every started worker's KV pool holds, when it
    was left unset and some pool holds less than the model's own length (a checkpoint's
    max_position_embeddings often exceeds a CPU pool); said in one line, as `LLM` does. The
    workers fit their own engines to their pools (testbed/cluster/worker.py) and report the pool
    (`Started.num_blocks`); a length set explicitly is never lowered: a pool that cannot hold it
    stopped the workers' start with the error. The CLI's points (testbed/studies/real_cluster.py) and
    the HTTP server both call this once their workers are up."""
    if cfg.model.max_model_len is not None:
        return cfg.model
    started = list(getattr(cluster, "started", {}).values())
    if not started:
        return cfg.model
    wanted = cfg.model.args().max_model_len
    held = min(s.num_blocks * cfg.engine.for_device(s.device.split(":")[0]).block_size for s in started)
    if held >= wanted:
        return cfg.model
    smallest = min(started, key=lambda s: s.num_blocks)
    key = (wanted, held)
    if key not in _said:  # once per process: a study's points would repeat it
        _said.add(key)
        _log.warning(
            f"model.max_model_len lowered from {wanted} to {held}: what the smallest worker's KV pool "
            f"({smallest.num_blocks} blocks, worker {smallest.worker}) holds; set model.max_model_len, "
            f"or raise engine.kv_cache_mib / engine.num_kv_blocks / engine.gpu_memory_utilization for more"
        )
    return dataclasses.replace(cfg.model, max_model_len=held)


_said: set = set()


def worker_template(cfg: Serving, store=None) -> WorkerSpec:
    """Every worker's spec but its place (rank, role, device): the launcher fills that in."""
    engine = emulated_engine(cfg, cfg.engine)
    if cfg.faults.exhaust_kv_pool:  # the least pool that still holds one request of max_model_len
        engine = dataclasses.replace(engine, num_kv_blocks=-(-cfg.model.args().max_model_len // engine.block_size))
    return WorkerSpec(
        rank=0,
        world_size=1,
        role="",
        device="cpu",
        port=0,
        model=cfg.model,
        engine=engine,
        scheduler=cfg.scheduler,
        kv=cfg.kv_transfer,
        cluster=cfg.cluster,
        faults=cfg.faults,
        seed=cfg.seed,
        emulation=Emulation.from_hardware(cfg.hardware, cfg.engine),
        report_cache=cfg.follows_caches,
        kv_store=store,
    )


def harness_breakdown(rows: list[tuple[float, float, float]]) -> dict:
    """Where a step report's harness delay goes: building the report on the worker, the pipe
    (pickling, the router's wake-up, unpickling), and waiting behind earlier reports in the router."""
    parts = np.array(rows, dtype=float).reshape(-1, 3)
    return {name: distribution(parts[:, i]) for i, name in enumerate(("build_s", "pipe_s", "router_queue_s"))}


def audit_summary(audits: dict[int, Audit]) -> dict:
    """What each worker's process still held at the end (all zero unless something leaked; a
    tensor-parallel worker's other ranks under their process ranks, after the workers'), and the
    KV bytes each put on the wire and took off it."""
    return {
        "kv_wire_bytes": {
            f"worker{rank}": {"sent": a.kv_bytes_sent, "received": a.kv_bytes_received}
            for rank, a in sorted(audits.items())
        },
        "kv_blocks_leaked": {f"worker{rank}": a.used_blocks for rank, a in sorted(audits.items())},
        "kv_blocks_cached": {f"worker{rank}": a.cached_blocks for rank, a in sorted(audits.items())},
        "kv_store": {f"worker{rank}": a.store for rank, a in sorted(audits.items()) if a.store},
        "staging_buffers_leaked": {
            f"worker{rank}": {"count": a.loaned_buffers, "bytes": a.loaned_bytes} for rank, a in sorted(audits.items())
        },
    }


def check_audit(audits: dict[int, Audit], out_dir: Path) -> None:
    leaked = {
        rank: {"blocks": a.used_blocks, "staging_buffers": a.loaned_buffers}
        for rank, a in audits.items()
        if a.used_blocks or a.loaned_buffers
    }
    if leaked:
        raise KVLeakError(f"KV audit failed: still allocated at the end of the run {leaked}; results kept in {out_dir}")


def stop_cluster(cluster: Cluster, router: Router, sampler) -> Optional[object]:
    """Stop the workers (each sends its KV audit) and take in their last reports; the telemetry."""
    router.memory.sample()
    router.host.sample()
    telemetry = sampler.stop()
    leftovers: list = []
    cluster.stop(leftovers)
    for msg in leftovers:
        router.handle(msg)
    return telemetry
