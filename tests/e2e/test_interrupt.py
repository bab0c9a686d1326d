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

# three points of about two seconds each (12 requests arriving over 1.2 s, and the workers' start)
ARGS = [
    "+experiment=burstiness",
    "experiment.own.burstiness=[0.5,1.0,2.0]",
    "experiment.modes=[chunked]",
    "hardware=cpu",
    "hardware.num_devices=2",
    "workload.num_requests=12",
    "workload.rate=10",
    "experiment.figures=false",
    "experiment.repeats=1",
]


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
    deadline = time.monotonic() + 60  # the workers were told to stop before the run exited; they end on their own
    while [p for p in workers if alive(p)]:
        assert time.monotonic() < deadline, "worker processes outlived the run"
        time.sleep(0.1)
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert table.loc[table.point == "chunked_burstiness0.5", "status"].item() == "ok"
    assert "interrupted" in set(table.status)

    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert table.set_index("point").loc["chunked_burstiness0.5", "status"] == "skipped"
    assert (table.status != "failed").all() and len(table) == 3


# -- a second signal into the shutdown ---------------------------------------------------------------
def complete_results(directory, served: int) -> None:
    """The results directory holds every finished request once, in files written whole (no temporaries)."""
    import json

    summary = json.loads((directory / "summary.json").read_text())
    requests = pd.read_parquet(directory / "requests.parquet")
    assert summary["num_requests"]["ok"] == served == (requests.status == "ok").sum()
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".") and p.suffix == ".tmp" or "tmp" in p.name]


@pytest.mark.parametrize("delay_s", [0.0, 0.2, 1.0])
def test_serve_http_keeps_what_it_served_through_a_second_signal(tmp_path, delay_s):
    """SIGTERM, then SIGINT and SIGTERM again `delay_s` into the shutdown (a process manager, `timeout`,
    a user's second Ctrl-C): the requests served are written once, completely, and the server exits 0."""
    import json
    import urllib.request

    out = tmp_path / "server"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbed.serve_http",
            f"hydra.run.dir={out}",
            "http.port=0",
            "hardware=cpu",
            "cluster.num_workers=1",
            "model.max_model_len=256",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = server.stdout.readline()
        assert " on http://" in line, line + server.stderr.read()
        url = line.split(" on ")[1].split("/v1/")[0]
        for _ in range(3):
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
            request = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 200
        server.send_signal(signal.SIGTERM)
        time.sleep(delay_s)  # the point of the test: where in the shutdown the next signals land
        for again in (signal.SIGINT, signal.SIGTERM):
            if server.poll() is None:
                server.send_signal(again)
        code = server.wait(timeout=300)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    stderr = server.stderr.read()
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    complete_results(out, 3)


def test_a_second_signal_into_a_sweeps_shutdown_keeps_its_finished_points(tmp_path):
    command = [sys.executable, "-m", "testbed", *ARGS, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    first = tmp_path / "points" / "chunked_burstiness0.5" / "summary.json"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the first point never finished"
        time.sleep(0.2)
    time.sleep(1.0)  # well into the second point (a signal while its workers start is another case)
    proc.send_signal(signal.SIGINT)
    for delay_s in (0.05, 0.2, 0.5):  # into the shutdown: the point's workers stopping, sweep.parquet written
        time.sleep(delay_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "every finished point is kept" in stderr and "Traceback" not in stderr, stderr[-3000:]
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert table.loc[table.point == "chunked_burstiness0.5", "status"].item() == "ok"
    assert "interrupted" in set(table.status)
