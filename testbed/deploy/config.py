"""The `vllm` section: how `executor=vllm` launches its deployments.

Frozen: the executor takes this section and the few others it reads (testbed/deploy/executor.py),
never the root configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from testbed.errors import ConfigError

# the P/D hand-off: NixlConnector, P2pNcclConnector (CUDA only), ExampleConnector (a shared folder)
CONNECTORS = ("nixl", "p2pnccl", "example")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class VllmConfig:
    python: Optional[str] = None  # the interpreter that runs vLLM (None: this one)
    model: Optional[str] = None  # a checkpoint directory or hub id; None: the test checkpoint (deploy/checkpoint.py)
    served_name: str = "model"  # the id the instances serve it under
    device: str = "auto"  # auto: cuda where CUDA devices are, else cpu
    dtype: str = "auto"  # auto: float32 on CPU (bfloat16 is emulated there, 6-9x slower), the checkpoint's on GPU
    max_model_len: int = 2048  # --max-model-len: the longest prompt and output an instance serves
    max_num_seqs: int = 64  # sequences an instance batches at once
    connector: str = "nixl"  # the P/D hand-off: nixl everywhere, p2pnccl on GPUs, example (a shared folder)
    cores_per_instance: int = 1  # CPU: OpenMP threads an instance computes on, each instance its own cores
    kv_space_gib: float = 1.0  # CPU: an instance's KV cache (VLLM_CPU_KVCACHE_SPACE)
    # CPU: the pause of NIXL's progress thread between polls (NIXL's own is 0: it spins, taking about half
    # of a one-core instance); 0 keeps NIXL's
    nixl_progress_delay_us: int = 100
    gpu_memory_utilization: float = 0.85  # GPU: the share of each device an instance takes
    eager: bool = True  # --enforce-eager: no compilation or CUDA graphs, the fastest start
    prefix_caching: bool = False  # --enable-prefix-caching (multiturn sets it)
    start_timeout_s: float = 900.0  # one instance, from launch to /health answering 200
    stop_timeout_s: float = 20.0  # SIGTERM to SIGKILL
    extra_args: List[str] = field(default_factory=list)  # appended to every instance's command line
    cache_dir: Optional[str] = None  # compile caches and the converted test checkpoint; None: ~/.cache/testbed/vllm
    metrics: bool = True  # scrape each instance's Prometheus /metrics before and after every point
    hand_off_timeout_s: float = 300.0  # a prefill request, from sending to its answer

    def cache(self) -> Path:
        """Where compile caches and the converted test checkpoint live."""
        return Path(self.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "testbed", "vllm"))

    def validate(self) -> "VllmConfig":
        if self.connector not in CONNECTORS:
            raise ConfigError(f"vllm.connector={self.connector!r} is not one of {', '.join(CONNECTORS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"vllm.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"vllm.device={self.device!r} is not one of {', '.join(DEVICES)}")
        if self.nixl_progress_delay_us < 0:
            raise ConfigError(f"vllm.nixl_progress_delay_us must be >= 0 (got {self.nixl_progress_delay_us})")
        for key in ("max_model_len", "max_num_seqs", "cores_per_instance"):
            if getattr(self, key) < 1:
                raise ConfigError(f"vllm.{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("kv_space_gib", "start_timeout_s", "stop_timeout_s", "hand_off_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"vllm.{key} must be > 0 (got {getattr(self, key)})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm.gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ConfigError("vllm.extra_args must be a list of strings (each one command-line word)")
        return self
