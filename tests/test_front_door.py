"""What a newcomer meets first: an unreachable server is one line and a non-zero exit whatever
is set, a real checkpoint runs from the command line with default options."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def refusing_url():
    """A port bound but never listening (connections are refused), held while the test runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def testbed(*args, tmp_path, module="testbed", timeout=300):
    return subprocess.run([sys.executable, "-m", module, f"hydra.run.dir={tmp_path}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("study", [[], ["+experiment=rate_sweep", "experiment.rates=[1,2]"]],
                         ids=["serve", "rate_sweep"])
def test_a_missing_server_is_one_line_and_a_non_zero_exit_even_with_http_model_set(tmp_path, study):
    sock, url = refusing_url()
    with sock:
        done = testbed(*study, "executor=http", f"http.url={url}", "http.model=m", "workload.num_requests=4",
                       tmp_path=tmp_path)
    # a study's progress bar aside (it redraws one terminal line), the error is the one line printed
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip() and "point/s" not in line]
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: http.url={url}: no server answers: GET /v1/models failed (")
    assert lines[0].endswith("and so did GET /health; start the server or fix http.url")
    assert "ClientConnectorError" in lines[0]
    assert not (tmp_path / "requests.parquet").exists()  # nothing was sent
