"""ruff's lint and format checks pass on the tree, as configured in pyproject.toml ([tool.ruff])."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import ROOT


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes():
    out = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    out = ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
