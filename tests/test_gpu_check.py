"""scripts/gpu_check --smoke on CPU: every step runs, the summary reads each step's real output
files (a renamed field would otherwise surface only on the GPU, in its scarce device time), and the
exit status follows the steps."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["gpu_tests", "engine", "parity", "disagg_ipc", "kv_ipc"]


def gpu_check(out: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": python}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True)


def test_smoke_runs_every_step_and_summarises_them(tmp_path):
    done = gpu_check(tmp_path, "--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == STEPS and all(r[1] == "0" for r in rows), rows
    summary = done.stdout.split("== gpu_check summary", 1)[1]
    for expected in ["of ideal", "attention vs SDPA", "torch/16/decode", "4 of 4 requests ok",
                     "KV blocks leaked 0, staging buffers leaked 0", "ipc vs memcpy"]:
        assert expected in summary, f"{expected!r} missing from the summary:\n{summary}"
    for name in ["engine.json", "parity.json", "kv_ipc.json", "disagg_ipc/summary.json", "device.txt"]:
        assert (tmp_path / name).exists(), name


def test_a_failed_step_makes_the_exit_status_non_zero(tmp_path):
    # a python that cannot run the steps: every step fails, the table still prints
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    done = gpu_check(tmp_path / "out", "--smoke", python=str(fake))
    assert done.returncode != 0
    rows = (tmp_path / "out" / "steps.tsv").read_text().splitlines()
    assert [r.split("\t")[1] for r in rows] == ["3"] * len(rows) and len(rows) >= len(STEPS)


@pytest.mark.parametrize("args", [["--fast"], ["--smoke", "--fast"]])
def test_an_unknown_argument_is_refused_in_one_line(tmp_path, args):
    done = gpu_check(tmp_path, *args)
    assert done.returncode == 2
    assert done.stderr.strip() == f"gpu_check: unknown arguments '{' '.join(args)}' (allowed: none, or --smoke)"
