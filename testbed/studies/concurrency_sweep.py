"""concurrency_sweep: closed-loop users, throughput and latency against the requests in flight.

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
    """`experiment.own` of concurrency_sweep."""

    concurrencies: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # workload.concurrency: the users swept

    def validate(self) -> None:
        positive("concurrencies", self.concurrencies)


def points(cfg: Config) -> list[Point]:
    """Every mode under a closed loop of each number of users (no offered rate: the users' pace)."""
    users = list(STUDY.own_settings(cfg).concurrencies)
    return axis_grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "concurrency", users, "workload.concurrency")


def aggregate(table, cfg, out_dir) -> dict:
    """Per configuration: {users: mean throughput (req/s) over repeats}, and its p50/p99 TTFT and TPOT."""
    out = {}
    for label, group in cells(out_dir).groupby("label"):
        group = group.sort_values("concurrency")
        users = [int(n) for n in group["concurrency"]]
        out[label] = dict(zip(users, group["throughput_requests_per_s"]))
        out[f"{label}_latency"] = {
            n: {key: row[key] for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
            for n, (_, row) in zip(users, group.iterrows())
        }
    return out


STUDY = Study(
    "concurrency_sweep",
    "closed-loop users: throughput and latency against the number of requests in flight",
    points,
    aggregate,
    figures=("latency_vs_concurrency",),
    over_http=True,
    on_vllm=True,
    tiny=("experiment.own.concurrencies=[1,4]", "experiment.modes=[chunked]"),
    keys=("modes",),
    settings=Settings,
)
