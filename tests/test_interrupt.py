"""A sweep stopped by SIGINT or SIGTERM keeps its finished points, leaves no process behind,
and a rerun into the same directory resumes."""

import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow

ARGS = ["+experiment=burstiness", "experiment.burstiness=[0.5,1.0,2.0,4.0]", "experiment.modes=[chunked]",
        "hardware=cpu", "hardware.num_devices=2", "workload.num_requests=30", "workload.rate=10",
        "experiment.figures=false", "experiment.repeats=1"]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [d for c in children for d in descendants(c)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(status.strip()) and not status.strip().startswith("Z")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_keeps_finished_points_and_rerun_resumes(tmp_path, signum):
    command = [sys.executable, "-m", "testbed", *ARGS, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = tmp_path / "points" / "chunked_burstiness0.5" / "summary.json"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the first point never finished"
        time.sleep(0.2)
    time.sleep(1.0)  # well into the second point
    workers = descendants(proc.pid)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "every finished point is kept" in stderr
    time.sleep(0.5)
    assert not [p for p in workers if alive(p)], "worker processes outlived the run"
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert table.loc[table.point == "chunked_burstiness0.5", "status"].item() == "ok"
    assert "interrupted" in set(table.status)

    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert table.set_index("point").loc["chunked_burstiness0.5", "status"] == "skipped"
    assert (table.status != "failed").all() and len(table) == 4
