"""A study's points as separate jobs (testbed/studies/shards.py): the blocks cover the grid once,
in order; the shards' points merged give the one-process run's sweep.json, intervals and verdict;
and under Hydra's joblib launcher (a real launcher plugin) the shards run as jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from testbed.errors import ConfigError
from testbed.experiment import ExperimentConfig
from testbed.studies import shards
from testbed.studies.sweep import Point
from tests.paths import ROOT
from tests.study_runs import run_study

# what the simulator measures of its own host: wall-clock, and the host's load while a point ran
TIMINGS = ("sim_loop_s", "sim_events_per_s", "host_load_1m", "host_load_1m_end")
TESTBED = (sys.executable, "-m", "testbed")
TINY = ("executor=sim", "experiment.repeats=2", "experiment.search_points=2")


def points(n: int) -> list[Point]:
    return [Point(f"p{i}", {}, {"cell": f"c{i % 3}"}) for i in range(n)]


@pytest.mark.parametrize("n, k", [(12, 3), (13, 4), (2, 5), (7, 1), (0, 2)])
def test_blocks_cover_the_grid_once_in_order(n, k):
    grid = points(n)
    blocks = [shards.block(grid, i, k) for i in range(k)]
    assert [p for b in blocks for p in b] == grid
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_named_points_and_cells_are_chosen_in_grid_order():
    e = ExperimentConfig(points=["p4", "c0"])
    assert [p.name for p in shards.chosen(points(6), e)] == ["p0", "p3", "p4"]
    with pytest.raises(ConfigError, match=r"experiment.points has \['nope'\]"):
        shards.chosen(points(6), ExperimentConfig(points=["nope"]))


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"shard": 4, "shards": 4}, "experiment.shard must be in"),
        ({"shards": 0}, "experiment.shard must be in"),
        ({"shard": 0, "shards": 2, "points": ["a"]}, "set one"),
        ({"merge": True, "shard": 0, "shards": 2}, "leave experiment.shard"),
    ],
)
def test_bad_shard_settings_are_one_line(bad, said):
    with pytest.raises(ConfigError, match=said):
        replace(ExperimentConfig(name="ratio_sweep"), **bad).validate(["ratio_sweep"])


def test_points_that_read_other_points_are_not_sharded():
    reading = [Point("sim", {"sim.profile": "run:{points}/real"}, {})]
    with pytest.raises(ConfigError, match="read other points' results"):
        shards.check_study("sim_validate", True, reading)
    with pytest.raises(ConfigError, match="not a sweep"):
        shards.check_study("profile", False, None)


def test_merge_names_the_missing_points_and_their_shard(tmp_path):
    grid = points(4)
    with pytest.raises(ConfigError, match=r"4 of 4 grid points .* p0 \(shard 0 of 2\), p1 \(shard 0 of 2\)"):
        shards.check_merge(grid, tmp_path, 2)


def sweep(directory: Path) -> dict:
    return json.loads((directory / "sweep.json").read_text())


def assert_same_sweep(one: Path, merged: Path) -> None:
    """Every point's row and the aggregate equal, but for what the host's clock and load measure."""
    a, b = sweep(one), sweep(merged)
    drop = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    assert drop(a["points"]) == drop(b["points"])
    assert a["aggregate"] == b["aggregate"]
    cells = [
        pd.read_parquet(d / "intervals.parquet").drop(columns=list(TIMINGS), errors="ignore") for d in (one, merged)
    ]
    pd.testing.assert_frame_equal(*cells)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    run_study("ratio_sweep", out, *TINY)
    return out


def test_shards_merged_equal_the_one_process_run(one_process, tmp_path):
    for i in range(3):
        result = run_study("ratio_sweep", tmp_path, *TINY, f"experiment.shard={i}", "experiment.shards=3")
        assert len(result["points"]) == 4 and not (tmp_path / "sweep.json").exists()
    with pytest.raises(ConfigError, match="not finished"):  # a merge before the last shard runs nothing
        run_study("ratio_sweep", tmp_path / "early", *TINY, "experiment.merge=true")
    merged = run_study("ratio_sweep", tmp_path, *TINY, "experiment.merge=true")
    assert set(merged["table"]["status"]) == {"ok"}  # the grid's rows as their shards ran them
    assert_same_sweep(one_process, tmp_path)


def test_joblib_launcher_runs_the_shards_as_jobs(one_process, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    out = tmp_path / "shared"
    study = ["+experiment=ratio_sweep", "size=tiny", *TINY, f"output_dir={out}"]
    launched = [
        *TESTBED,
        "-m",  # Hydra's flag before the overrides: argparse takes one run of them
        *study,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "experiment.shard=range(0,2)",
        "experiment.shards=2",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
    ]
    jobs = subprocess.run(launched, cwd=ROOT, capture_output=True, text=True)
    assert jobs.returncode == 0, jobs.stderr[-2000:]
    assert sorted(p.name for p in (out / shards.SHARDS).glob("*.parquet")) == [
        "shard-0-of-2.parquet",
        "shard-1-of-2.parquet",
    ]
    merge = [*TESTBED, *study, "experiment.merge=true", f"hydra.run.dir={tmp_path / 'merge'}"]
    merged = subprocess.run(merge, cwd=ROOT, capture_output=True, text=True)
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert_same_sweep(one_process, out)
