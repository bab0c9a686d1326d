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
from testbed.perf.measured import SHAPE_KEYS, check_profile
from testbed.perf.roofline import RooflineModel

__all__ = ["SHAPE_KEYS", "check_profile", "checked_pool", "gpu_pool_blocks", "kv_bytes_per_token", "plan_sim_workers",
           "pool_blocks"]  # check_profile and SHAPE_KEYS live in testbed.perf.measured


def plan_sim_workers(mode: str, cluster: ClusterConfig, num_devices: Optional[int]) -> list[WorkerPlan]:
    """One plan per worker, ranks in launcher order (P before D); `num_devices=None`: as many
    devices as the plan needs."""
    roles = worker_roles(mode, cluster)
    needed = max(d for _, d in roles) + 1
    if num_devices is not None and needed > num_devices:
        raise ConfigError(f"mode={mode} needs {needed} devices; the simulation was given num_devices={num_devices}")
    return [WorkerPlan(rank, role, f"sim:{d}") for rank, (role, d) in enumerate(roles)]


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
    return checked_pool(blocks, args, engine)


def gpu_pool_blocks(model: RooflineModel, engine: EngineConfig) -> int:
    """An analytical GPU's pool: an explicit block count, else vLLM's sizing, the utilised share
    of the device memory less the weights (activations and the CUDA context are not modelled)."""
    if engine.num_kv_blocks is not None:
        return checked_pool(engine.num_kv_blocks, model.model_args, engine)
    pool = model.kv_pool_bytes(engine.gpu_memory_utilization)
    if pool <= 0:
        raise ConfigError(f"the model's weights ({model.weight_bytes / 1e9:.1f} GB) do not fit in "
                          f"engine.gpu_memory_utilization={engine.gpu_memory_utilization} of {model.gpu.name} "
                          f"({model.gpu.memory_bytes / 1e9:.1f} GB): raise it or simulate a larger GPU")
    block_bytes = model.model_args.kv_bytes_per_token * model.dtype_bytes * engine.block_size
    return checked_pool(int(pool // block_bytes), model.model_args, engine)


def checked_pool(blocks: int, args: ModelArgs, engine: EngineConfig) -> int:
    if blocks * engine.block_size < args.max_model_len:
        raise ConfigError(f"KV pool of {blocks} blocks x {engine.block_size} tokens cannot hold one request of "
                          f"max_model_len={args.max_model_len}: raise engine.kv_cache_mib / engine.num_kv_blocks / "
                          f"engine.gpu_memory_utilization or lower model.max_model_len")
    return blocks
