"""What one point serves, and on what: the sections every executor reads (the real cluster, the
simulator, an HTTP server's client). The root configuration (testbed/config) builds it with
`cfg.serving`; each executor takes it beside its own section (sim, http), never the root record,
whose studies, trackers and output settings the executors do not read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass

from testbed.control.book import follows_caches
from testbed.control.config import TP_KEYS, ClusterConfig, KVTransferConfig
from testbed.control.layout import describe
from testbed.engine.config import EngineConfig, KVStoreConfig, SchedulerConfig
from testbed.errors import ConfigError
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.model.config import ModelConfig, check_tensor_parallel
from testbed.net.faults import FaultsConfig
from testbed.perf.hardware import HardwareConfig
from testbed.workload.config import WorkloadConfig

MODES = ("colocated", "chunked", "disagg")


@dataclass(frozen=True)
class Serving:
    mode: str = "chunked"  # colocated | chunked | disagg (separate prefill and decode workers)
    seed: int = 0  # everything random derives from it; an integer in [0, 2^32 - 1]
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def follows_caches(self) -> bool:
        """Routing asks where prompts are cached (testbed/control/book.py)."""
        return follows_caches(self.cluster, self.kv_transfer, self.mode == "disagg")

    @property
    def disagg(self) -> bool:
        return self.mode == "disagg"

    def validate(self) -> "Serving":
        """Each section's checks, the mode's tensor-parallel groups, every number in its range."""
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.engine.block_size is None:
            raise ConfigError("engine.block_size is unset: the root configuration decides it (testbed/config)")
        check_values(self)
        self.engine.validate()
        self.scheduler.validate(policy=self.mode)  # mode chunked runs the chunked policy
        self.hardware.validate()
        self.cluster.validate()
        check_tp(self, self.model.args())
        for section in (self.kv_transfer, self.kv_store, self.faults, self.workload, self.slo, self.metrics):
            section.validate()
        return self


def tp_degrees(serving: Serving) -> dict[str, int]:
    """{cluster key: degree} of the mode's tensor-parallel degrees above 1."""
    c = serving.cluster
    kinds = ("prefill", "decode") if serving.disagg else ("mixed",)
    return {TP_KEYS[kind]: c.tp_of(kind) for kind in kinds if c.tp_of(kind) > 1}


def check_tp(serving: Serving, args) -> None:
    """The mode's tensor-parallel degrees, each splitting the model's heads, their groups within
    hardware.num_devices (explicit device maps aside)."""
    c = serving.cluster
    above = tp_degrees(serving)
    for key, tp in above.items():
        check_tensor_parallel(args, tp, f"cluster.{key}")
    n = serving.hardware.num_devices
    if not above or n is None or c.prefill_devices or c.decode_devices:
        return
    groups = c.num_devices(serving.disagg)
    if groups > n:
        raise ConfigError(
            f"mode={serving.mode} with {describe(serving.mode, c)} needs {groups} devices; hardware.num_devices={n}"
        )


# ranges the per-section checks leave open: {dotted key: (lowest, highest)}, both allowed; None: no
# bound on that side. Every other number must be finite (floats) and fit in 64 bits (ints).
BOUNDS = {
    "seed": (0, 2**32 - 1),
    "model.seed": (0, 2**32 - 1),  # numpy's and torch's seeds
    "faults.kill_worker": (0, None),
    "faults.stall_worker": (0, None),
}
POSITIVE = ("cluster.start_timeout_s", "hardware.emulate_memory_gib", "model.rms_norm_eps", "model.rope_theta")
CHOICES = {"model.dtype": ("auto", "float32", "bfloat16", "float16")}
INT64 = (-(2**63), 2**63 - 1)


def check_values(cfg, skip: tuple[str, ...] = ()) -> None:
    """Every number of `cfg` (a dataclass, walked with its lists) finite and in its range, every
    choice one of its names: else a ConfigError naming the key, the value and the range. `skip`:
    top-level fields checked already (the root record's served sections, by Serving.validate)."""
    for key, value in _leaves(cfg, "", skip):
        if isinstance(value, bool) or value is None:
            continue
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(CHOICES[key])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        if isinstance(value, (int, float)):
            _in_range(key, value)


def _in_range(key: str, value) -> None:
    low, high = BOUNDS.get(key, INT64 if isinstance(value, int) else (None, None))
    if (low is not None and value < low) or (high is not None and value > high):
        shown = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{key}={value} is outside {shown}")
    if key in POSITIVE and not value > 0:
        raise ConfigError(f"{key}={value} must be > 0")


def _leaves(node, prefix: str, skip: tuple[str, ...] = ()):
    """(dotted key, value) of every scalar under a dataclass but its `skip` fields; list items as key[i]."""
    if is_dataclass(node):
        for f in fields(node):
            if f.name not in skip:
                yield from _leaves(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _leaves(item, f"{prefix[:-1]}[{i}].")
    else:
        yield prefix[:-1], node
