"""What the simulated cluster is made of: its workers, their KV pool, the profile's model.

The role list is the launcher's (`plan_workers`), but the device count is a parameter, not the
machine's: the simulator exists to run splits this box cannot hold.
"""

from __future__ import annotations

from typing import Mapping, Optional

from testbed.cluster.config import ClusterConfig
from testbed.cluster.launcher import WorkerPlan, worker_roles
from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError
from testbed.model.config import ModelArgs

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def plan_sim_workers(mode: str, cluster: ClusterConfig, num_devices: Optional[int]) -> list[WorkerPlan]:
    """One plan per worker, ranks in launcher order (P before D); `num_devices=None`: as many
    devices as the plan needs."""
    roles = worker_roles(mode, cluster)
    needed = max(d for _, d in roles) + 1
    if num_devices is not None and needed > num_devices:
        raise ConfigError(f"mode={mode} needs {needed} devices; the simulation was given num_devices={num_devices}")
    return [WorkerPlan(rank, role, f"sim:{d}") for rank, (role, d) in enumerate(roles)]


def check_profile(args: ModelArgs, profile: Mapping) -> None:
    """The profile must describe this model's shape (max_model_len aside: it only bounds lengths)."""
    measured = profile["model"]
    wrong = [k for k in SHAPE_KEYS if measured[k] != getattr(args, k)]
    if wrong:
        got = ", ".join(f"{k}={getattr(args, k)} (profile {measured[k]})" for k in wrong)
        raise ConfigError(f"the profile of model {profile.get('model_name')!r} does not match the configured model: {got}")


def kv_bytes_per_token(args: ModelArgs, profile: Mapping) -> int:
    return args.kv_bytes_per_token * int(profile["dtype_bytes"])


def pool_blocks(args: ModelArgs, engine: EngineConfig, profile: Mapping) -> int:
    """ModelRunner's formula: an explicit block count, else the CPU pool size (kv_cache_mib) or,
    for a GPU profile, the share of the free memory the profile measured after the model loaded."""
    block_bytes = kv_bytes_per_token(args, profile) * engine.block_size
    if engine.num_kv_blocks is not None:
        blocks = engine.num_kv_blocks
    elif str(profile["device"]).startswith("cuda"):
        free = profile.get("kv_free_bytes")
        if not free:
            raise ConfigError("the GPU profile has no kv_free_bytes: set engine.num_kv_blocks for the simulation")
        blocks = int(free * engine.gpu_memory_utilization) // block_bytes
    else:
        blocks = int(engine.kv_cache_mib * 2**20) // block_bytes
    if blocks * engine.block_size < args.max_model_len:
        raise ConfigError(f"KV pool of {blocks} blocks x {engine.block_size} tokens cannot hold one request of "
                          f"max_model_len={args.max_model_len}: raise engine.kv_cache_mib / engine.num_kv_blocks / "
                          f"engine.gpu_memory_utilization or lower model.max_model_len")
    return blocks
