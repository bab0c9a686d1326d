"""The README's result is one run's (scripts/front_page.py): its figures, its time and the printed
summary on the main job's page are what the script writes from the record of the run whose picture
is committed, and the script refuses what it cannot rewrite in one line."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from tests.paths import ROOT

_spec = importlib.util.spec_from_file_location("front_page", ROOT / "scripts/front_page.py")
front_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(front_page)


def test_the_readme_and_the_main_job_page_are_the_committed_runs(tmp_path):
    record = json.loads(front_page.RECORD.read_text())
    for page in ("README.md", "docs/main-job.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / page, tmp_path / page)
    front_page.rewrite(record, tmp_path)
    for page in ("README.md", "docs/main-job.md"):
        assert (tmp_path / page).read_text() == (ROOT / page).read_text(), f"{page}: run scripts/front_page.py"
    readme = (ROOT / "README.md").read_text()
    assert record["verdict"] in readme and front_page.time_row(record) in readme
    assert all(label in readme for label in record["configurations"])


def test_a_bound_is_said_as_a_bound_and_an_interval_as_one():
    censored = {"goodput_per_gpu": 266.7, "goodput_per_gpu_low": None, "goodput_per_gpu_high": None}
    assert front_page.goodput_text(censored | {"censored": "above"}) == ">= 267 (a bound)"
    bracketed = {"goodput_per_gpu": 160.1, "goodput_per_gpu_low": 74.0, "goodput_per_gpu_high": 246.2}
    assert front_page.goodput_text(bracketed | {"censored": ""}) == "160 [74, 246]"
    g = {
        "error_per_repeat": [7.0, 14.0, 1.0],
        "goodput_per_repeat": [100, 200, 0],
        "censoring_per_repeat": ["", "", ""],
    }
    assert front_page.search_error(g) == "7.0%"


def test_what_it_cannot_rewrite_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no <!-- front-page:start -->"):
        front_page.replace_between("no markers here", "front-page", "x")
    with pytest.raises(SystemExit, match="no sweep.json"):
        front_page.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="usage"):
        front_page.main(["a", "b"])
