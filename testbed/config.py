"""The root configuration: typed dataclasses that validate every YAML file under conf/.

Hydra and OmegaConf stop here and in the studies layer; everything below receives these
dataclasses (`OmegaConf.to_object` builds them), never a DictConfig.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from testbed.cluster.emulation import check_spec
from testbed.control.book import follows_caches
from testbed.control.config import RENAMED_BACKENDS, TP_KEYS, ClusterConfig, KVTransferConfig
from testbed.control.layout import describe
from testbed.deploy.config import VllmConfig
from testbed.engine.config import EngineConfig, KVStoreConfig, SchedulerConfig
from testbed.errors import ConfigError, TestbedError
from testbed.experiment import ONE_POINT, SIZES, ExperimentConfig
from testbed.http.config import HttpConfig
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.model.config import PRESETS, ModelConfig, check_tensor_parallel
from testbed.net.faults import FaultsConfig
from testbed.sim.config import SimConfig
from testbed.tracking.config import TrackerConfig
from testbed.workload.config import WorkloadConfig
from testbed.workload.estimate import arrival_span_s, host_bytes

MODES = ("colocated", "chunked", "disagg")
EXECUTORS = ("real", "sim", "http", "vllm")
# the Hydra configs: conf/ beside testbed/ in a checkout; an installed wheel has them in testbed/conf/
# (setup.py maps conf/ there). Judged by config.yaml: a stale testbed/conf/__pycache__ is no config.
_PACKAGED = Path(__file__).resolve().parent / "conf"
CONF_DIR = _PACKAGED if (_PACKAGED / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"
HARDWARE = ("auto", "cpu", "gpu")


@lru_cache(maxsize=1)
def study_names() -> tuple[str, ...]:
    """What experiment.name may say: the one point, and each conf/experiment/NAME.yaml (the studies
    layer's catalog holds one record per name: tests/studies/test_study_catalog.py)."""
    return ONE_POINT, *sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


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


@dataclass(frozen=True)
class LimitsConfig:
    """What one run may cost, estimated from the configuration before anything is drawn: the span
    of its arrivals in wall-clock seconds (real and http executors; the simulator's clock is its
    own) and its host memory in GB (requests, results, and with hardware=cpu the workers' weights
    and explicit KV pools)."""

    max_run_s: float = 86400.0  # a day
    max_memory_gb: Optional[float] = None  # None: 80% of this machine's physical memory

    def validate(self) -> "LimitsConfig":
        for key in ("max_run_s", "max_memory_gb"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"limits.{key}={value} must be > 0")
        return self


class Decided(NamedTuple):
    """A value the configuration chose for itself, and why."""

    value: Any
    why: str


@dataclass(frozen=True)
class Config:
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
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    # real | sim (the calibrated simulator) | http (an OpenAI-compatible server) | vllm (deployments it launches)
    executor: str = "real"
    sim: SimConfig = field(default_factory=SimConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    output_dir: Optional[str] = None  # default: Hydra's run directory
    size: str = "gpu"  # gpu | cpu | tiny: the study's size that ran (chosen by testbed/sizing.py where unset)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    @property
    def follows_caches(self) -> bool:
        """Routing asks where prompts are cached (testbed/control/book.py)."""
        return follows_caches(self.cluster, self.kv_transfer, self.mode == "disagg")

    def __post_init__(self) -> None:
        decided = {}  # what the configuration decided for itself: printed by the entry point, kept in .hydra/
        wants_cache = self.follows_caches or self.kv_store.capacity_mib > 0  # routes to, or fills, the caches
        if wants_cache and not self.engine.enable_prefix_caching:
            object.__setattr__(self, "engine", replace(self.engine, enable_prefix_caching=True))
            decided["engine.enable_prefix_caching"] = Decided(True, "routing follows the caches or kv_store fills them")
        if self.engine.block_size is None:  # one block size for the workers, the simulator and the split estimates
            object.__setattr__(self, "engine", replace(self.engine, block_size=self._default_block_size()))
            decided["engine.block_size"] = Decided(
                self.engine.block_size, "flash-attn's page size where it runs, else 16"
            )
        object.__setattr__(self, "_decided", decided)  # not a field: results and round trips keep the values only

    @property
    def decided(self) -> dict[str, Decided]:
        """{key: Decided(value, why)} for each value the configuration chose itself (engine.block_size
        when unset, prefix caching where routing or the KV store needs it)."""
        return dict(getattr(self, "_decided", {}))

    def _default_block_size(self) -> int:
        """flash-attn's page size where real workers will run it, else 16. flash-attn is looked
        for before CUDA, so a CPU or simulated run never imports torch to decide."""
        from importlib.util import find_spec

        from testbed.cluster.layout import cuda_count
        from testbed.model.kv_layout import default_block_size

        flash = find_spec("flash_attn") is not None
        cuda = flash and self.executor == "real" and cuda_count(self.hardware) > 0  # torch only where flash-attn is
        return default_block_size("cuda" if cuda else "cpu", flash, self.model.dtype, self.engine.attention_backend)

    def validate(self) -> "Config":
        problem = renamed_value(
            {key: getattr(getattr(self, key.split(".")[0]), key.split(".")[1]) for key in RENAMED_VALUES}
        )
        if problem:
            raise ConfigError(problem)
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor={self.executor!r} is not one of {', '.join(EXECUTORS)}")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.size not in SIZES:
            raise ConfigError(f"size={self.size!r} is not one of {', '.join(SIZES)}")
        check_values(self)
        args = self.model.args()
        self.engine.validate()
        self.scheduler.validate(policy=self.mode)  # mode chunked runs the chunked policy
        self.hardware.validate()
        self.cluster.validate()
        check_tp(self, args)
        self.kv_transfer.validate()
        self.kv_store.validate()
        self.faults.validate()
        self.workload.validate()
        self.slo.validate()
        self.metrics.validate()
        self.tracker.validate()
        self.experiment.validate(study_names())
        self.sim.validate()
        self.http.validate()
        self.vllm.validate()
        self.limits.validate()
        check_budget(self, args)  # the workers' share only where a command line runs it: config_problem
        return self


def check_real_tp(cfg: Config, what: str) -> None:
    """What real tensor-parallel workers do not combine with, refused in one line."""
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


def check_tp(cfg: Config, args) -> None:
    """The mode's tensor-parallel degrees, each splitting the model's heads, their groups within
    hardware.num_devices (explicit device maps aside); real workers' limits (check_real_tp)."""
    c = cfg.cluster
    kinds = ("prefill", "decode") if cfg.mode == "disagg" else ("mixed",)
    above = {TP_KEYS[kind]: c.tp_of(kind) for kind in kinds if c.tp_of(kind) > 1}
    for key, tp in above.items():
        if cfg.executor == "real":
            check_real_tp(cfg, f"cluster.{key}={tp}")
        check_tensor_parallel(args, tp, f"cluster.{key}")
    n = cfg.hardware.num_devices
    if not above or n is None or c.prefill_devices or c.decode_devices:
        return
    groups = c.num_devices(cfg.mode == "disagg")
    if groups > n:
        raise ConfigError(
            f"mode={cfg.mode} with {describe(cfg.mode, c)} needs {groups} devices; hardware.num_devices={n}"
        )


# ranges the per-package checks leave open: {dotted key: (lowest, highest)}, both allowed; None: no
# bound on that side. Every other number must be finite (floats) and fit in 64 bits (ints).
BOUNDS = {
    "seed": (0, 2**32 - 1),
    "model.seed": (0, 2**32 - 1),  # numpy's and torch's seeds
    "faults.kill_worker": (0, None),
    "faults.stall_worker": (0, None),
    "experiment.message_mib": (1, None),
}
POSITIVE = ("cluster.start_timeout_s", "hardware.emulate_memory_gib", "model.rms_norm_eps", "model.rope_theta")
CHOICES = {"model.dtype": ("auto", "float32", "bfloat16", "float16")}
INT64 = (-(2**63), 2**63 - 1)


def check_values(cfg) -> None:
    """Every number of `cfg` (a dataclass, walked with its lists) finite and in its range, every
    choice one of its names: else a ConfigError naming the key, the value and the range."""
    for key, value in _leaves(cfg, ""):
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


def _leaves(node, prefix: str):
    """(dotted key, value) of every scalar under a dataclass; list items as key[i]."""
    if is_dataclass(node):
        for f in fields(node):
            yield from _leaves(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _leaves(item, f"{prefix[:-1]}[{i}].")
    else:
        yield prefix[:-1], node


GB = 1e9


def check_budget(cfg: "Config", args, workers: float = 0.0) -> None:
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


def worker_bytes(cfg: "Config", args) -> float:
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
    layer = attention + 3 * args.hidden_size * args.intermediate_size
    embeddings = args.vocab_size * args.hidden_size * (1 if args.tie_embeddings else 2)
    return float(args.num_layers) * layer + embeddings


def physical_memory() -> float:
    """Bytes of RAM on this machine (a guess of 16 GB where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def _writable(node: DictConfig) -> DictConfig:
    """Frozen dataclasses make read-only nodes; Hydra must still merge YAML and overrides."""
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
        elif isinstance(child, ListConfig):
            OmegaConf.set_readonly(child, False)
    return node


@lru_cache(maxsize=1)  # once a process: Hydra's store keeps it (a second structuring costs 0.1 s a compose)
def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=_writable(OmegaConf.structured(Config)))


# renamed config keys: the old name is refused in one line that names the new one
RENAMED = {"kv_transfer.binding": "kv_transfer.decode_binding"}


def renamed_key(keys) -> Optional[str]:
    """The one-line refusal of the first renamed key among `keys` (dotted), or None."""
    for key in keys:
        if key in RENAMED:
            return f"{key} was renamed {RENAMED[key]}: set {RENAMED[key]} instead"
    return None


# renamed config values: {dotted key: {old value: new value}}; the old value is refused in one line
# that names the new one
RENAMED_VALUES = {"kv_transfer.backend": RENAMED_BACKENDS}


def renamed_value(settings: dict) -> Optional[str]:
    """The one-line refusal of the first renamed value among `settings` ({dotted key: value}), or None."""
    for key, value in settings.items():
        new = RENAMED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
        if new:
            return f"{key}={value} was renamed {key}={new}: set {key}={new} instead"
    return None


def upgraded(stored: dict) -> dict:
    """A stored config (a results directory's config.yaml) with renamed values under their new
    names: results written before a rename still resume, merge and compare."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in stored.items()}
    for key, renames in RENAMED_VALUES.items():
        section, name = key.split(".", 1)
        values = out.get(section)
        if isinstance(values, dict) and isinstance(values.get(name), str):
            values[name] = renames.get(values[name], values[name])
    return out


def _check_renamed(container: dict) -> None:
    keys = [f"{section}.{key}" for section, values in container.items() if isinstance(values, dict) for key in values]
    problem = renamed_key(keys)
    if problem:
        raise ConfigError(problem)


def config_from_dict(stored: dict) -> Config:
    """A Config from its stored form (a results directory's config.yaml, or what torchrun's rank 0
    sends the other ranks with each point)."""
    return to_config(OmegaConf.create(stored))


def to_config(cfg: DictConfig) -> Config:
    """Typed, validated config from a composed DictConfig (Hydra's own keys dropped)."""
    container = _container(cfg)
    try:  # a composed config's values have their fields' types already: built directly, ten times faster
        typed = _built(Config, container)
    except _NotPlain:  # a value OmegaConf must convert, or refuse in its own words
        typed = _merged(container)
    return typed.validate()


def to_config_by_merge(cfg: DictConfig) -> Config:
    """to_config with every value merged into the schema by OmegaConf (what to_config's direct
    build must equal: tests/config/test_validation.py)."""
    return _merged(_container(cfg)).validate()


def _container(cfg: DictConfig) -> dict:
    """The composed config's plain values, Hydra's own keys dropped, renamed keys refused."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    _check_renamed(container)
    return container


def _merged(container: dict) -> Config:
    return OmegaConf.to_object(OmegaConf.merge(_schema(), container))


@lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The Config schema as a writable node, built once (half of a conversion's time): merge
    copies it, never changes it."""
    return _writable(OmegaConf.structured(Config))


def with_overrides(cfg: Config, overrides: dict) -> Config:
    """A copy of `cfg` with dotted keys set ("cluster.num_prefill": 2), validated again."""
    problem = renamed_key(overrides)
    if problem:
        raise ConfigError(problem)
    try:  # a sweep's points set plain values: replaced directly, ten times faster than OmegaConf
        return _replaced(cfg, overrides).validate()
    except _NotPlain:
        pass
    node = OmegaConf.structured(cfg)
    _writable(node)
    for key, value in overrides.items():
        OmegaConf.update(node, key, value, merge=False)
    return OmegaConf.to_object(node).validate()


class _NotPlain(Exception):
    """An override that OmegaConf must merge (a list, a mapping, a value of another type)."""


@lru_cache(maxsize=None)
def _field_types(cls) -> dict:
    return get_type_hints(cls)


def _replaced(node, overrides: dict):
    """`node` with dotted keys set by dataclasses.replace, where each value has its field's type."""
    values, nested = {}, {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            values[head] = value
    types = _field_types(type(node))
    if not set(values) | set(nested) <= set(types) or set(values) & set(nested):
        raise _NotPlain
    changes = {head: _plain(types[head], value) for head, value in values.items()}
    for head, sub in nested.items():
        if not is_dataclass(getattr(node, head)):
            raise _NotPlain
        changes[head] = _replaced(getattr(node, head), sub)
    return replace(node, **changes)


def _built(cls, values):
    """Dataclass `cls` from a container's values (a key left out: the field's default), each of
    its field's type already; _NotPlain where OmegaConf must convert or refuse something."""
    hints = _field_types(cls)
    if type(values) is not dict or not values.keys() <= hints.keys():
        raise _NotPlain
    kwargs = {key: _typed(hints[key], value) for key, value in values.items()}
    try:
        return cls(**kwargs)
    except TypeError:  # a field with no default left out, or not one __init__ takes
        raise _NotPlain from None


def _typed(hint, value):
    """`value` as a field typed `hint` holds it: nested configs, lists and mappings of plain values."""
    if is_dataclass(hint):
        return _built(hint, value)
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union and type(None) in args:
        kinds = [a for a in args if a is not type(None)]
        if value is None or len(kinds) != 1:
            return _plain(hint, value)
        return _typed(kinds[0], value)
    if origin is list and type(value) is list:
        return [_typed(args[0], v) for v in value]
    if origin is dict and type(value) is dict and args[0] is str and all(type(k) is str for k in value):
        return {k: _typed(args[1], v) for k, v in value.items()}
    if hint is Any or (hint is str and type(value) is str):
        return _any(value)  # a string with "${": OmegaConf reads it as an interpolation, its path
    return _plain(hint, value)


def _any(value):
    """A field typed Any: plain values, lists and string-keyed mappings of them, copied."""
    if value is None or type(value) in (bool, int, float) or (type(value) is str and "${" not in value):
        return value
    if type(value) is list:
        return [_any(v) for v in value]
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: _any(v) for k, v in value.items()}
    raise _NotPlain


def _plain(hint, value):
    """`value` as the field typed `hint` holds it (an int into a float field), or _NotPlain."""
    if get_origin(hint) is Union and type(None) in get_args(hint):
        if value is None:
            return None
        kinds = [a for a in get_args(hint) if a is not type(None)]
        if len(kinds) != 1:
            raise _NotPlain
        hint = kinds[0]
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise _NotPlain


def compose_config(overrides: list[str]) -> Config:
    """The Config that conf/ composes with `overrides`, outside a Hydra app (a benchmark's command line)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return to_config(compose("config", overrides=overrides))


def override_keys(overrides: list[str]) -> set[str]:
    """Keys a command line set ("+experiment=x", "model=small", "slo.ttft_s=1" -> experiment, model, slo.ttft_s)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


# flags that compose nothing, or compose per job (a multirun): left to Hydra
UNCHECKED_FLAGS = (
    "-m",
    "--multirun",
    "-h",
    "--help",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
)


def check_overrides(argv: list[str]) -> str | None:
    """Compose the config the command line asks for before Hydra runs it, so that an unknown key
    or a mistyped value is one line (Hydra prints several and exits 1): `--cfg job` included. A
    multirun's sweeps and the help and info flags are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    problem = output_dir_problem(argv)
    if problem or any(a.split("=", 1)[0] in UNCHECKED_FLAGS for a in argv):
        return problem
    # Hydra's flags and their values (`--cfg job`) are not overrides; `--cfg job` composes as a run does
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("hydra.")]
    problem = renamed_key(sorted(override_keys(overrides))) or renamed_value(
        dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    )
    if problem:
        return problem
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            composed = compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        return _one_line(error)
    except ValueError as error:  # Hydra's own, e.g. a number given for a config group (`mode=0`)
        return f"{_one_line(error)} (in: {' '.join(overrides)}); a config group takes one of its names"
    return config_problem(composed)


def config_problem(composed: DictConfig) -> str | None:
    """The composed config's refusal in one line, or None: every value's type, range and relations
    and the run's estimated cost, checked once before Hydra makes a run directory."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        typed = to_config(composed)
        # the workers' memory here, not in validate: code builds configs it never runs on CPU workers
        check_budget(typed, typed.model.args(), worker_bytes(typed, typed.model.args()))
        check_here(typed)
    except TestbedError as error:
        return str(error)
    except OmegaConfBaseException as error:  # a value its field's type cannot hold
        return _one_line(error)
    return None


def check_here(cfg: Config) -> None:
    """What the run needs from this machine that a command line can check before any worker starts
    (each is checked again where it is used: a trace may vanish between compose and run): the trace
    file (`workload.path`, found as the run will find it), and flash-attn importing where the real
    executor's workers are asked for `engine.attention_backend=flash`."""
    if cfg.workload.path:
        from testbed.workload.traces import resolve_trace_path

        resolve_trace_path(cfg.workload.path)
    if cfg.executor == "real" and cfg.engine.attention_backend == "flash":
        from importlib.util import find_spec

        from testbed.model.kv_layout import ATTENTION_BACKENDS

        # not installed: said without importing torch; installed: the workers' own test of the import
        if find_spec("flash_attn") is None or not _flash_attn_imports():
            others = ", ".join(b for b in ATTENTION_BACKENDS if b != "flash")
            raise ConfigError(
                "engine.attention_backend=flash needs flash-attn, which does not import here (pip install "
                f"flash-attn on a CUDA machine); engine.attention_backend is one of {others} without it "
                "(auto takes the fastest that runs)"
            )


def _flash_attn_imports() -> bool:
    from testbed.model.attention import FLASH_ATTN_AVAILABLE

    return FLASH_ATTN_AVAILABLE


OUTPUT_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "output_dir")


def output_dir_problem(argv: list[str]) -> str | None:
    """Where results go must be writable before Hydra tries (its own failure is a traceback): the
    directory is created (Hydra would create it next) and probed, as every run's results are."""
    from testbed.tracking.results import write_problem

    given = {a.split("=", 1)[0].lstrip("+"): a.split("=", 1)[1] for a in argv if "=" in a}
    for key in OUTPUT_KEYS:
        if key not in given or "${" in given[key]:  # interpolations are Hydra's to resolve
            continue
        problem = write_problem(Path(given[key]).expanduser())
        if problem:
            return f"{key}={given[key]} cannot be written ({problem}); name a writable directory"
    return None


def _one_line(error: BaseException) -> str:
    parts = []
    while error is not None and len(parts) < 3:
        text = " ".join(
            line.strip()
            for line in str(error).splitlines()
            if line.strip() and not line.strip().startswith(("full_key", "object_type", "reference_type"))
        )
        text = text.split(" Config search path:")[0]
        if text and text not in parts:
            parts.append(text)
        error = error.__cause__
    return ": ".join(parts)
