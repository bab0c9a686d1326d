"""A study notebook's default results: TESTBED_RESULTS_DIR when set, else the study's newest run
where the command writes it (outputs/<study>/<date>/<time>/, or experiments/<study>/results/),
found from the notebook's folder up; none: one line naming the command and the variable."""

from __future__ import annotations

import os

import pytest

from analysis.load import RESULTS_ENV, latest_results


def run_dir(root, *parts, mtime):
    directory = root.joinpath(*parts)
    directory.mkdir(parents=True)
    (directory / "sweep.json").write_text("{}")
    os.utime(directory / "sweep.json", (mtime, mtime))
    return directory


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(RESULTS_ENV, raising=False)


def test_the_newest_run_of_the_study_is_found_from_the_notebooks_folder(tmp_path):
    notebooks = tmp_path / "analysis" / "notebooks"
    notebooks.mkdir(parents=True)
    run_dir(tmp_path, "outputs", "ratio_sweep", "2026-01-02", "09-00-00", mtime=1_000)
    newest = run_dir(tmp_path, "outputs", "ratio_sweep", "2026-01-01", "23-00-00", mtime=3_000)  # resumed later
    run_dir(tmp_path, "experiments", "ratio_sweep", "results", mtime=2_000)
    run_dir(tmp_path, "outputs", "rate_sweep", "2026-01-03", "00-00-00", mtime=9_000)  # another study
    (tmp_path / "outputs" / "ratio_sweep" / "2026-01-04" / "00-00-00").mkdir(parents=True)  # a run with no sweep yet
    assert latest_results("ratio_sweep", notebooks) == newest
    readme = run_dir(tmp_path, "experiments", "chunk_sweep", "results", mtime=1_000)
    assert latest_results("chunk_sweep", notebooks) == readme  # where the study's README writes it


def test_the_variable_wins_and_none_found_says_what_to_run(tmp_path, monkeypatch):
    run_dir(tmp_path, "outputs", "ratio_sweep", "2026-01-01", "00-00-00", mtime=1_000)
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert latest_results("ratio_sweep", tmp_path) == tmp_path / "elsewhere"
    monkeypatch.delenv(RESULTS_ENV)
    with pytest.raises(FileNotFoundError) as error:
        latest_results("slo_scale", tmp_path)
    said = str(error.value)
    assert "python -m testbed +experiment=slo_scale" in said and RESULTS_ENV in said and "\n" not in said
