"""What the root record checks across its sections (`cfg`: the root Config): real tensor-parallel
workers' limits, and the run's estimated span and host memory against `limits`."""

from __future__ import annotations

import os

from testbed.errors import ConfigError
from testbed.workload.estimate import arrival_span_s, host_bytes


def check_real_tp(cfg, what: str) -> None:
    """What real tensor-parallel workers do not combine with, refused in one line."""
    if cfg.model.args().is_moe:
        raise ConfigError(
            f"{what} with a Mixture-of-Experts model: the engine does not shard experts (one device per "
            "worker); the simulator models expert and tensor parallelism (executor=sim)"
        )
    unsupported = {
        "kv_transfer.granularity=layer": cfg.kv_transfer.granularity == "layer",
        "kv_store.capacity_mib > 0": cfg.kv_store.capacity_mib > 0,
    }
    for setting, asked in unsupported.items():
        if asked:
            raise ConfigError(
                f"{what} with {setting}: a tensor-parallel worker's ranks send their KV shares whole "
                "requests at a time, with no shared KV store; use kv_transfer.granularity=request, "
                "kv_store.capacity_mib=0"
            )


GB = 1e9


def check_budget(cfg, args, workers: float = 0.0) -> None:
    """The run's expected arrival span and host memory (its requests', plus `workers` bytes), refused
    above `limits` with the key to raise."""
    span = arrival_span_s(cfg.workload)
    if cfg.executor != "sim" and span is not None and span > cfg.limits.max_run_s:
        raise ConfigError(
            f"the workload's arrivals span about {span:.3g} s ({_span_keys(cfg.workload)}), above "
            f"limits.max_run_s={cfg.limits.max_run_s:g}; raise limits.max_run_s to run it"
        )
    workload = host_bytes(cfg.workload, args.max_model_len)
    cap = cfg.limits.max_memory_gb
    cap_gb = cap if cap is not None else 0.8 * physical_memory() / GB
    if (workload + workers) / GB > cap_gb:
        shown = "" if cap is not None else " (80% of this machine's memory)"
        raise ConfigError(
            f"the run needs about {(workload + workers) / GB:.3g} GB of host memory (requests "
            f"{workload / GB:.3g} GB, workers {workers / GB:.3g} GB), above limits.max_memory_gb="
            f"{cap_gb:.3g}{shown}; raise limits.max_memory_gb to run it"
        )


def _span_keys(workload) -> str:
    if workload.arrival == "trace":
        return f"workload.duration_s={workload.duration_s}, workload.window_s={workload.window_s}"
    return f"workload.num_requests={workload.num_requests} at workload.rate={workload.rate:g}/s"


def worker_bytes(cfg, args) -> float:
    """Weights and explicit KV pools of the real executor's CPU workers (hardware=cpu: on `auto` a
    GPU may hold them)."""
    if cfg.executor != "real" or cfg.hardware.name != "cpu":
        return 0.0
    workers = cfg.cluster.num_prefill + cfg.cluster.num_decode if cfg.mode == "disagg" else cfg.cluster.num_workers
    weights = _parameters(args) * 4  # float32 on CPU; a GPU load builds in float32 on the host first
    kv = 0.0
    if cfg.engine.num_kv_blocks is not None:
        kv = cfg.engine.num_kv_blocks * (cfg.engine.block_size or 16) * args.kv_bytes_per_token * 4
    elif cfg.engine.kv_cache_mib is not None:
        kv = cfg.engine.kv_cache_mib * 2**20
    return float(workers) * (weights + kv)


def _parameters(args) -> float:
    attention = args.hidden_size * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
    mlp = 3 * args.hidden_size * args.intermediate_size
    if args.is_moe:  # every expert's SwiGLU, and the router
        experts = args.num_experts + args.num_shared_experts
        mlp = 3 * args.hidden_size * args.expert_width * experts + args.hidden_size * args.num_experts
    layer = attention + mlp
    embeddings = args.vocab_size * args.hidden_size * (1 if args.tie_embeddings else 2)
    return float(args.num_layers) * layer + embeddings


def physical_memory() -> float:
    """Bytes of RAM on this machine (a guess of 16 GB where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB
