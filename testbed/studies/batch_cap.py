"""batch_cap: each mode's throughput and decode latency against the scheduler's batch cap
(`scheduler.max_running`, vLLM's max_num_seqs), over the same workload.

A study written as one module (testbed/studies/study.py): its settings, its points, its aggregate
and its figures; with conf/experiment/batch_cap.yaml and experiments/batch_cap/README.md it is
the whole study."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.studies.aggregates import TABLE, by_label
from testbed.studies.layouts import axis_grid, layouts
from testbed.studies.study import Curve, Study
from testbed.studies.sweep import Point


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of batch_cap."""

    max_running: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])  # the caps tried

    def validate(self) -> None:
        if not self.max_running or any(not isinstance(n, int) or n < 1 for n in self.max_running):
            raise ConfigError(f"experiment.own.max_running must be integers >= 1 (got {self.max_running})")


def points(cfg: Config) -> list[Point]:
    """Each mode's layout at every cap (the cell's knob `max_running`)."""
    caps = STUDY.own_settings(cfg).max_running
    return axis_grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "max_running", caps, "scheduler.max_running")


CAP = "batch cap (scheduler.max_running)"
STUDY = Study(
    "batch_cap",
    "each mode's throughput and decode latency against the scheduler's batch cap (max_running)",
    points,
    by_label(["max_running", *TABLE]),
    figures=(
        Curve(
            "max_running", "throughput_requests_per_s", "batch cap (scheduler.max_running)", "throughput (req/s)", True
        ),
        Curve("max_running", "tpot_p99", "batch cap (scheduler.max_running)", "p99 TPOT (s)", True, better="lower"),
    ),
    on_vllm=True,
    tiny=("experiment.own.max_running=[2,8]", "experiment.modes=[chunked,disagg]"),
    keys=("modes",),
    settings=Settings,
)
