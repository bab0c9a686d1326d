"""scripts/loaded_suite, the suite beside two busy processes (the README's Times row): each run's
line in the summary, a stop at the first failing run, the busy processes ended on the way out, and
a bad argument refused in one line. TESTBED_SUITE_CMD stands in for the suite."""

from __future__ import annotations

import os
import subprocess

from tests.paths import ROOT

SCRIPT = ROOT / "scripts" / "loaded_suite"


def loaded(tmp_path, command: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TESTBED_SUITE_CMD": command}
    return subprocess.run(
        ["bash", str(SCRIPT), *args, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"  # a zombie has ended


def test_every_run_says_its_line_and_the_busy_processes_end(tmp_path):
    done = loaded(tmp_path, "test -f README.md", "--runs", "3")
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0].rsplit(" on ", 1)[0] for line in lines] == ["run 1 of 3", "run 2 of 3", "run 3 of 3"]
    assert all("exit 0" in line and "load " in line for line in lines)
    assert not any(alive(int(pid)) for pid in (tmp_path / "busy.pids").read_text().split())


def test_it_stops_at_the_first_failing_run_with_its_exit_code(tmp_path):
    done = loaded(tmp_path, "test ! -e ../second || exit 3; touch ../second", "--runs", "3")
    assert done.returncode == 3
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert len(lines) == 2 and "exit 0" in lines[0] and "exit 3" in lines[1]
    assert not any(alive(int(pid)) for pid in (tmp_path / "busy.pids").read_text().split())


def test_a_bad_argument_is_one_line(tmp_path):
    for args, words in ((["--runs", "0"], "--runs must be an integer >= 1"), (["--fast"], "unknown argument --fast")):
        done = loaded(tmp_path, "true", *args)
        assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1
