"""The devices a run has: real GPUs, CPU workers standing for them, or CPU workers paced to an
emulated GPU (an analytical GPU of the table or a measured profile file), over one node or several."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.errors import ConfigError
from testbed.model.config import PRESETS
from testbed.perf import GPUS, is_gpu
from testbed.perf.precision import KV_DTYPES, WEIGHT_DTYPES, check_dtype

HARDWARE = ("auto", "cpu", "gpu")


def check_spec(key: str, spec: str) -> None:
    """One line when `spec` is neither a GPU of the analytical table nor a profile file."""
    if not (is_gpu(spec) or Path(spec).is_file()):
        raise ConfigError(
            f"{key}={spec!r} is neither a GPU of the analytical table ({', '.join(sorted(GPUS))}) "
            f"nor a profile .json file (from +experiment=profile)"
        )


@dataclass(frozen=True)
class HardwareConfig:
    """`auto` takes the GPUs when CUDA is present, else CPU workers standing for GPUs."""

    name: str = "auto"  # auto (GPUs when CUDA is present, else CPU workers) | cpu | gpu
    num_devices: Optional[int] = None  # CPU: worker processes that stand for GPUs; GPU: GPUs to use
    # emulated devices: real workers paced to a GPU's analytical model or a profile file's
    # (testbed/cluster/emulation.py); per-role overrides for heterogeneous P and D pools
    emulate: Optional[str] = None
    emulate_prefill: Optional[str] = None  # P workers' emulated device (disagg), overriding emulate
    emulate_decode: Optional[str] = None  # D workers' emulated device (disagg), overriding emulate
    emulate_model: Optional[str] = None  # the preset whose shape the pacing models (default: the run's)
    # an emulated analytical GPU's decoder-layer weights and KV cache (fp8: vLLM's --quantization fp8
    # and --kv-cache-dtype fp8, as sim.weight_dtype and sim.kv_dtype); auto: the model's dtype
    emulate_weight_dtype: str = "auto"
    emulate_kv_dtype: str = "auto"  # auto | bfloat16 | float16 | fp8 | fp8_e4m3 | fp8_e5m2
    # an emulated MoE shape's experts whole on a TP worker's ranks (as sim.expert_parallel)
    emulate_expert_parallel: bool = False
    # an emulated point whose steps overran their modelled time in more than this share of steps
    # measured the CPU, not the device: marked, left out of verdicts, and named at the end
    max_overrun_share: float = 0.05
    # the emulated device's KV pool: its memory (GiB) when a profile does not say; the share of the
    # machine's available memory a CPU may give it before the pool is capped (and the cap is said)
    emulate_memory_gib: Optional[float] = None
    emulate_pool_share: float = 0.25  # share of this machine's available memory the emulated KV pools may take, (0, 1]
    # nodes the devices spread over (num_devices / num_nodes each); a KV transfer between nodes
    # crosses the inter-node network (default 200 Gb/s InfiniBand) instead of the intra-node link
    num_nodes: int = 1
    internode_gbps: float = 25.0  # GB/s (bytes, not bits): 200 Gb/s
    internode_latency_s: float = 10e-6  # inter-node KV link's latency per transfer (s)

    def validate(self) -> "HardwareConfig":
        if self.name not in HARDWARE:
            raise ConfigError(f"hardware={self.name!r} is not one of {', '.join(HARDWARE)}")
        if self.num_devices is not None and self.num_devices < 1:
            raise ConfigError(f"hardware.num_devices must be >= 1 (got {self.num_devices})")
        self._validate_nodes()
        self._validate_emulation()
        return self

    def _validate_nodes(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError(f"hardware.num_nodes must be >= 1 (got {self.num_nodes})")
        if self.num_devices is not None and self.num_devices % self.num_nodes:
            raise ConfigError(
                f"hardware.num_devices={self.num_devices} does not divide over hardware.num_nodes={self.num_nodes}"
            )
        if self.internode_gbps <= 0 or self.internode_latency_s < 0:
            raise ConfigError(
                f"hardware.internode_gbps must be > 0 and hardware.internode_latency_s >= 0 "
                f"(got {self.internode_gbps}, {self.internode_latency_s})"
            )

    def _validate_emulation(self) -> None:
        for key in ("emulate", "emulate_prefill", "emulate_decode"):
            if getattr(self, key) is not None:
                check_spec(f"hardware.{key}", getattr(self, key))
        if self.emulate is None and (self.emulate_prefill is None) != (self.emulate_decode is None):
            raise ConfigError(
                "hardware.emulate_prefill and hardware.emulate_decode: set both, or set hardware.emulate "
                "for the role left out (a paced role beside an unpaced one mixes two clocks)"
            )
        check_dtype(self.emulate_weight_dtype, "hardware.emulate_weight_dtype", WEIGHT_DTYPES)
        check_dtype(self.emulate_kv_dtype, "hardware.emulate_kv_dtype", KV_DTYPES)
        if not 0 <= self.max_overrun_share <= 1:
            raise ConfigError(f"hardware.max_overrun_share must be in [0, 1] (got {self.max_overrun_share})")
        if not 0 < self.emulate_pool_share <= 1:
            raise ConfigError(f"hardware.emulate_pool_share must be in (0, 1] (got {self.emulate_pool_share})")
        if self.emulate_model is not None:
            if self.emulate is None and self.emulate_prefill is None:
                raise ConfigError(
                    f"hardware.emulate_model={self.emulate_model} needs hardware.emulate (or the "
                    f"per-role emulate_prefill and emulate_decode)"
                )
            if self.emulate_model not in PRESETS:
                raise ConfigError(f"hardware.emulate_model={self.emulate_model!r} is not one of {', '.join(PRESETS)}")
