"""input_buckets: each mode's TTFT by prompt-length bucket (testbed/metrics/latency.py BUCKETS).

A study in one module (testbed/studies/study.py): its points, aggregate and figures."""

from __future__ import annotations

from testbed.metrics.latency import BUCKETS as LENGTHS
from testbed.studies.aggregates import by_label
from testbed.studies.layouts import each_mode_once
from testbed.studies.study import Study

BUCKETS = [f"ttft_by_bucket_{b}_{s}" for b in LENGTHS for s in ("p50", "p99")]

STUDY = Study(
    "input_buckets",
    "each mode's TTFT by prompt-length bucket",
    each_mode_once,
    by_label(BUCKETS),
    figures=("ttft_by_bucket",),
    over_http=True,
    mergeable=True,
    needs_requests=True,
    on_vllm=True,
    tiny=("experiment.modes=[chunked,disagg]", "workload.input_len.max=6000"),
    keys=("modes",),
)
