"""A sweep whose every point failed (workers that never started, a device gone) still ends with its
table, its summary and its printout: each study's aggregate takes an empty cell table."""

from __future__ import annotations

import json

import pytest

import testbed.studies.runner as runner
from testbed.studies import catalog
from tests.study_runs import STUDIES, run_study

SWEEPS = [name for name in STUDIES if catalog.BY_NAME[name].sweeps]


@pytest.mark.parametrize("name", SWEEPS)
def test_a_sweep_of_failed_points_ends_with_its_summary(name, tmp_path, monkeypatch):
    def fails(cfg, out_dir, session=None):
        raise RuntimeError("workers failed to start: ['testbed-worker0']")

    monkeypatch.setattr(runner, "run_point", fails)
    run_study(name, tmp_path)  # with its figures: drawn from no finished point
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["points"] and {p["status"] for p in sweep["points"]} == {"failed"}
    assert isinstance(sweep["aggregate"], dict)  # the study's summary, written
