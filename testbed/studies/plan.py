"""plan: which P:D split to run. The first-order analytical split, the SLO-aware split and a
simulated search over every split and chunk size (and, over tensor-parallel degrees, every
placement that fits) for the most goodput per GPU; given a real ratio_sweep, the measured answer.

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from testbed.config import Config, with_overrides
from testbed.errors import ConfigError
from testbed.sim.load_split import analytical_split
from testbed.sim.slo_split import slo_split
from testbed.studies import placements
from testbed.studies.aggregates import best_of, goodput_by_label
from testbed.studies.layouts import axis_grid, layouts, rates
from testbed.studies.machine import num_devices
from testbed.studies.study import Study, positive
from testbed.studies.sweep import Point

log = logging.getLogger("testbed")


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of plan."""

    chunk_sizes: list[int] = field(default_factory=lambda: [512, 2048, 8192])  # chunked's chunk sizes tried
    # the tensor-parallel degrees its placements may give a worker ([1]: one device each, the split
    # search alone; e.g. [1, 2, 4, 8] places every P, D and mixed TP degree on the analytical GPUs)
    tp_degrees: list[int] = field(default_factory=lambda: [1])
    placement_requests: Optional[int] = None  # over tp_degrees: each point's requests at most this (None: all)
    measured_sweep: Optional[str] = None  # a real ratio_sweep directory to compare with

    def validate(self) -> None:
        positive("chunk_sizes", self.chunk_sizes)
        positive("tp_degrees", self.tp_degrees)
        budget = self.placement_requests
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"experiment.own.placement_requests must be an integer >= 1 when set (got {budget!r})")


def points(cfg: Config) -> list[Point]:
    """Simulated search: every split, colocated, and chunked at each chunk size (the default one
    labelled plain `chunked`, as in ratio_sweep), over the rates. With tp_degrees beyond [1]: every
    placement of the devices over those degrees that can run (studies/placements.py), chunked's
    chunk sizes tried at TP1 only (TP multiplies the placements; the chunk size is its own axis),
    each point with its degrees as knobs. Left at [1] where one device cannot hold the model: the
    smallest degrees that hold it (placements.fitting_degrees, as ratio_sweep), so no layout that
    cannot fit is simulated."""
    own = STUDY.own_settings(cfg)
    degrees = list(own.tp_degrees)
    c = cfg.cluster
    if degrees == [1] and c.tp == c.prefill_tp == c.decode_tp == 1:
        simulated = cfg if cfg.executor == "sim" else with_overrides(cfg, {"executor": "sim"})
        degrees, why = placements.fitting_degrees(simulated, num_devices(cfg))
        if why:
            log.info("plan: %s", why)
    if degrees == [1]:
        configs = [
            (label, o, {}) for label, o in layouts(cfg, ["colocated"]) + layouts(cfg, ["disagg"], all_splits=True)
        ]
        configs += [
            (name, o, {})
            for label, o in layouts(cfg, ["chunked"])
            for name, o in chunk_variants(cfg, label, o, own.chunk_sizes)
        ]
    else:
        configs = tp_configs(cfg, own, degrees)
    grid = axis_grid(cfg, [(label, o) for label, o, _ in configs], "rate", rates(cfg), "workload.rate")
    knobs = {label: k for label, _, k in configs}
    for point in grid:
        point.overrides["executor"] = "sim"
        point.knobs.update(knobs[point.knobs["label"]])
    return grid


def chunk_variants(cfg: Config, label: str, overrides: dict, sizes) -> list[tuple[str, dict]]:
    """A chunked layout at scheduler.chunk_size and at each of `sizes`; the default one keeps the
    plain label, which matches a measured sweep's."""
    default = cfg.scheduler.chunk_size  # the chunked baseline every other study (ratio_sweep) runs
    out = []
    for chunk in sorted({default, *sizes}):
        name = label if chunk == default else f"{label}{chunk}"
        chunked = {"scheduler.chunk_size": chunk, "scheduler.max_running": min(cfg.scheduler.max_running, chunk)}
        out.append((name, {**overrides, **chunked}))
    return out


def tp_configs(cfg: Config, own: Settings, degrees: list[int]) -> list[tuple[str, dict, dict]]:
    """(label, overrides, knobs) of each placement the TP search over `degrees` keeps, its points
    within the settings' placement_requests."""
    kept, _ = placements.search(cfg, num_devices(cfg), degrees)
    budget = own.placement_requests
    fewer = {"workload.num_requests": budget} if budget is not None and budget < cfg.workload.num_requests else {}
    out = []
    for p in kept:
        overrides = {**p.overrides_over(cfg.cluster), **fewer}
        if p.mode != "chunked":
            out.append((p.label, overrides, p.knobs))
            continue
        variants = chunk_variants(cfg, p.label, overrides, own.chunk_sizes if p.tp == 1 else [])
        out += [(name, o, p.knobs) for name, o in variants]
    return out


def aggregate(table, cfg, out_dir) -> dict:
    """The analytical split, the simulated best configuration and, given a real sweep, the measured
    one; with tp_degrees beyond [1], the placement search's best and what it pruned. The planners
    propose only workers that fit their devices: of the smallest TP degree that holds a model one
    device cannot (placements.planning, said under `planned_tp`), none where none does."""
    own = STUDY.own_settings(cfg)
    simulated = goodput_by_label(table, cfg, out_dir)
    # what every planner's devices run: the profile's name (None: none) and its line
    out = {"engine_profile": cfg.sim.engine_profile if cfg.sim.analytical() else None, "engine": cfg.sim.engine_line()}
    try:
        planned, why = placements.planning(cfg, num_devices(cfg))
        out["analytical"] = analytical_split(planned.serving, planned.sim, None, num_devices(cfg))
    except ConfigError as error:
        planned, why = cfg, None
        out.update(analytical=None, analytical_skipped=str(error))
    if why:
        out["planned_tp"] = why
    out.update(slo_plan(planned), simulated={"goodput": simulated, "best": best_of(simulated)})
    if list(own.tp_degrees) != [1]:
        out["placements"] = placement_search(cfg, own.tp_degrees, simulated, out["simulated"]["best"])
    if own.measured_sweep:
        measured = json.loads((Path(own.measured_sweep) / "sweep.json").read_text())["aggregate"]
        out["measured"] = {"goodput": measured.get("goodput", {}), "best": measured.get("best", {})}
    return out


def slo_plan(cfg) -> dict:
    """The SLO-aware split of the cluster's prefill and decode workers; none where they do not fit
    their devices (said why)."""
    try:
        return {"slo_plan": slo_split(cfg.serving, cfg.sim, num_devices(cfg), rate=max(cfg.experiment.rates))}
    except ConfigError as error:
        return {"slo_plan": None, "slo_plan_skipped": str(error)}


def placement_search(cfg, degrees: list[int], simulated: dict, best: dict) -> dict:
    """The TP placement search: the degrees, what ran, what was pruned and why, and the leader by
    goodput per GPU with its 95% interval (best_of's verdict says whether it is separated)."""
    _, pruned = placements.search(cfg, num_devices(cfg), degrees)
    label = best.get("label")
    g = simulated.get(label, {})
    return {
        "tp_degrees": list(degrees),
        "searched": list(simulated),
        "pruned": pruned,
        "best": label,
        "separated": bool(best.get("separated")),
        "goodput_per_gpu": g.get("goodput_per_gpu"),
        "goodput_per_gpu_low": g.get("goodput_per_gpu_low"),
        "goodput_per_gpu_high": g.get("goodput_per_gpu_high"),
    }


STUDY = Study(
    "plan",
    "a simulated search of splits and chunk sizes for the most goodput per GPU",
    points,
    aggregate,
    figures=("plan_goodput", "placement_goodput"),
    searches_goodput=True,
    simulated=True,
    tiny=(
        "experiment.rates=[20,80]",
        "experiment.own.chunk_sizes=[64]",
        "hardware.num_devices=3",
        "workload.num_requests=40",
    ),
    settings=Settings,
)
