"""multiturn: multi-turn sessions, dispatch policies and how later turns' KV is handed over.

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from testbed.config import Config
from testbed.control.config import DISPATCH
from testbed.metrics.summary import decode_itl_samples
from testbed.metrics.uncertainty import request_units, sample_interval
from testbed.studies.aggregates import cell_points, cell_requests, point_steps
from testbed.studies.layouts import layouts
from testbed.studies.study import Study, one_of
from testbed.studies.sweep import Point

HANDOFFS = ("resend", "incremental", "ppd")


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of multiturn."""

    # the cluster.dispatch policies compared
    dispatch: list[str] = field(default_factory=lambda: ["session_affinity", "round_robin"])
    # how disaggregated layouts move a session's later turns (kv_transfer.multiturn)
    handoffs: list[str] = field(default_factory=lambda: list(HANDOFFS))

    def validate(self) -> None:
        one_of("dispatch", self.dispatch, tuple(DISPATCH))
        one_of("handoffs", self.handoffs, HANDOFFS)


def points(cfg: Config) -> list[Point]:
    """Every layout x dispatch policy; a disaggregated layout once per hand-off of later turns
    (resend, incremental, ppd), its decode workers chosen by the same policy where that policy is
    kv_aware (so a session's KV is found again)."""
    own, grid = STUDY.own_settings(cfg), []
    for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
        disagg = overrides["mode"] == "disagg"
        for policy in own.dispatch:
            for handoff in own.handoffs if disagg else [None]:
                knobs = {
                    "label": f"{label} {handoff}" if disagg else label,
                    "mode": overrides["mode"],
                    "dispatch": policy,
                }
                point = {**overrides, "cluster.dispatch": policy}
                if disagg:
                    knobs["handoff"] = handoff
                    point["kv_transfer.multiturn"] = handoff
                    point["cluster.decode_dispatch"] = "kv_aware" if policy == "kv_aware" else "least_loaded"
                name = f"{label}_{handoff}_{policy}" if disagg else f"{label}_{policy}"
                grid.append(Point(name, point, knobs))
    return grid


def aggregate(table, cfg, out_dir) -> dict:
    """Per cell (repeats pooled), each with a 95% interval over the runs: mean TTFT and mean KV
    bytes moved per turn (none moved: 0), and the p99 of the decode workers' per-token step time
    in steps with appends (prefill work beside the decodes) and in decode-only steps."""
    out, itl = {}, {}
    for cell, requests in cell_requests(table, cfg, out_dir).items():
        ok = requests[requests["status"] == "ok"].assign(kv_moved=lambda r: r["kv_bytes"].fillna(0.0))
        out[cell] = {**_mean_by_turn(ok, "ttft"), **_mean_by_turn(ok, "kv_moved", "kv_bytes")}
    for cell, names in cell_points(table).items():
        frames = [point_steps(out_dir, p) for p in names]
        runs = [decode_itl_samples(f) for f in frames if not f.empty]
        runs = [r for r in runs if r is not None]
        if runs:
            itl[cell] = {name: list(sample_interval([r[name] for r in runs], "p99")) for name in runs[0]}
            itl[cell] = {k: [None if np.isnan(v[0]) else v[0], *v[1:]] for k, v in itl[cell].items()}
    return {"turns": out, "decode_itl_p99": itl}


def _mean_by_turn(ok: pd.DataFrame, column: str, name: str = "") -> dict:
    by_turn = {
        str(t): tuple(sample_interval([u[column].to_numpy(float) for u in request_units(g)], "mean"))
        for t, g in ok.groupby("turn")
    }
    key = f"{name or column}_mean_by_turn"
    return {
        key: {t: v[0] for t, v in by_turn.items()},
        f"{key}_low": {t: v[1] for t, v in by_turn.items()},
        f"{key}_high": {t: v[2] for t, v in by_turn.items()},
    }


STUDY = Study(
    "multiturn",
    "multi-turn sessions: dispatch policies and how later turns' KV is handed over",
    points,
    aggregate,
    figures=("ttft_by_turn", "kv_bytes_by_turn", "decode_itl_with_appends"),
    on_vllm=True,
    tiny=(
        "workload.num_requests=2",
        "workload.rate=20",  # sessions at once: at the CPU size's 1/s the first came 2.5 s in, idle
        "workload.turns=3",
        "workload.think_time_s=0.05",
        "experiment.modes=[chunked,disagg]",
        "experiment.own.dispatch=[kv_aware]",
    ),
    keys=("modes",),
    settings=Settings,
)
