"""ratio_sweep, the main study: goodput per GPU of every P:D split beside colocated and chunked on
the same N devices, over rates; with tensor-parallel degrees, every placement that fits.

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from testbed.config import Config
from testbed.studies import aggregates, placements
from testbed.studies.layouts import axis_grid, layouts, mode_rate_grid, rates
from testbed.studies.machine import num_devices
from testbed.studies.study import Study, positive
from testbed.studies.sweep import Point

log = logging.getLogger("testbed")


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of ratio_sweep."""

    # the tensor-parallel degrees its placements may give a worker ([1]: one device each and the
    # splits alone, unless one device cannot hold the model; e.g. [1, 2, 4, 8] places every degree)
    tp_degrees: list[int] = field(default_factory=lambda: [1])

    def validate(self) -> None:
        positive("tp_degrees", self.tp_degrees)


def points(cfg: Config) -> list[Point]:
    """Colocated, chunked and every split at the cluster's degrees, over the rates. With
    experiment.own.tp_degrees beyond [1], or a simulated model one device cannot hold (then the
    smallest degrees that hold it: placements.fitting_degrees, said in one log line), every placement
    over those degrees that fits memory instead (placements.search), each point with its degrees
    as knobs. Over HTTP: the one server at every rate."""
    if cfg.executor == "http":
        return mode_rate_grid(cfg)
    degrees = list(STUDY.own_settings(cfg).tp_degrees)
    c = cfg.cluster
    if degrees == [1] and c.tp == c.prefill_tp == c.decode_tp == 1:
        degrees, why = placements.fitting_degrees(cfg, num_devices(cfg))
        if why:
            log.info("ratio_sweep: %s", why)
    if degrees == [1]:
        configs = layouts(cfg, ["colocated", "chunked"]) + layouts(cfg, ["disagg"], all_splits=True)
        return axis_grid(cfg, configs, "rate", rates(cfg), "workload.rate")
    kept, pruned = placements.search(cfg, num_devices(cfg), degrees)
    if pruned:
        log.info(
            "ratio_sweep: %d placements over TP %s run, %d pruned (memory or heads)", len(kept), degrees, len(pruned)
        )
    grid = axis_grid(cfg, [(p.label, p.overrides_over(c)) for p in kept], "rate", rates(cfg), "workload.rate")
    knobs = {p.label: p.knobs for p in kept}
    for point in grid:
        point.knobs.update(knobs[point.knobs["label"]])
    return grid


STUDY = Study(
    "ratio_sweep",
    "goodput per GPU of every P:D split beside colocated and chunked, over rates",
    points,
    aggregates.goodput_study,
    figures=("goodput_per_gpu", "attainment_vs_rate", "latency_vs_rate", "placement_goodput"),
    **aggregates.GOODPUT_SWEEP,
    tiny=("experiment.rates=[20,40]",),
    keys=("modes",),
    settings=Settings,
)
