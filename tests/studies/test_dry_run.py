"""experiment.dry_run=true (testbed/studies/dry_run.py): the model, the sizing and the grid of
points with a time estimate, nothing run; the points listed are the ones the run then runs."""

from __future__ import annotations

import subprocess
import sys

from testbed.studies import catalog
from testbed.studies.dry_run import show
from tests.paths import ROOT
from tests.study_runs import compose_study, run_study

TINY = ("executor=sim", "experiment.repeats=2", "experiment.search_points=2")


def test_ratio_sweep_lists_exactly_the_points_its_run_runs(tmp_path, capsys):
    shown = run_study("ratio_sweep", tmp_path / "dry", *TINY, "experiment.dry_run=true")
    assert not (tmp_path / "dry").exists()  # nothing ran, nothing was written
    printed = capsys.readouterr().out
    assert f"points: {len(shown['points'])}" in printed and all(p in printed for p in shown["points"])
    ran = run_study("ratio_sweep", tmp_path / "run", *TINY)["table"]
    grid = ran[ran["stage"].fillna("grid") != "search"] if "stage" in ran.columns else ran
    assert shown["points"] == list(grid["point"])  # the same points, in the order they ran
    assert len(ran) - len(grid) <= shown["estimate"].search_points  # the search stays within what was said


def test_the_model_is_resolved_to_its_dimensions():
    """Llama-3-8B's published shape: 32 layers of 4096, 32 heads (8 KV), 14336 MLP, 8.03B parameters."""
    cfg = compose_study("ratio_sweep", "executor=sim", "model=llama3_8b", "model.max_model_len=8192")
    line = show(catalog.study("ratio_sweep"), cfg)["lines"][0]
    assert "32 layers, hidden 4096, 32 heads (8 KV) of 128, MLP 14336, vocab 128256, context 8192" in line
    assert "8.03B parameters" in line and "None" not in line


def test_a_study_without_a_grid_says_so():
    cfg = compose_study("profile")
    lines = show(catalog.study("profile"), cfg)["lines"]
    assert any("none listed" in line for line in lines)


def test_the_command_line_prints_the_grid_and_the_estimate(tmp_path):
    command = [sys.executable, "-m", "testbed", "+experiment=ratio_sweep", "size=tiny", *TINY]
    done = subprocess.run(
        [*command, "experiment.dry_run=true", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "points: 12" in done.stdout and "estimate: about" in done.stdout
    assert not (tmp_path / "points").exists()
