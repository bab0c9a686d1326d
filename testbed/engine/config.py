"""Engine and scheduler settings (frozen; Hydra validates the YAML against them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from testbed.errors import ConfigError
from testbed.model.kv_layout import ATTENTION_BACKENDS, default_block_size
from testbed.names import Role


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits. `max_batched_tokens` bounds a prefill step (colocated, prefill-only);
    `chunk_size` is the whole step's token budget in chunked mode (Sarathi-Serve's chunk size)."""

    # token budget of a prefill step (colocated mode, disagg prefill workers, a decode worker's recomputed prompts)
    max_batched_tokens: int = 2048
    chunk_size: int = 256  # token budget of a whole chunked-mode step, decodes first (must be >= max_running)
    max_running: int = 64  # sequences resident at once per worker (vLLM's max_num_seqs)

    def validate(self, policy: Optional[str] = None) -> "SchedulerConfig":
        """`policy`: the scheduling policy these limits will run under (None: any), for the rules
        that hold for one policy only."""
        for name in ("max_batched_tokens", "chunk_size", "max_running"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scheduler.{name} must be >= 1 (got {getattr(self, name)})")
        # a chunked step schedules every running decode first (one token each), so a chunk smaller
        # than max_running would leave decodes out of a step
        if policy == Role.CHUNKED and self.chunk_size < self.max_running:
            raise ConfigError(
                f"scheduler.chunk_size={self.chunk_size} must be >= scheduler.max_running="
                f"{self.max_running} so every running decode fits in a chunked step"
            )
        return self


@dataclass(frozen=True)
class EngineConfig:
    # tokens per KV block; None: 256 where flash-attn runs (its page size), else 16
    block_size: Optional[int] = None
    # the KV pool (testbed/engine/kv_pool.py): an explicit block count, else an explicit size in MiB
    # (any device; the cluster sets it for workers that share one), else a share of the memory
    kv_cache_mib: Optional[float] = None
    # the share of a GPU's total memory for all the run's workers on it together (weights and KV);
    # the rest is left to activations and CUDA contexts
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: Optional[int] = None  # an explicit pool size overrides every budget
    attention_backend: str = "auto"  # one of kv_layout.ATTENTION_BACKENDS: auto | flash | triton | cpu | torch
    # share identical prompt blocks between requests (LRU); forced on where routing or kv_store needs it
    enable_prefix_caching: bool = False
    # decode replayed from CUDA graphs captured per batch-size bucket; None: on where CUDA is (and on
    # an analytical GPU of the simulator or emulation, whose decode steps pay eager launches when off)
    cuda_graphs: Optional[bool] = None
    # the modelled engine's host side on an analytical GPU (simulator and emulation; testbed/perf/
    # roofline.py): per-step host time (None: the GPU table's step overhead) and more per sequence
    # a step samples for. A real engine's own host time is what it measures, not these.
    host_overhead_s: Optional[float] = None
    host_overhead_per_seq_s: float = 0.0  # host time per sequence a step samples for (s, analytical GPU only)
    # the share of the host's available memory (after the weights) for the KV pools of all CPU
    # workers together, each pool capped at what max_running requests of max_model_len hold
    cpu_memory_utilization: float = 0.1
    # where prefill and decode workers share a device: the prefill workers' share of its KV memory
    # (prefill holds only the prompts in flight and those waiting for D); decode takes the rest
    prefill_memory_share: float = 0.2

    def host_terms(self, dtype: str = "auto") -> dict:
        """The analytical cost model's dtype and host terms (testbed.perf.resolve.analytical)."""
        return {
            "dtype": dtype,
            "host_fixed_s": self.host_overhead_s,
            "host_per_seq_s": self.host_overhead_per_seq_s,
            "cuda_graphs": self.cuda_graphs,
        }

    @property
    def sets_host(self) -> bool:
        """Host terms set: they apply to an analytical GPU only (a measured profile has its own)."""
        return self.host_overhead_s is not None or self.host_overhead_per_seq_s > 0

    def for_device(self, device_type: str, dtype="auto") -> "EngineConfig":
        """The block size and graph setting this device (and KV dtype) gets when they are unset."""
        from testbed.model.attention import FLASH_ATTN_AVAILABLE

        block = (
            self.block_size
            if self.block_size is not None
            else default_block_size(device_type, FLASH_ATTN_AVAILABLE, dtype, self.attention_backend)
        )
        graphs = self.cuda_graphs if self.cuda_graphs is not None else device_type == "cuda"
        if graphs and device_type != "cuda":
            raise ConfigError(f"engine.cuda_graphs=true needs a CUDA device (this engine runs on {device_type})")
        return replace(self, block_size=block, cuda_graphs=graphs)

    def validate(self) -> "EngineConfig":
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"engine.block_size must be >= 1 (got {self.block_size})")
        if self.kv_cache_mib is not None and self.kv_cache_mib <= 0:
            raise ConfigError(f"engine.kv_cache_mib must be > 0 or unset (got {self.kv_cache_mib})")
        for key in ("gpu_memory_utilization", "cpu_memory_utilization"):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(f"engine.{key} must be in (0, 1] (got {getattr(self, key)})")
        if not 0 < self.prefill_memory_share < 1:
            raise ConfigError(f"engine.prefill_memory_share must be in (0, 1) (got {self.prefill_memory_share})")
        if self.host_overhead_s is not None and self.host_overhead_s < 0:
            raise ConfigError(f"engine.host_overhead_s must be >= 0 or unset (got {self.host_overhead_s})")
        if self.host_overhead_per_seq_s < 0:
            raise ConfigError(f"engine.host_overhead_per_seq_s must be >= 0 (got {self.host_overhead_per_seq_s})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"engine.num_kv_blocks must be >= 1 (got {self.num_kv_blocks})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"engine.attention_backend={self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )
        return self


@dataclass(frozen=True)
class KVStoreConfig:
    """A KV store in host memory shared by the run's workers (testbed/engine/kv_store.py):
    `capacity_mib` of blocks, LRU; 0 turns it off. It needs prefix caching, which it turns on."""

    capacity_mib: float = 0.0  # size of the host-memory KV store shared by all workers (MiB; 0: off)
    gbps: float = 25.0  # the simulator's link to the store (GB/s: PCIe 4.0 x16 as measured, about)

    def validate(self) -> "KVStoreConfig":
        if self.capacity_mib < 0:
            raise ConfigError(f"kv_store.capacity_mib must be >= 0 (got {self.capacity_mib})")
        if self.gbps <= 0:
            raise ConfigError(f"kv_store.gbps must be > 0 (got {self.gbps})")
        return self
