"""A contended host is measured and said: summary.json's `host` section (each process's run-queue
wait against its own CPU time), the printed summary, and a study's verdict, which names no winner
from points that ran on a contended host."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from testbed.cluster.contention import ContentionSampler, host_summary, schedstat
from testbed.cluster.launcher import available_cores
from testbed.metrics.config import MetricsConfig
from testbed.studies.aggregates import refused_on_contention
from testbed.studies.real_cluster import serve
from testbed.studies.report import contention_lines, host_line, summary_lines
from tests.cluster_helpers import make_config, small_workload

COUNTED = schedstat(os.getpid()) is not None  # Linux: /proc/<pid>/schedstat
needs_counters = pytest.mark.skipif(not COUNTED, reason="no /proc/<pid>/schedstat on this platform")


def test_the_pooled_stretch_is_cpu_weighted_and_judged_against_the_threshold():
    # router: 0.1 s on a core, 0.3 s waiting; worker: 0.9 s on a core, 0.1 s waiting -> (1.0 + 0.4) / 1.0
    spans = {"router": (0.1, 0.3), "worker0": (0.9, 0.1)}
    host = host_summary(spans, 2.0, 0.5, 0.7, 2)
    assert host["stretch"] == pytest.approx(1.4) and not host["contended"]
    assert host["load_1m"] == 0.5 and host["load_1m_end"] == 0.7 and host["cores"] == 2
    assert [p["process"] for p in host["processes"]] == ["router", "worker0"]
    assert host["processes"][0]["stretch"] == pytest.approx(4.0)  # one starved light process does not flip it
    assert host_summary(spans, 1.3, 0.5, 0.7, 2)["contended"]
    unmeasured = host_summary({}, 2.0, math.nan, math.nan, 2)
    assert not unmeasured["contended"] and math.isnan(unmeasured["stretch"])
    assert unmeasured["reference"].startswith("not measured") and host_line(unmeasured) == ""


def test_a_bad_threshold_is_refused():
    with pytest.raises(Exception, match="metrics.contended_stretch must be > 1"):
        MetricsConfig(contended_stretch=1.0).validate()


@needs_counters
def test_a_process_that_died_keeps_its_last_counters():
    proc = subprocess.Popen([sys.executable, "-c", "sum(range(10**6))"])
    sampler = ContentionSampler({"worker0": proc.pid})  # sampled while it starts
    proc.wait()
    sampler.sample()  # gone: its last sample stands
    spans = {p["process"]: p for p in sampler.summary(2.0)["processes"]}
    assert set(spans) == {"router", "worker0"} and spans["worker0"]["cpu_s"] == 0


def best(line="best configuration: 1P1D, ahead of the runner-up colocated by 1 [0.5, 1.5] req/s per GPU"):
    return {"label": "1P1D", "runner_up": "colocated", "separated": True, "line": line, "comparisons": []}


def sweep_rows(contended: list[bool]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "point": [f"p{i}" for i in range(len(contended))],
            "status": "ok",
            "host_contended": [float(c) for c in contended],
            "host_stretch": [3.5 if c else 1.1 for c in contended],
            "host_threshold": 2.0,
        }
    )


def test_a_verdict_names_no_winner_from_contended_points():
    quiet = sweep_rows([False, False, False])
    assert refused_on_contention(best(), quiet) == best()
    assert refused_on_contention(best(), quiet.drop(columns=["host_contended"])) == best()  # simulated points
    refused = refused_on_contention(best(), sweep_rows([False, True, False]))
    assert not refused["separated"] and refused["contended_points"] == ["p1"]
    assert refused["line"].startswith("no winner named: 1 of 3 points ran on a contended host")
    assert "x3.50" in refused["line"] and "metrics.contended_stretch=2" in refused["line"]
    assert refused["line"].endswith("On these points: " + best()["line"])  # what the statistics said stays
    (warning,) = contention_lines(sweep_rows([True, False, True]))
    assert warning.startswith("WARNING: 2 of 3 point(s) ran on a contended host") and warning.endswith("p0, p2")
    assert contention_lines(sweep_rows([False])) == []


TINY = [*small_workload(n=8, rate=20), "mode=chunked"]


def check_host(summary: dict) -> dict:
    """The section is whole and says what it measured; the flag is its stretch against its threshold."""
    host = summary["host"]
    assert host["reference"].startswith("each process's own CPU time") and host["threshold"] == 2.0
    assert {p["process"] for p in host["processes"]} == {"router", "worker0"}
    assert all(p["cpu_s"] > 0 and p["wait_s"] >= 0 for p in host["processes"])
    assert host["stretch"] >= 1.0 and host["contended"] == (host["stretch"] > host["threshold"])
    line = host_line(host)
    assert line in summary_lines(summary) and line.startswith("WARNING: contended host") == host["contended"]
    return host


@pytest.mark.slow
@needs_counters
def test_a_quiet_run_is_not_flagged_unless_its_own_stretch_says_so(tmp_path):
    """The flag is the run's own measurement: a loaded test machine may contend for real, so the
    flag must agree with the stretch measured, and be off wherever that stretch is small."""
    host = check_host(serve(make_config(*TINY), tmp_path, progress=False)["summary"])
    if host["stretch"] < 1.5:
        assert not host["contended"]


def spin(core: int) -> subprocess.Popen:
    """A process that keeps one core busy, at the default priority (the workers' too: beside three
    such processes a worker on that core gets about a quarter of it)."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.slow
@needs_counters
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_run_beside_busy_processes_is_flagged_contended(tmp_path):
    """Three busy processes on the core the worker is pinned to (the launcher pins worker 0 to the
    first core it may use): the worker waits for its core far longer than it runs."""
    busy = [spin(available_cores()[0]) for _ in range(3)]
    try:
        result = serve(make_config(*TINY), tmp_path, progress=False)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    host = check_host(result["summary"])
    assert host["contended"], host
    (worker,) = [p for p in host["processes"] if p["process"] == "worker0"]
    assert worker["stretch"] > host["threshold"], host
    written = (Path(tmp_path) / "summary.json").read_text()
    assert '"contended": true' in written
