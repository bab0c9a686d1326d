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
    # a resumed sweep's finished point that ran another configuration: refuse (name what changed)
    # or rerun it
    on_changed: str = "refuse"
    # a sweep's points as separate jobs (testbed/studies/shards.py), all into one output_dir:
    shard: Optional[int] = None  # this job runs block `shard` (0-based) of `shards` of the grid; None: all
    shards: int = 1  # how many blocks the grid is cut into (contiguous, in the order one process runs them)
    points: List[str] = field(default_factory=list)  # this job runs these grid points or cells instead
    merge: bool = False  # every grid point there: run the goodput search, aggregate, draw (no grid point runs)
    dry_run: bool = False  # print the model, the sizing and the points with a time estimate; run none
    # the running study's own axes and settings (its Settings dataclass, testbed/studies/NAME.py:
    # experiment.own.chunk_sizes for chunk_sweep, ...), composed only when it runs: {key: value}
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
        if any(v <= 0 for v in self.rates):
            raise ConfigError(f"experiment.rates must all be > 0 (got {list(self.rates)})")
        if self.on_changed not in ("refuse", "rerun"):
            raise ConfigError(f"experiment.on_changed must be refuse or rerun (got {self.on_changed!r})")
        if self.search_points < 0 or not 0 < self.search_tolerance < 1 or self.search_span < 1:
            raise ConfigError(
                f"experiment.search_points must be >= 0, search_tolerance in (0, 1) and search_span "
                f">= 1 (got {self.search_points}, {self.search_tolerance}, {self.search_span})"
            )
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
