"""mode_compare: every mode once at workload.rate, latency, attainment and throughput side by side.

A study in one module (testbed/studies/study.py): its points, aggregate and figures."""

from __future__ import annotations

from testbed.studies.aggregates import TABLE, by_label
from testbed.studies.layouts import each_mode_once
from testbed.studies.study import Study

STUDY = Study(
    "mode_compare",
    "every mode once at workload.rate: latency, attainment and throughput side by side",
    each_mode_once,
    by_label(TABLE),
    figures=("latency_summary", "latency_cdfs", "timelines", "telemetry"),
    over_http=True,
    mergeable=True,
    on_vllm=True,
    keys=("modes",),
)
