"""How many KV blocks a worker's pool holds: the one sizing rule for real and simulated engines.

No clock and no device calls: the caller measures the free GPU memory (the model runner) or
reads it from a profile (the simulator), so both size a pool by the same formula.
"""

from __future__ import annotations

from typing import Optional

from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError


def kv_block_shape(args, block_size: int) -> tuple[int, ...]:
    """One block of the pool, (layers, 2, block_size, Hkv, D): K and V of every layer in one span.
    The pool is these stacked, block-major (ModelRunner.kv_cache); the shared KV store's slots are one each."""
    return (args.num_layers, 2, block_size, args.num_kv_heads, args.head_dim)


def needs_free_bytes(config: EngineConfig, device_type: str) -> bool:
    """Whether `pool_blocks` reads the free memory: a GPU pool with no explicit block count."""
    return device_type == "cuda" and config.num_kv_blocks is None


def pool_blocks(config: EngineConfig, block_bytes: int, *, device_type: str,
                free_bytes: Optional[int] = None) -> int:
    """An explicit `engine.num_kv_blocks`, else on CUDA the `gpu_memory_utilization` share of the
    memory free after the model loaded, else (any host device) `kv_cache_mib`."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device_type == "cuda":
        if free_bytes is None:
            raise ValueError("a CUDA pool is sized from the free memory: pass free_bytes")
        return int(free_bytes * config.gpu_memory_utilization) // block_bytes
    return int(config.kv_cache_mib * 2**20) // block_bytes


def checked_pool(blocks: int, block_size: int, max_model_len: int) -> int:
    """`blocks`, when they hold one request of max_model_len; a pool that cannot serve even one
    request is a configuration error, not something to find out mid-run."""
    if blocks * block_size < max_model_len:
        raise ConfigError(f"KV pool of {blocks} blocks x {block_size} tokens cannot hold one request of "
                          f"max_model_len={max_model_len}: raise engine.kv_cache_mib / engine.num_kv_blocks / "
                          f"engine.gpu_memory_utilization or lower model.max_model_len")
    return blocks
