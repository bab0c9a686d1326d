"""What a study sweeps. Each conf/experiment/NAME.yaml sets `experiment.name` and only the
values that differ from the defaults here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from testbed.errors import ConfigError

ONE_POINT = "serve"  # the study without a conf/experiment file: one point with the config as it is
# A study's sizes (`size=NAME`, testbed/sizing.py): gpu is its file's top level, cpu its
# experiment.sizes.cpu on top, tiny (the least that exercises it) its catalog record's on top of cpu.
# With executor=vllm the CPU size is experiment.sizes.vllm_cpu over the catalog's VLLM_CPU_BASE.
SIZES = ("gpu", "cpu", "tiny")
# the keys every study reads (its name, rates, repeats, sizes, figures, resume and job-splitting
# settings); a goodput search's own; each study adds its axes (testbed/studies/catalog.py Study.keys)
COMMON_KEYS = (
    "name",
    "rates",
    "sizes",
    "figures",
    "repeats",
    "on_changed",
    "shard",
    "shards",
    "points",
    "merge",
    "dry_run",
)
SEARCH_KEYS = ("search_points", "search_tolerance", "search_span")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = ONE_POINT  # the study: serve (one point, the config as it is) or a conf/experiment/NAME.yaml
    # serving modes a study lays out (rate_sweep, mode_compare, slo_scale, burstiness, interference, multiturn, ...)
    modes: List[str] = field(default_factory=lambda: ["colocated", "chunked", "disagg"])
    rates: List[float] = field(default_factory=list)  # empty: workload.rate alone
    # chunk_sweep and plan: the scheduler.chunk_size values tried (tokens)
    chunk_sizes: List[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    # concurrency_sweep: the closed loop's users (workload.concurrency) swept
    concurrencies: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    # burstiness study: the gamma shapes (workload.burstiness) swept
    burstiness: List[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    # slo_scale: the factors both SLOs are scaled by
    slo_scales: List[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
    # interference: the injected prefills' prompt lengths (tokens)
    prefill_lengths: List[int] = field(default_factory=lambda: [512, 2048, 8192, 32768])
    # multiturn: the cluster.dispatch policies compared
    dispatch: List[str] = field(default_factory=lambda: ["session_affinity", "round_robin"])
    # multiturn: how disaggregated layouts move a session's later turns (kv_transfer.multiturn)
    handoffs: List[str] = field(default_factory=lambda: ["resend", "incremental", "ppd"])
    message_mib: int = 1024  # kv_bandwidth: the largest message
    measured_sweep: Optional[str] = None  # plan: a real ratio_sweep directory to compare with
    # plan: the tensor-parallel degrees its placements may give a worker ([1]: one device each, the
    # split search alone; e.g. [1, 2, 4, 8] places every P, D and mixed TP degree; executor=sim GPUs)
    tp_degrees: List[int] = field(default_factory=lambda: [1])
    # plan over tp_degrees: each point's workload.num_requests at most this, since the placements
    # multiply the points (None: the workload's)
    placement_requests: Optional[int] = None
    quick_profile: bool = False  # profile: fewer shapes and repeats
    # {"cpu": {dotted key: value}}: the same study at a size two CPU cores finish, added to the
    # command line as overrides by `size=cpu` (chosen where no GPU will run: testbed/sizing.py)
    sizes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    figures: bool = True  # draw the study's figures when it ends
    # Each point runs this many times, with seeds seed, seed+1, ...: the intervals across repeats
    # are what lets a study say that one configuration beats another (1: no interval).
    repeats: int = 3
    # goodput studies (ratio_sweep, rate_sweep, plan): after the grid, each configuration and repeat
    # brackets and narrows the rate where its fitted attainment crosses 90%, with at most this many
    # extra points (0: the grid alone), until the search error is within search_tolerance of the
    # goodput, within [lowest rate / search_span, highest rate * search_span]
    search_points: int = 5
    search_tolerance: float = 0.1  # goodput search ends when its error is within this share of the goodput, (0, 1)
    search_span: float = 8.0  # goodput search stays within [lowest rate / this, highest rate * this] (>= 1)
    # interference: the background's output length is sized to outlast the injections, this many
    # times the cost model's estimate (a model's estimate: err long); 0 keeps the configured length
    background_margin: float = 2.0
    # a resumed sweep's finished point that ran another configuration: refuse (name what changed)
    # or rerun it
    on_changed: str = "refuse"
    # replay: a real engine's result file (vLLM bench serve JSON, SGLang bench_serving JSONL), the
    # run's setup YAML (GPU, model, engine knobs: testbed/studies/replay.py), and whether to run
    # the workload in emulation too (small synthetic workloads only: it runs in real time)
    reference: Optional[str] = None
    setup: Optional[str] = None  # replay: the reference run's setup YAML (GPU, model, engine knobs)
    replay_emulate: bool = False  # replay: also run the workload in emulation (small synthetic workloads only)
    # a sweep's points as separate jobs (testbed/studies/shards.py), all into one output_dir:
    shard: Optional[int] = None  # this job runs block `shard` (0-based) of `shards` of the grid; None: all
    shards: int = 1  # how many blocks the grid is cut into (contiguous, in the order one process runs them)
    points: List[str] = field(default_factory=list)  # this job runs these grid points or cells instead
    merge: bool = False  # every grid point there: run the goodput search, aggregate, draw (no grid point runs)
    dry_run: bool = False  # print the model, the sizing and the points with a time estimate; run none
    # a study module's own settings (its Settings dataclass, testbed/studies/NAME.py): {key: value}
    own: Dict[str, Any] = field(default_factory=dict)

    def validate(self, studies: Sequence[str]) -> "ExperimentConfig":
        """`studies`: the names experiment.name may say (the config layer reads them from conf/)."""
        if self.name not in studies:
            raise ConfigError(f"experiment.name={self.name!r} is not one of {', '.join(studies)}")
        if set(self.sizes) - {"cpu", "vllm_cpu"}:
            raise ConfigError(
                f"experiment.sizes has {sorted(set(self.sizes) - {'cpu', 'vllm_cpu'})}; allowed: cpu, vllm_cpu "
                f"(gpu is the study file's top level, tiny its catalog record)"
            )
        bad = [m for m in self.modes if m not in ("colocated", "chunked", "disagg")]
        if bad:
            raise ConfigError(f"experiment.modes has {bad}; allowed: colocated, chunked, disagg")
        for key in (
            "rates",
            "chunk_sizes",
            "burstiness",
            "slo_scales",
            "prefill_lengths",
            "tp_degrees",
            "concurrencies",
        ):
            if any(v <= 0 for v in getattr(self, key)):
                raise ConfigError(f"experiment.{key} must all be > 0 (got {list(getattr(self, key))})")
        bad = [h for h in self.handoffs if h not in ("resend", "incremental", "ppd")]
        if bad:
            raise ConfigError(f"experiment.handoffs has {bad}; allowed: resend, incremental, ppd")
        if self.background_margin < 0:
            raise ConfigError(f"experiment.background_margin must be >= 0 (got {self.background_margin})")
        if self.on_changed not in ("refuse", "rerun"):
            raise ConfigError(f"experiment.on_changed must be refuse or rerun (got {self.on_changed!r})")
        if self.search_points < 0 or not 0 < self.search_tolerance < 1 or self.search_span < 1:
            raise ConfigError(
                f"experiment.search_points must be >= 0, search_tolerance in (0, 1) and search_span "
                f">= 1 (got {self.search_points}, {self.search_tolerance}, {self.search_span})"
            )
        if self.placement_requests is not None and self.placement_requests < 1:
            raise ConfigError(f"experiment.placement_requests must be >= 1 when set (got {self.placement_requests})")
        if self.repeats < 1:
            raise ConfigError(f"experiment.repeats must be >= 1 (got {self.repeats})")
        self._validate_shards()
        return self

    def _validate_shards(self) -> None:
        if self.shards < 1 or (self.shard is not None and not 0 <= self.shard < self.shards):
            raise ConfigError(
                f"experiment.shard must be in [0, experiment.shards) and shards >= 1 (got shard={self.shard}, "
                f"shards={self.shards})"
            )
        if self.shard is not None and self.points:
            raise ConfigError("experiment.shard and experiment.points both choose the points: set one")
        if self.merge and (self.shard is not None or self.points):
            raise ConfigError("experiment.merge gathers every shard's points: leave experiment.shard and points unset")
