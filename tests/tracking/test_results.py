"""Results directory: round trip, atomic writes, JSON with NaN as null, unwritable directory."""

import json
import math
import os
from types import SimpleNamespace

import pandas as pd
import pytest

from testbed.metrics import Event, RequestLog, SLOConfig, request_table, summarize
from testbed.metrics.events import STEP_COLUMNS, TRANSFER_COLUMNS
from testbed.metrics.results_dir import ResultsError, read_results, write_results
from testbed.tracking import collect_meta


def small_table():
    log = RequestLog(10.0)
    log.register(
        SimpleNamespace(request_id=0, arrival_s=0.0, input_len=3, output_len=2, session_id=4, turn=1, tenant="chat")
    )
    log.event(0, Event.PREFILL_START, 10.1, worker=0)
    log.tokens(0, [5, 6], [10.2, 10.2], 10.25)
    log.finish(0, 10.25)
    log.register(SimpleNamespace(request_id=1, arrival_s=0.5, input_len=3, output_len=2))
    log.fail(1, 11.0, "boom")
    return log.table()


def test_round_trip(tmp_path):
    requests = small_table()
    summary = summarize(requests, slo=SLOConfig())
    steps = pd.DataFrame({"worker": [0], "role": ["mixed"], "start_s": [0.1], "end_s": [0.2]})
    telemetry = pd.DataFrame({"gpu": [0], "t_s": [0.0], "util": [55.0]})
    out = write_results(
        tmp_path / "run",
        requests=requests,
        steps=steps,
        transfers=None,
        telemetry=telemetry,
        config={"workload": {"rate": 4.0, "name": "poisson"}, "seed": 1},
        meta={"seed": 1, "nan": float("nan")},
        summary=summary,
    )
    back = read_results(out)
    assert back["config"] == {"workload": {"rate": 4.0, "name": "poisson"}, "seed": 1}
    assert back["meta"] == {"seed": 1, "nan": None}
    assert back["summary"] == json.loads(json.dumps(summary))
    got = back["requests"]
    assert list(got.columns) == list(requests.columns)
    assert list(got["token_times"][0]) == pytest.approx([0.25, 0.25])
    assert list(got["output_token_ids"][0]) == [5, 6] and len(got["token_times"][1]) == 0
    assert got["session_id"][0] == 4 and pd.isna(got["session_id"][1])
    assert got["ttft"][0] == pytest.approx(0.25) and math.isnan(got["ttft"][1])
    assert list(got["status"]) == ["ok", "failed"]
    assert back["steps"]["role"].tolist() == ["mixed"]
    assert list(back["kv_transfers"].columns) == TRANSFER_COLUMNS and len(back["kv_transfers"]) == 0
    assert back["telemetry"]["util"].tolist() == [55.0]
    # Summaries recomputed from the parquet file agree with the ones from the live table.
    assert summarize(got, slo=SLOConfig()) == summary


def test_no_temp_files_left_and_empty_tables_have_columns(tmp_path):
    out = write_results(
        tmp_path,
        requests=request_table([]),
        steps=None,
        transfers=None,
        telemetry=None,
        config={},
        meta={},
        summary=summarize(request_table([]), slo=SLOConfig()),
    )
    names = sorted(os.listdir(out))
    assert names == [
        "config.yaml",
        "kv_transfers.parquet",
        "meta.json",
        "requests.parquet",
        "steps.parquet",
        "summary.json",
    ]
    back = read_results(out)
    assert len(back["requests"]) == 0 and "token_times" in back["requests"].columns
    assert list(back["steps"].columns) == STEP_COLUMNS and back["telemetry"] is None


def test_summary_json_is_strict_json_with_null_for_nan(tmp_path):
    write_results(
        tmp_path,
        requests=small_table(),
        steps=None,
        transfers=None,
        telemetry=None,
        config={},
        meta={},
        summary={"a": float("nan"), "b": [1.0, float("inf")]},
    )
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.0, None]}


def test_rewrite_replaces_files(tmp_path):
    for rate in (1.0, 2.0):
        write_results(
            tmp_path,
            requests=small_table(),
            steps=None,
            transfers=None,
            telemetry=None,
            config={"rate": rate},
            meta={},
            summary={},
        )
    assert read_results(tmp_path)["config"] == {"rate": 2.0}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_config_yaml_is_plain_yaml_with_the_same_content(tmp_path):
    """config.yaml is written with PyYAML (no OmegaConf below the studies layer): a stored
    Config's text is what OmegaConf wrote before, a tuple reads back as a list, strings that look
    like numbers or booleans stay strings."""
    from omegaconf import OmegaConf

    from testbed.config import Config
    from testbed.metrics.results_dir import config_yaml, stored_config

    stored = stored_config(Config())
    assert config_yaml(stored) == OmegaConf.to_yaml(OmegaConf.create(stored))
    odd = {"a": (1, 2.5), "b": "1.5", "c": "true", "d": None, "e": "${x}", "f": [{"g": float("inf")}]}
    write_results(tmp_path, requests=small_table(), config=odd, meta={}, summary={})
    assert read_results(tmp_path)["config"] == {**odd, "a": [1, 2.5]}
    assert read_results(tmp_path)["config"] == OmegaConf.to_container(OmegaConf.create(odd))


def test_unwritable_directory_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ResultsError) as info:
        write_results(
            blocker / "run",
            requests=small_table(),
            steps=None,
            transfers=None,
            telemetry=None,
            config={},
            meta={},
            summary={},
        )
    assert str(blocker / "run") in str(info.value) and "\n" not in str(info.value)


def test_collect_meta():
    meta = collect_meta(7, extra={"mode": "disagg"})
    json.dumps(meta, allow_nan=False)
    assert meta["seed"] == 7 and meta["mode"] == "disagg"
    for key in (
        "python",
        "numpy",
        "pandas",
        "torch",
        "hostname",
        "cpu_count",
        "cuda_devices",
        "git_commit",
        "time_utc",
    ):
        assert key in meta
