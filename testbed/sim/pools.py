"""What the simulated cluster's workers hold: their KV pool, sized by the engine's own rule
(`testbed.engine.kv_pool`) from the profile's model. The workers are planned by the control
plane's rule (`testbed.control.layout`), on a device count that is a parameter, not the machine's:
the simulator exists to run splits this box cannot hold.
"""

from __future__ import annotations

from typing import Mapping

from testbed.engine import kv_pool
from testbed.engine.config import EngineConfig
from testbed.engine.kv_pool import checked_pool, needs_free_bytes
from testbed.errors import ConfigError
from testbed.model.config import ModelArgs
from testbed.perf.measured import SHAPE_KEYS, check_profile
from testbed.perf.roofline import RooflineModel

# check_profile and SHAPE_KEYS live in testbed.perf.measured
__all__ = ["SHAPE_KEYS", "check_profile", "gpu_pool_blocks", "kv_bytes_per_token", "pool_blocks"]


def kv_bytes_per_token(args: ModelArgs, profile: Mapping) -> int:
    return args.kv_bytes_per_token * int(profile["dtype_bytes"])


def pool_blocks(args: ModelArgs, engine: EngineConfig, profile: Mapping) -> int:
    """ModelRunner's pool (`testbed.engine.kv_pool`), with the free GPU memory the profile measured
    after the model loaded standing for the device's."""
    block_bytes = kv_bytes_per_token(args, profile) * engine.block_size
    device_type = str(profile["device"]).split(":")[0]
    free = profile.get("kv_free_bytes")
    if needs_free_bytes(engine, device_type) and not free:
        raise ConfigError("the GPU profile has no kv_free_bytes: set engine.num_kv_blocks for the simulation")
    blocks = kv_pool.pool_blocks(engine, block_bytes, device_type=device_type, free_bytes=free)
    return checked_pool(blocks, engine.block_size, args.max_model_len)


def gpu_pool_blocks(model: RooflineModel, engine: EngineConfig) -> int:
    """An analytical GPU's pool: an explicit block count, else vLLM's sizing, the utilised share
    of the device memory less the weights (activations and the CUDA context are not modelled).
    No memory was measured here, so this budget differs from `kv_pool`'s; the check is shared.
    A tensor-parallel group's pool: each device's, less its share of the weights, in blocks of the
    rank's KV heads; the group holds as many tokens as one rank (so tp x a device's bytes)."""
    args = model.model_args
    if engine.num_kv_blocks is not None:
        return checked_pool(engine.num_kv_blocks, engine.block_size, args.max_model_len)
    pool = model.kv_pool_bytes(engine.gpu_memory_utilization)
    if pool <= 0:
        per_rank = f" per device at TP{model.tp}" if model.tp > 1 else ""
        raise ConfigError(
            f"the model's weights ({model.weight_bytes / 1e9:.1f} GB{per_rank}) do not fit in "
            f"engine.gpu_memory_utilization={engine.gpu_memory_utilization} of {model.gpu.name} "
            f"({model.gpu.memory_bytes / 1e9:.1f} GB): raise it, simulate a larger GPU, or split "
            f"the weights over more devices (cluster.tp, cluster.prefill_tp, cluster.decode_tp)"
        )
    block_bytes = model.rank_kv_bytes_per_token * engine.block_size
    return checked_pool(int(pool // block_bytes), engine.block_size, args.max_model_len)
