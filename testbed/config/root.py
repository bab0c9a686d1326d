"""The root record: every section of conf/config.yaml, validated together. It exists only above
the studies layer; the executors take `cfg.serving` and their own section (testbed/serving.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Optional

from testbed.config.checks import check_budget, check_real_tp
from testbed.config.migrate import RENAMED_VALUES, renamed_value
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.deploy.config import VllmConfig
from testbed.engine.config import EngineConfig, KVStoreConfig, SchedulerConfig
from testbed.errors import ConfigError
from testbed.experiment import ONE_POINT, SIZES, ExperimentConfig
from testbed.http.config import HttpConfig
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.model.config import ModelConfig
from testbed.net.faults import FaultsConfig
from testbed.perf.hardware import HardwareConfig
from testbed.serving import Serving, check_values, tp_degrees
from testbed.sim.config import SimConfig
from testbed.tracking.config import TrackerConfig
from testbed.workload.config import WorkloadConfig
from testbed.workload.limits import LimitsConfig

EXECUTORS = ("real", "sim", "http", "vllm")
# the Hydra configs: conf/ beside testbed/ in a checkout; an installed wheel has them in testbed/conf/
# (setup.py maps conf/ there). Judged by config.yaml: a stale testbed/conf/__pycache__ is no config.
_PACKAGED = Path(__file__).resolve().parents[1] / "conf"
CONF_DIR = _PACKAGED if (_PACKAGED / "config.yaml").is_file() else Path(__file__).resolve().parents[2] / "conf"


@lru_cache(maxsize=1)
def study_names() -> tuple[str, ...]:
    """What experiment.name may say: the one point, and each conf/experiment/NAME.yaml (the studies
    layer's catalog holds one record per name: tests/studies/test_study_catalog.py)."""
    return ONE_POINT, *sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


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
        return self.serving.follows_caches

    @property
    def serving(self) -> Serving:
        """The sections an executor reads (testbed/serving.py)."""
        return Serving(**{f.name: getattr(self, f.name) for f in fields(Serving)})

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
        if self.size not in SIZES:
            raise ConfigError(f"size={self.size!r} is not one of {', '.join(SIZES)}")
        serving = self.serving
        if self.executor == "real":  # before the sections: what real TP workers refuse is the one line said
            self.model.args().check_engine()
            for key, tp in tp_degrees(serving).items():
                check_real_tp(self, f"cluster.{key}={tp}")
        serving.validate()
        # the root's own keys (seed, experiment.rates, ...): the served sections were checked just above
        check_values(self, skip=tuple(f.name for f in fields(Serving)))
        args = self.model.args()
        self.experiment.validate(study_names())
        self.sim.validate()
        self.http.validate()
        self.vllm.validate()
        self.limits.validate()
        check_budget(self, args)  # the workers' share only where a command line runs it: config_problem
        return self
