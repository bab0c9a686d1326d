"""slo_scale: each mode's SLO attainment as both SLOs scale tighter or looser.

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from testbed.metrics.slo import attainment_curve, filtered_out, meets_slo, tenant_slos
from testbed.metrics.uncertainty import request_units, share_interval
from testbed.studies.aggregates import finished, point_requests
from testbed.studies.layouts import each_mode_once
from testbed.studies.study import Study, positive


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of slo_scale."""

    # the factors both SLOs (tenant SLOs too) are scaled by
    slo_scales: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])

    def validate(self) -> None:
        positive("slo_scales", self.slo_scales, float)


def aggregate(table, cfg, out_dir) -> dict:
    """Per configuration, its repeats pooled: attainment with both SLOs (tenant SLOs included)
    scaled, with a 95% interval over the runs at each scale."""
    curves, tenants = {}, tenant_slos(cfg.workload.tenants, cfg.slo)
    scales = [float(s) for s in STUDY.own_settings(cfg).slo_scales]
    for label, group in finished(table).groupby("label"):
        requests = pd.concat(
            [point_requests(out_dir, p, cfg).assign(point=p) for p in group["point"]], ignore_index=True
        )
        units = [u[~filtered_out(u)] for u in request_units(requests)]
        curve = attainment_curve(requests, cfg.slo, scales, tenants)
        bounds = [
            tuple(share_interval([meets_slo(u, cfg.slo, tenants, scale=s).to_numpy(float) for u in units if len(u)]))[
                1:
            ]
            for s in scales
        ]
        curves[label] = {
            "scales": list(curve),
            "attainment": list(curve.values()),
            "low": [b[0] for b in bounds],
            "high": [b[1] for b in bounds],
        }
    return {"curves": curves}


STUDY = Study(
    "slo_scale",
    "each mode's SLO attainment as the SLOs scale tighter or looser",
    each_mode_once,
    aggregate,
    figures=("attainment_vs_scale", "latency_cdfs"),
    over_http=True,
    mergeable=True,
    needs_requests=True,
    on_vllm=True,
    tiny=("experiment.modes=[colocated,disagg]",),
    keys=("modes",),
    settings=Settings,
)
