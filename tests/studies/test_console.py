"""What a run leaves on screen: its own lines only (no library chatter, a warning said once, not
once per point), tables in the units of the single run with every column named for what it holds,
and the study's verdict last, above the figures' and results' paths."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pandas as pd
import pytest

from testbed import notices
from testbed.cluster import launcher
from testbed.studies.aggregates import capacity_of
from testbed.studies.report import capacity_text, goodput_lines, shown_table, title
from tests.paths import ROOT
from tests.study_runs import run_study

# fontTools' subset lines as the console's plain format prints them, and the loggers' names in the
# job's log file (stamped with the logger's name)
SAID = ("pruned", "dropped", "subsetting", "fontManager")
LOGGERS = ("[fontTools", "[matplotlib", "[PIL")


@pytest.mark.slow
def test_a_study_with_figures_prints_no_library_chatter_and_ends_on_its_verdict(tmp_path):
    """matplotlib's PDF backend has fontTools log every font table it subsets at INFO: none of it
    reaches the console or the job's log, and the last lines are the verdict, the figures, the
    results."""
    out = subprocess.run(
        [sys.executable, "-m", "testbed", "+experiment=ratio_sweep", "size=tiny", "executor=sim"]
        + ["experiment.figures=true", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    logged = (tmp_path / "__main__.log").read_text()
    assert not [line for line in out.stdout.splitlines() if any(word in line for word in SAID)]
    assert not [line for line in logged.splitlines() if any(name in line for name in LOGGERS)]
    lines = out.stdout.strip().splitlines()
    figures = [line for line in lines if line.startswith("figure: ")]
    assert figures and lines[-1] == f"results: {tmp_path}" and lines[-1 - len(figures) : -1] == figures
    assert lines[-2 - len(figures)].startswith(("best configuration", "leaders not separated"))
    assert "TTFT p99 ms" in out.stdout and "ttft_p99" not in out.stdout
    points = (tmp_path / "points.txt").read_text().splitlines()  # the per-point table: in its file, named on screen
    assert len(points) > 2 and f"one row each in {tmp_path / 'points.txt'}" in out.stdout
    assert not [line for line in lines if line.split()[1:2] == ["ok"]]  # no per-point row on screen


@pytest.mark.slow
def test_the_shared_cores_warning_is_said_once_across_a_sweeps_points(tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setattr(launcher, "available_cores", lambda: [0])  # two workers on one core
    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        result = run_study("chunk_sweep", tmp_path, "hardware.num_devices=2")
    assert capsys.readouterr().err.count("telemetry: ") == 1  # on or off: said at the first point only
    assert len(result["table"]) >= 2 and set(result["table"]["status"]) == {"ok"}
    said = [r.getMessage() for r in caplog.records if "CPU workers share" in r.getMessage()]
    assert said == [
        "2 CPU workers share 1 cores: cross-worker contention will appear as interference; "
        "hardware.emulate paces steps to a device model instead"
    ]


def test_sweep_tables_show_latencies_in_ms_under_named_columns():
    table = pd.DataFrame(
        {
            "point": ["a", "b"],
            "status": ["ok", "failed"],
            "ttft_p99": [0.0123, math.nan],
            "slo_attainment": [0.95, math.nan],
            "throughput_requests_per_s": [36.4, math.nan],
        }
    )
    shown = shown_table(table, ["ttft_p99", "itl_p99", "slo_attainment", "throughput_requests_per_s"])
    assert list(shown.columns) == ["point", "status", "TTFT p99 ms", "SLO attainment", "throughput req/s"]
    assert shown.iloc[0].tolist() == ["a", "ok", "12.3", "0.95", "36.4"]
    assert shown.iloc[1].tolist() == ["b", "failed", "-", "-", "-"]
    assert title("e2e_mean") == "E2E mean ms" and title("tpot_p50") == "TPOT p50 ms"


def test_capacity_is_a_bound_where_the_rates_tried_do_not_bracket_it():
    none = capacity_of([20, 40], [0.2, 0.3], itl_slo=0.1)
    every = capacity_of([20, 40], [0.01, 0.02], itl_slo=0.1)
    between = capacity_of([20, 40], [0.05, 0.15], itl_slo=0.1)
    assert (none.value, none.censored) == (20.0, "below") and (every.value, every.censored) == (40.0, "above")
    assert between.value == pytest.approx(30.0) and between.censored == ""
    base = {"rates": [20.0, 40.0], "capacity_low": math.nan, "capacity_high": math.nan}
    below = {**base, "capacity": 0.0, "capacity_bound": 20.0, "capacity_censored": "below"}
    assert capacity_text(below) == "< 20"
    assert capacity_text({**base, "capacity": 40.0, "capacity_bound": 40.0, "capacity_censored": "above"}) == ">= 40"
    assert capacity_text({**base, "capacity": 30.0, "capacity_low": 25.0, "capacity_high": 35.0}) == "30 [25, 35]"
    assert capacity_text({"rates": [20.0], "capacity": 0.0}) == "0"  # a sweep.json saved before the bound
    goodput = {"goodput": 50.0, "goodput_per_gpu": 25.0, "rates_tried": 3}
    lines = goodput_lines({"1P1D": {**below, **goodput}})
    assert "capacity req/s" in lines[0] and "rates tried" in lines[0] and lines[1].endswith("< 20")
