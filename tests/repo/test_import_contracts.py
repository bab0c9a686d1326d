"""The layer order, written once as import-linter contracts in pyproject.toml ([tool.importlinter]),
holds: `lint-imports` passes on the tree, and fails when a module imports up the layers, even
from inside a function."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import tomllib

from tests.paths import ROOT

LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
    "--no-cache",
]


def lint(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the tree at cwd, not the installed one
    return subprocess.run([*LINT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_import_contract():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_layers_contract_names_every_package_of_testbed():
    """`exhaustive`: a new package (or top-level module) of testbed must be given its layer."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "layers")
    assert layers["exhaustive"] is True and layers["containers"] == ["testbed"]


def test_a_lazy_import_up_the_layers_breaks_the_contract(tmp_path):
    """A copy of the tree whose engine imports the studies layer inside a function: lint-imports
    fails and names the arrow."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.json", "*.csv", "*.jsonl", "*.c", "notebooks")
    for name in ("testbed", "analysis"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    sequence = tmp_path / "testbed" / "engine" / "sequence.py"
    sequence.write_text(sequence.read_text() + "\n\ndef _up():\n    from testbed.studies import runner  # noqa\n")
    out = lint(tmp_path, "--contract", "layers")
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    assert "testbed.engine is not allowed to import testbed.studies" in out.stdout, out.stdout[-4000:]
    assert "testbed.engine.sequence -> testbed.studies.runner" in out.stdout, out.stdout[-4000:]
