"""The command line on real vLLM (skipped where vLLM is not installed): a TERMed run ends its
instances, keeps its finished requests and frees its ports; the main study runs on vLLM at its
smallest size and ends with its verdict."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.vllm_helpers import port_free, processes_of, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def command_line(*args: str, python: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "testbed", "executor=vllm", f"vllm.python={python}", f"hydra.run.dir={out}", *args]


def test_a_termed_run_ends_every_instance_and_keeps_what_finished(tmp_path):
    python = vllm_python()
    run = subprocess.Popen(
        command_line("mode=colocated", "workload.num_requests=40", "workload.rate=1", python=python, out=tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = wait_for_requests(tmp_path, run)
        ports = [int(line.split("--port ")[1].split()[0]) for line in log]
        assert processes_of(run.pid), "the instances were not found while serving"
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, output[-2000:]
    assert "interrupted:" in output and "requests.parquet" in output
    assert (tmp_path / "requests.parquet").is_file() and json.loads((tmp_path / "summary.json").read_text())["partial"]
    assert not processes_of(run.pid)
    assert all(port_free(port) for port in ports)


def wait_for_requests(out: Path, run: subprocess.Popen, timeout_s: float = 900.0) -> list[str]:
    """The launch lines of the run's instances, once they answer requests (an instance's log
    shows a completion served)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert run.poll() is None, run.stdout.read()[-2000:]
        logs = sorted(out.glob("vllm_logs/*/*.log"))
        texts = [log.read_text(errors="replace") for log in logs]
        if texts and all("POST /v1/completions" in t for t in texts):
            return [t.splitlines()[0] for t in texts]
        time.sleep(0.5)
    raise AssertionError("the instances served no request in time")


def test_ratio_sweep_on_vllm_runs_every_split_and_says_its_verdict(tmp_path):
    python = vllm_python()
    done = subprocess.run(
        command_line("+experiment=ratio_sweep", "size=tiny", python=python, out=tmp_path),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    labels = {row["label"] for row in sweep["points"]} if "points" in sweep else set()
    assert {"colocated", "chunked", "1P1D"} <= labels or "1P1D" in done.stdout
    assert "verdict" in done.stdout.lower() or "winner" in done.stdout.lower()
    assert not processes_of(os.getpid())
