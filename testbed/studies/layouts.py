"""What a study lays out on its N devices (hardware.num_devices, or every visible GPU), so that its
configurations compare at equal hardware: colocated and chunked use N mixed workers, and a
disaggregated split pP:dD has p + d = N; and a grid of points over one axis of values."""

from __future__ import annotations

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.studies import placements
from testbed.studies.machine import num_devices
from testbed.studies.sweep import Point


def layouts(cfg: Config, modes: list[str], all_splits: bool = False) -> list[tuple[str, dict]]:
    """(label, overrides) per serving configuration on N devices, its workers of the cluster's TP
    degrees (cluster.tp, prefill_tp, decode_tp); over HTTP, the one server."""
    if cfg.executor == "http":
        return [(cfg.http.label, {"mode": cfg.mode})]
    n, c = num_devices(cfg), cfg.cluster
    chosen = []
    for mode in modes:
        if mode != "disagg":
            if n % c.tp:
                raise ConfigError(f"cluster.tp={c.tp} does not divide the study's {n} devices (hardware.num_devices)")
            chosen.append(placements.Placement(mode, n // c.tp, c.tp))
            continue
        if n < 2:
            raise ConfigError(f"mode=disagg needs at least 2 devices; hardware.num_devices={n}")
        found = placements.splits(n, c.prefill_tp, c.decode_tp)
        if not found:
            raise ConfigError(
                f"cluster.prefill_tp={c.prefill_tp} and cluster.decode_tp={c.decode_tp} leave no split of "
                f"the study's {n} devices (hardware.num_devices): P x prefill_tp + D x decode_tp = {n}"
            )
        chosen += found if all_splits else [placements.middle_split(n, c.prefill_tp, c.decode_tp)]
    return [(p.label, p.overrides_over(c)) for p in chosen]


def rates(cfg: Config) -> list[float]:
    return list(cfg.experiment.rates) or [cfg.workload.rate]


def each_mode_once(cfg: Config) -> list[Point]:
    """Every mode of experiment.modes once, at workload.rate (mode_compare, slo_scale, input_buckets)."""
    return [
        Point(label, overrides, {"label": label, "mode": overrides["mode"], "rate": cfg.workload.rate})
        for label, overrides in layouts(cfg, list(cfg.experiment.modes))
    ]


def mode_rate_grid(cfg: Config) -> list[Point]:
    """Every mode of experiment.modes at every rate (rate_sweep, and the cells sim_validate compares)."""
    return axis_grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "rate", rates(cfg), "workload.rate")


def axis_grid(cfg: Config, configs: list[tuple[str, dict]], axis: str, values: list, key: str) -> list[Point]:
    points = []
    for label, overrides in configs:
        for value in values:
            name = f"{label}_{axis}{value:g}" if isinstance(value, float) else f"{label}_{axis}{value}"
            knobs = {"label": label, "mode": overrides["mode"], axis: value}
            points.append(Point(name, {**overrides, key: value}, knobs))
    return points
