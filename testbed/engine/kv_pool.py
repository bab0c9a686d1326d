"""How many KV blocks a worker's pool holds: the one sizing rule for real and simulated engines.

No clock and no device calls: the caller reads the device's memory (the model runner) or takes it
from a profile (the simulator), so both size a pool by the same formula. Workers that share a
device get their pools planned beforehand (testbed/cluster/memory.py) as explicit sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError

GIB = 2**30
DEFAULT_CPU_MIB = 64.0  # a CPU pool with no memory figure to size it from (the simulator's CPU profiles)


def kv_block_shape(args, block_size: int) -> tuple[int, ...]:
    """One block of the pool, (layers, 2, block_size, Hkv, D): K and V of every layer in one span.
    The pool is these stacked, block-major (ModelRunner.kv_cache); the shared KV store's slots are one each."""
    return (args.num_layers, 2, block_size, args.num_kv_heads, args.head_dim)


def sized_from_memory(config: EngineConfig) -> bool:
    """Neither an explicit block count nor an explicit size: the pool is a share of the memory."""
    return config.num_kv_blocks is None and config.kv_cache_mib is None


def needs_free_bytes(config: EngineConfig, device_type: str) -> bool:
    """Whether `pool_blocks` reads the free memory: a GPU pool sized from the memory."""
    return device_type == "cuda" and sized_from_memory(config)


def host_available_bytes() -> Optional[int]:
    """The host memory available to new allocations (Linux MemAvailable); None where not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pool_blocks(
    config: EngineConfig,
    block_bytes: int,
    *,
    device_type: str,
    free_bytes: Optional[int] = None,
    total_bytes: Optional[int] = None,
    used_bytes: int = 0,
    reserve_bytes: int = 0,
    max_blocks: Optional[int] = None,
) -> int:
    """An explicit `engine.num_kv_blocks`, else an explicit `engine.kv_cache_mib`, else:
    - CUDA: the `gpu_memory_utilization` share of the device's total memory less what this process
      already holds (`used_bytes`: the weights, as reserved) and what its steps will take beside the
      pool (`reserve_bytes`: the profiled activation peak, the CUDA-graph pool), as vLLM sizes it;
      refused when the pool and that reserve are more than is free.
      With no total (a profile's measured free memory) the share of `free_bytes`.
    - CPU: the `cpu_memory_utilization` share of the available memory (`free_bytes`) after the
      weights loaded, at most `max_blocks` (what the scheduler can fill); 64 MiB with no figure."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_mib is not None:
        return int(config.kv_cache_mib * 2**20) // block_bytes
    if device_type == "cuda":
        return _gpu_blocks(config, block_bytes, free_bytes, total_bytes, used_bytes, reserve_bytes)
    if free_bytes is None:
        return int(DEFAULT_CPU_MIB * 2**20) // block_bytes
    blocks = int(free_bytes * config.cpu_memory_utilization) // block_bytes
    return min(blocks, max_blocks) if max_blocks is not None else blocks


def _gpu_blocks(
    config: EngineConfig,
    block_bytes: int,
    free_bytes: Optional[int],
    total_bytes: Optional[int],
    used_bytes: int,
    reserve_bytes: int,
) -> int:
    if free_bytes is None:
        raise ValueError("a CUDA pool is sized from the device's memory: pass free_bytes")
    if total_bytes is None:
        return int(free_bytes * config.gpu_memory_utilization) // block_bytes
    budget = int(total_bytes * config.gpu_memory_utilization) - used_bytes - reserve_bytes
    if budget + reserve_bytes > free_bytes:
        raise ConfigError(
            f"engine.gpu_memory_utilization={config.gpu_memory_utilization} of {total_bytes / GIB:.1f} "
            f"GiB leaves a KV pool of {budget / GIB:.2f} GiB after this worker's {used_bytes / GIB:.2f} "
            f"GiB of weights and {reserve_bytes / GIB:.2f} GiB for its steps' activations, but only "
            f"{free_bytes / GIB:.2f} GiB is free (other processes hold the rest): "
            "lower engine.gpu_memory_utilization or set engine.kv_cache_mib"
        )
    return max(budget, 0) // block_bytes


def checked_pool(blocks: int, block_size: int, max_model_len: int) -> int:
    """`blocks`, when they hold one request of max_model_len; a pool that cannot serve even one
    request is a configuration error, not something to find out mid-run."""
    if blocks * block_size < max_model_len:
        raise ConfigError(
            f"KV pool of {blocks} blocks x {block_size} tokens cannot hold one request of "
            f"max_model_len={max_model_len}: raise engine.kv_cache_mib / engine.num_kv_blocks / "
            f"engine.gpu_memory_utilization / engine.cpu_memory_utilization or lower model.max_model_len"
        )
    return blocks
