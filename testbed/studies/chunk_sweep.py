"""chunk_sweep: chunked prefill's chunk size (the step's token budget), TTFT against TPOT.

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.config import Config
from testbed.studies.aggregates import TABLE, by_label
from testbed.studies.layouts import axis_grid, layouts
from testbed.studies.study import Study, positive
from testbed.studies.sweep import Point


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of chunk_sweep."""

    # the scheduler.chunk_size values tried (tokens)
    chunk_sizes: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])

    def validate(self) -> None:
        positive("chunk_sizes", self.chunk_sizes)


def points(cfg: Config) -> list[Point]:
    sizes = list(STUDY.own_settings(cfg).chunk_sizes)
    grid = axis_grid(cfg, layouts(cfg, ["chunked"]), "chunk", sizes, "scheduler.chunk_size")
    for point in grid:  # every running decode must fit in the chunk
        point.overrides["scheduler.max_running"] = min(cfg.scheduler.max_running, point.knobs["chunk"])
    return grid


STUDY = Study(
    "chunk_sweep",
    "chunked prefill's chunk size: TTFT against TPOT",
    points,
    by_label(["chunk", *TABLE]),
    figures=("chunk_tradeoff",),
    on_vllm=True,
    tiny=("experiment.own.chunk_sizes=[32,256]", "hardware.num_devices=1"),
    settings=Settings,
)
