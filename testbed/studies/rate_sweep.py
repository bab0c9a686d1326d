"""rate_sweep: each mode's SLO attainment and latency over offered rates, and its goodput.

A study in one module (testbed/studies/study.py): its points, aggregate and figures."""

from __future__ import annotations

from testbed.studies import aggregates
from testbed.studies.layouts import mode_rate_grid
from testbed.studies.study import Study

STUDY = Study(
    "rate_sweep",
    "each mode's SLO attainment and latency over offered rates, and its goodput",
    mode_rate_grid,
    aggregates.goodput_study,
    figures=("attainment_vs_rate", "latency_vs_rate"),
    **aggregates.GOODPUT_SWEEP,
    tiny=("experiment.rates=[20,40]", "experiment.modes=[chunked,disagg]"),
    keys=("modes",),
)
