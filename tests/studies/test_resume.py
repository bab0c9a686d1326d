"""Resuming a sweep keeps a finished point only when it ran the configuration asked for now; the
CPU size a study ran at is stored."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from testbed.errors import ConfigError
from testbed.metrics.results_dir import stored_config
from testbed.studies.resume import changes
from tests.cluster_helpers import make_config
from tests.study_runs import run_study

SIM = ["executor=sim", "workload.num_requests=12"]


def test_changes_name_what_differs_and_leave_the_study_axes_out():
    a = stored_config(make_config("workload.rate=4"))
    assert changes(a, a) == []
    assert changes(a, stored_config(make_config("workload.rate=8"))) == ["workload.rate: 4.0 -> 8.0"]
    sweep = stored_config(make_config("+experiment=rate_sweep", "experiment.rates=[4]", "tracker=wandb"))
    more_rates = stored_config(make_config("+experiment=rate_sweep", "experiment.rates=[4,8]"))
    assert changes(sweep, more_rates) == []  # a resumed sweep may add points; tracker and output stay out too


def test_a_resumed_sweep_skips_same_points_and_refuses_changed_ones(tmp_path):
    run_study("mode_compare", tmp_path, *SIM)
    again = run_study("mode_compare", tmp_path, *SIM)["table"]
    assert set(again.status) == {"skipped"}
    with pytest.raises(ConfigError, match=r"ran with a different configuration \(slo.ttft_s: 0.5 -> 0.25\)"):
        run_study("mode_compare", tmp_path, *SIM, "slo.ttft_s=0.25")
    assert set(pd.read_parquet(tmp_path / "sweep.parquet").status) == {"skipped"}  # nothing was run or lost
    rerun = run_study("mode_compare", tmp_path, *SIM, "slo.ttft_s=0.25", "experiment.on_changed=rerun")["table"]
    assert set(rerun.status) == {"ok"}
    assert rerun["host_load_1m"].notna().all() and rerun["host_load_1m_end"].notna().all()  # the host's drift, kept
    config = yaml.safe_load((tmp_path / "points" / rerun.point.iloc[0] / "config.yaml").read_text())
    assert config["slo"]["ttft_s"] == 0.25


def test_the_cpu_size_is_composed_and_stored_with_the_sweep(tmp_path):
    from testbed.studies.runner import run

    cfg = make_config("+experiment=mode_compare", *SIM, "experiment.repeats=1", "experiment.figures=false")
    assert cfg.size == "cpu" and cfg.model.name == "tiny"  # the study's CPU size, chosen here (no GPU)...
    assert cfg.workload.num_requests == 12  # ...but the command line's num_requests wins over it
    run(cfg, tmp_path)
    assert json.loads((tmp_path / "sweep.json").read_text())["size"] == "cpu"


# -- damaged points: checked, cleared and run again, each said with its reason ------------------------
def damage_points(points) -> dict[str, str]:
    """One kind of damage per point: {point: what the resume must say}."""
    names = sorted(p.name for p in points.iterdir())
    requests = points / names[0] / "requests.parquet"
    requests.write_bytes(requests.read_bytes()[: requests.stat().st_size // 2])  # cut short
    (points / names[1] / "summary.json").write_text("{garbage")
    (points / names[2] / "config.yaml").unlink()
    return {
        names[0]: "requests.parquet unreadable",
        names[1]: "summary.json does not parse",
        names[2]: "config.yaml unreadable",
    }


def test_a_resumed_sweep_reruns_each_damaged_point_and_says_why(tmp_path, caplog):
    run_study("mode_compare", tmp_path, *SIM)
    said = damage_points(tmp_path / "points")
    with caplog.at_level("WARNING", logger="testbed"):
        again = run_study("mode_compare", tmp_path, *SIM)["table"].set_index("point")
    for name, why in said.items():
        assert again.loc[name, "status"] == "ok", again.status  # run again, not skipped nor failed
        assert f"resume: point {name} is not finished ({why}" in caplog.text
    assert set(again.drop(index=list(said)).status) <= {"skipped"}
    assert set(run_study("mode_compare", tmp_path, *SIM)["table"].status) == {"skipped"}  # repaired


def test_a_partial_or_miscounted_point_is_not_finished(tmp_path):
    from testbed.studies.resume import damage

    run_study("mode_compare", tmp_path, *SIM)
    point = next((tmp_path / "points").iterdir())
    assert damage(point) is None
    summary = json.loads((point / "summary.json").read_text())
    (point / "summary.json").write_text(json.dumps({**summary, "partial": True}))
    assert "interrupted" in damage(point)
    summary["num_requests"]["total"] += 1
    (point / "summary.json").write_text(json.dumps(summary))
    assert "requests.parquet has" in damage(point)
    summary["num_requests"]["total"] -= 1
    (point / "summary.json").write_text(json.dumps(summary))
    (point / "exports" / "vllm_result.json").unlink()
    assert damage(point) == "exports/vllm_result.json missing"
