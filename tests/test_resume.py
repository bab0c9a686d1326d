"""Resuming a sweep keeps a finished point only when it ran the configuration asked for now; the
CPU sizing a study applied is said and stored."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from testbed.errors import ConfigError
from testbed.studies.resume import changes
from testbed.tracking.results import stored_config
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
    config = yaml.safe_load((tmp_path / "points" / rerun.point.iloc[0] / "config.yaml").read_text())
    assert config["slo"]["ttft_s"] == 0.25


def test_the_cpu_sizing_applied_is_stored_with_the_sweep(tmp_path):
    from testbed.studies.runner import run

    cfg = make_config("+experiment=mode_compare", *SIM, "experiment.repeats=1", "experiment.figures=false")
    run(cfg, tmp_path, explicit={"experiment", "executor", "workload.num_requests"})
    sizing = json.loads((tmp_path / "sweep.json").read_text())["sizing"]
    assert sizing["model.name"] == "tiny"  # the study's CPU sizing applied...
    assert "workload.num_requests" not in sizing  # ...but the command line's num_requests wins over it
    assert yaml.safe_load((tmp_path / ".hydra" / "sizing.yaml").read_text()) == sizing
