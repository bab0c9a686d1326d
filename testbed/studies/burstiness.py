"""burstiness: SLO attainment and TTFT as arrivals get burstier (gamma arrivals of each shape).

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.config import Config
from testbed.studies.aggregates import cells
from testbed.studies.layouts import axis_grid, layouts
from testbed.studies.study import Study, positive
from testbed.studies.sweep import Point


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of burstiness."""

    burstiness: list[float] = field(
        default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0]
    )  # workload.burstiness: the gamma shapes swept

    def validate(self) -> None:
        positive("burstiness", self.burstiness, float)


def points(cfg: Config) -> list[Point]:
    shapes = [float(b) for b in STUDY.own_settings(cfg).burstiness]
    grid = axis_grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "burstiness", shapes, "workload.burstiness")
    for point in grid:
        point.overrides["workload.arrival"] = "gamma"
    return grid


def aggregate(table, cfg, out_dir) -> dict:
    """Per configuration: {burstiness: mean attainment over repeats}, and its interval."""
    out = {}
    for label, group in cells(out_dir).groupby("label"):
        group = group.sort_values("burstiness")
        out[label] = dict(zip(group["burstiness"], group["slo_attainment"]))
        out[f"{label}_interval"] = {
            b: [lo, hi]
            for b, lo, hi in zip(group["burstiness"], group["slo_attainment_low"], group["slo_attainment_high"])
        }
    return out


STUDY = Study(
    "burstiness",
    "SLO attainment and TTFT as arrivals get burstier (gamma shape)",
    points,
    aggregate,
    figures=("burstiness",),
    over_http=True,
    on_vllm=True,
    tiny=("experiment.own.burstiness=[0.5,2.0]", "experiment.modes=[chunked]"),
    keys=("modes",),
    settings=Settings,
)
