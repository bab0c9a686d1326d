"""Every experiment config composes and runs end to end at tiny size; sweeps resume."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from tests.paths import CONF, ROOT
from tests.study_runs import STUDIES, compose_study, run_study

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_every_experiment_has_a_tiny_run():
    assert set(EXPERIMENTS) == set(STUDIES)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes(name):
    cfg, _ = compose_study(name)
    assert cfg.experiment.name == name


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_end_to_end(name, study_results):
    if name == "profile":
        profile = json.loads((study_results[name] / "profile.json").read_text())
        assert profile["samples"]["step"] and profile["cost_model"]["per_prefill_token_s"] >= 0
        return
    sweep = json.loads((study_results[name] / "sweep.json").read_text())
    table = pd.read_parquet(study_results[name] / "sweep.parquet")
    assert sweep["experiment"] == name and len(table) > 0
    if name != "kv_bandwidth":
        assert (table["status"] == "ok").all(), table[["point", "status", "error"]]
        for point in table["point"]:
            summary = json.loads((study_results[name] / "points" / point / "summary.json").read_text())
            assert all(v == 0 for v in summary["kv_blocks_leaked"].values())


@pytest.mark.slow
def test_ratio_sweep_aggregates_goodput_per_split(study_results):
    sweep = json.loads((study_results["ratio_sweep"] / "sweep.json").read_text())
    assert set(sweep["aggregate"]["goodput"]) == {"colocated", "chunked", "1P1D"}
    assert sweep["aggregate"]["best"]["label"] in sweep["aggregate"]["goodput"]


@pytest.mark.slow
def test_interference_reports_inflation_against_its_baseline(study_results):
    aggregate = json.loads((study_results["interference"] / "sweep.json").read_text())["aggregate"]
    for label in ("colocated", "1P1D"):
        assert aggregate["interference"][label]["0"]["inflation"] == pytest.approx(1.0)
        assert aggregate["interference"][label]["256"]["itl_p99"] > 0


@pytest.mark.slow
def test_resume_runs_only_the_missing_points(tmp_path):
    out = tmp_path / "sweep"
    first = run_study("burstiness", out)["table"]
    assert list(first["status"]) == ["ok", "ok"]
    # as if the sweep had stopped after its first point
    (out / "points" / "chunked_burstiness2" / "summary.json").unlink()
    second = run_study("burstiness", out)["table"]
    assert list(second["status"]) == ["skipped", "ok"]


@pytest.mark.slow
def test_ratio_sweep_command_line_writes_every_split(tmp_path):
    """The main job as a user types it (CPU defaults of the study), shortened to one rate."""
    out = subprocess.run([sys.executable, "-m", "testbed", "+experiment=ratio_sweep", f"hydra.run.dir={tmp_path}",
                          "experiment.rates=[20]", "workload.num_requests=8", "experiment.figures=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert set(table["label"]) == {"colocated", "chunked", "1P3D", "2P2D", "3P1D"}  # 4 CPU workers
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert set(sweep["aggregate"]["goodput"]) == set(table["label"])
    assert "best configuration" in out.stdout


@pytest.mark.slow
def test_plan_puts_analytical_simulated_side_by_side(study_results):
    aggregate = json.loads((study_results["plan"] / "sweep.json").read_text())["aggregate"]
    assert aggregate["analytical"]["split"] in {"1P2D", "2P1D"}
    assert set(aggregate["simulated"]["goodput"]) == {"colocated", "1P2D", "2P1D", "chunked64"}
    assert aggregate["simulated"]["best"]["label"] in aggregate["simulated"]["goodput"]


@pytest.mark.slow
def test_sim_validate_reports_relative_errors(study_results):
    aggregate = json.loads((study_results["sim_validate"] / "sweep.json").read_text())["aggregate"]
    (row,) = aggregate["errors"]
    assert row["label"] == "chunked" and all(k in row for k in ("ttft_p50_error", "tpot_p99_error"))
    assert (study_results["sim_validate"] / "validation.parquet").is_file()


@pytest.mark.slow
def test_wandb_offline_run_per_point_and_figures(tmp_path):
    """tracker=wandb: one offline run per point under its results directory, and one with the figures."""
    out = tmp_path / "sweep"
    result = run_study("burstiness", out, "experiment.burstiness=[1.0]", "tracker=wandb", "tracker.mode=offline",
                       "experiment.figures=true")
    assert result["figures"] and all(p.is_file() for p in result["figures"])
    assert list((out / "points" / "chunked_burstiness1" / "wandb").glob("offline-run-*"))
    assert list((out / "wandb").glob("offline-run-*"))
