"""Interop with vLLM's and SGLang's benchmarks: export (Mooncake trace, vLLM custom dataset, vLLM
result keys), import (their result files as results directories) and drawing an imported run
beside a study's own configurations. Fixtures under tests/data/interop/ carry the real key names
of `vllm bench serve --save-result --save-detailed` (current and pre-0.10) and of SGLang's
`bench_serving --output-file --output-details`."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.config import Config, with_overrides
from testbed.interop import (
    InteropError,
    bench_result,
    block_hash_ids,
    export_point,
    export_run,
    import_run,
    read_sglang_result,
    read_vllm_result,
    write_mooncake_jsonl,
    write_vllm_custom_jsonl,
)
from testbed.interop.__main__ import main
from testbed.interop.exchange import offered_rows
from testbed.metrics.config import SLOConfig
from testbed.metrics.events import request_table
from testbed.metrics.latency import pooled_itl
from testbed.metrics.results_dir import write_json, write_results
from testbed.metrics.slo import meets_slo
from testbed.metrics.summary import summarize
from testbed.studies.merge import MERGEABLE, add_point, rewrite
from testbed.studies.sweep import flatten
from testbed.workload.traces import read_mooncake_jsonl
from tests.paths import ROOT, TEST_DATA

DATA = TEST_DATA / "interop"
VLLM, VLLM_OLD, SGLANG = (
    DATA / "vllm_bench_serve.json",
    DATA / "vllm_benchmark_serving_old.json",
    DATA / "sglang_bench_serving.jsonl",
)
SLO = SLOConfig(ttft_s=0.1, tpot_s=0.03)
# what `vllm bench serve --save-result --save-detailed` writes (vllm/benchmarks/serve.py)
VLLM_KEYS = [
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
]


def tokens(first: float, gaps: list[float]) -> list[float]:
    return list(first + np.concatenate([[0.0], np.cumsum(gaps)]))


def hand_made() -> pd.DataFrame:
    """Served requests (one with two tokens in one message), a failure after one token, a
    refusal by admission control and one the workload's overlength filter dropped."""
    served = [
        (0, 0.10, 700, tokens(0.15, [0.02, 0.0, 0.03])),
        (1, 0.30, 90, tokens(0.50, [0.05, 0.01])),
        (2, 0.35, 2000, [0.41]),
        (6, 0.60, 300, tokens(0.64, [0.02, 0.02])),
    ]
    rows = [
        {"request_id": i, "arrival_s": a, "input_len": n, "output_len": len(t), "token_times": t}
        for i, a, n, t in served
    ]
    rows += [
        {
            "request_id": 3,
            "arrival_s": 0.40,
            "input_len": 50,
            "output_len": 5,
            "status": "failed",
            "reason": "worker died",
            "token_times": [0.47],
        },
        {
            "request_id": 4,
            "arrival_s": 0.45,
            "input_len": 60,
            "output_len": 5,
            "status": "rejected",
            "reason": "queue full",
            "refused_by": "admission",
        },
        {
            "request_id": 5,
            "arrival_s": 0.50,
            "input_len": 99999,
            "output_len": 5,
            "status": "rejected",
            "reason": "too long",
            "refused_by": "workload",
        },
    ]
    return request_table(sorted(rows, key=lambda r: r["request_id"]))


def test_bench_result_round_trips_through_vllms_file(tmp_path):
    requests = hand_made()
    result = bench_result(requests, slo_ttft_s=SLO.ttft_s, slo_tpot_s=SLO.tpot_s, model_id="tiny", request_rate=4.0)
    assert [k for k in VLLM_KEYS if k not in result] == []
    assert {
        f"{s}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")
    } <= set(result)
    write_json(tmp_path / "r.json", result)
    back = read_vllm_result(tmp_path / "r.json")
    offered = requests[requests["refused_by"] != "workload"].reset_index(drop=True)
    assert len(back) == len(offered) == result["num_prompts"]
    assert back["input_len"].tolist() == offered["input_len"].tolist()
    assert back["status"].tolist() == offered["status"].tolist()
    assert back.loc[back["status"] == "rejected", "refused_by"].tolist() == ["admission"]
    np.testing.assert_allclose(np.diff(back["arrival_s"]), np.diff(offered["arrival_s"]))
    ok, ok_back = offered[offered["status"] == "ok"], back[back["status"] == "ok"]
    assert ok_back["num_tokens"].tolist() == ok["num_tokens"].tolist()
    for column in ("ttft", "tpot", "e2e"):
        np.testing.assert_allclose(ok_back[column], ok[column], equal_nan=True)
    np.testing.assert_allclose(pooled_itl(ok_back), pooled_itl(ok))
    summary = summarize(requests, slo=SLO)
    assert result["completed"] == summary["num_requests"]["ok"] == 4
    assert result["failed"] == 2  # the failure and the admission refusal; the filtered request was never offered
    assert result["request_throughput"] == pytest.approx(summary["throughput"]["requests_per_s"])
    assert result["p99_ttft_ms"] == pytest.approx(summary["ttft"]["p99"] * 1e3)
    assert result["mean_itl_ms"] == pytest.approx(summary["itl"]["mean"] * 1e3)
    assert result["request_goodput"] * result["duration"] == pytest.approx(meets_slo(ok, SLO).sum())


def test_mooncake_export_keeps_times_lengths_and_exactly_the_shared_prefixes(tmp_path):
    rng = np.random.default_rng(0)
    system, turn0 = rng.integers(0, 1000, 600).tolist(), rng.integers(0, 1000, 1100).tolist()
    prompts = [
        turn0,
        system + rng.integers(0, 1000, 700).tolist(),
        turn0 + rng.integers(0, 1000, 600).tolist(),
        system + rng.integers(0, 1000, 100).tolist(),
        None,
        turn0[:512] + [7] * 10,
    ]
    rows = pd.DataFrame(
        {
            "request_id": range(6),
            "arrival_s": [0.5, 0.0123, 1.7, 2.25, 2.5, 3.0],
            "input_len": [len(p) if p else 900 for p in prompts],
            "output_len": [5, 6, 7, 8, 9, 10],
            "session_id": [0, 1, 0, 2, 3, 4],
            "turn": [0, 0, 1, 0, 0, 0],
            "prompt_token_ids": pd.Series(prompts, dtype=object),
        }
    )
    trace = read_mooncake_jsonl(write_mooncake_jsonl(rows, tmp_path / "t.jsonl"))
    order = rows.sort_values("arrival_s", kind="stable")
    np.testing.assert_allclose(trace.timestamps_s, np.round(order["arrival_s"] * 1000) / 1000)
    assert trace.input_len.tolist() == order["input_len"].tolist()
    assert trace.output_len.tolist() == order["output_len"].tolist()
    hashes, prompts = trace.hash_ids, [prompts[i] for i in order.index]
    for i, (ids, prompt, length) in enumerate(zip(hashes, prompts, trace.input_len)):
        assert len(ids) == -(-length // 512)
        for j in range(i):
            for k in range(min(len(ids), len(hashes[j]))):
                same = (
                    prompt is not None
                    and prompts[j] is not None
                    and prompt[: 512 * (k + 1)] == prompts[j][: 512 * (k + 1)]
                )
                assert (ids[k] == hashes[j][k]) == same, (i, j, k)
    assert sorted(set(sum(map(list, hashes), []))) == list(range(len(set(sum(map(list, hashes), [])))))
    assert block_hash_ids([[1, 2, 3]], [3], block_size=2) == [[0, 1]]


def test_vllm_custom_dataset_lines(tmp_path):
    rows = pd.DataFrame(
        {
            "request_id": [0, 1],
            "arrival_s": [1.0, 0.5],
            "input_len": [2, 3],
            "output_len": [7, 9],
            "session_id": [None, None],
            "turn": [0, 0],
            "prompt_token_ids": pd.Series([[1, 2], [3, 4, 5]], dtype=object),
        }
    )
    path = write_vllm_custom_jsonl(rows, tmp_path / "c.jsonl", lambda ids: " ".join(map(str, ids)))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"prompt": "3 4 5", "output_tokens": 9}, {"prompt": "1 2", "output_tokens": 7}]
    with pytest.raises(InteropError, match="prompt_token_ids"):
        write_vllm_custom_jsonl(rows.assign(prompt_token_ids=[None, [1]]), tmp_path / "d.jsonl", str)


def test_vllm_file_imports_with_its_send_times_and_figures():
    data = json.loads(VLLM.read_text())
    table = read_vllm_result(VLLM)
    ok = np.array([not e for e in data["errors"]])
    sent, queue = np.array(data["start_times"]), np.array(data["queue_times"])
    np.testing.assert_allclose(table["arrival_s"], (sent - queue) - (sent - queue).min())
    np.testing.assert_allclose(table.loc[ok, "ttft"], (np.array(data["ttfts"]) + queue)[ok])
    assert table.loc[ok, "num_tokens"].tolist() == np.array(data["output_lens"])[ok].tolist()
    assert table.loc[~ok, "reason"].tolist() == [
        "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"
    ]  # a traceback's last line
    summary = summarize(table, slo=SLO)
    assert summary["num_requests"]["ok"] == data["completed"] and summary["num_requests"]["failed"] == data["failed"]
    assert summary["tpot"]["p99"] * 1e3 == pytest.approx(data["p99_tpot_ms"])  # chunks of several tokens: vLLM's TPOT
    assert summary["e2e"]["mean"] * 1e3 == pytest.approx(data["mean_e2el_ms"] + 1e3 * queue[ok].mean())
    assert summary["ttft"]["mean"] * 1e3 == pytest.approx(data["mean_ttft_ms"] + 1e3 * queue[ok].mean())
    assert table.attrs["interop"]["arrivals"] == "start_times - queue_times"


def test_old_vllm_file_reconstructs_arrivals_from_its_rate():
    table = read_vllm_result(VLLM_OLD)
    np.testing.assert_allclose(table["arrival_s"], np.arange(len(table)) / 2.0)
    assert table.attrs["interop"]["arrivals"].startswith("reconstructed")
    data = json.loads(VLLM_OLD.read_text())
    assert summarize(table, slo=SLO)["ttft"]["p99"] * 1e3 == pytest.approx(data["p99_ttft_ms"])


def test_sglang_file_imports_the_chosen_run():
    lines = [json.loads(line) for line in SGLANG.read_text().splitlines()]
    for run in (0, -1):
        table, data = read_sglang_result(SGLANG, run=run), lines[run]
        np.testing.assert_allclose(table["arrival_s"], np.arange(len(table)) / data["request_rate"])
        summary = summarize(table, slo=SLO)
        for ours, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("e2e", "e2e_latency")):
            assert summary[ours]["mean"] * 1e3 == pytest.approx(data[f"mean_{theirs}_ms"])
            assert summary[ours]["p50"] * 1e3 == pytest.approx(data[f"median_{theirs}_ms"])
        assert summary["itl"]["p99"] * 1e3 == pytest.approx(data["p99_itl_ms"])
        assert summary["num_requests"]["ok"] == data["completed"]
    with pytest.raises(InteropError, match="run=5"):
        read_sglang_result(SGLANG, run=5)


def test_a_trace_replay_needs_the_trace_for_its_arrivals(tmp_path):
    data = json.loads(SGLANG.read_text().splitlines()[-1]) | {"dataset_name": "mooncake"}
    (tmp_path / "m.jsonl").write_text(json.dumps(data) + "\n")
    with pytest.raises(InteropError, match="--trace"):
        read_sglang_result(tmp_path / "m.jsonl")
    rows = pd.DataFrame({"arrival_s": [0.2, 0.9, 1.0, 2.4], "input_len": [10] * 4, "output_len": [4] * 4})
    write_mooncake_jsonl(rows, tmp_path / "trace.jsonl")
    done = import_run(tmp_path / "m.jsonl", tmp_path / "run", slo=SLO, trace=tmp_path / "trace.jsonl", slowdown=2.0)
    np.testing.assert_allclose(done["requests"]["arrival_s"], [0.0, 1.4, 1.6, 4.4])


def test_import_writes_a_results_directory_analysis_reads(tmp_path):
    from analysis.load import load_run

    done = import_run(VLLM, tmp_path / "vllm", slo=SLO)
    run = load_run(tmp_path / "vllm")
    assert run["label"] == "vllm" and done["rate"] == 4.0
    assert run["summary"] == json.loads(json.dumps(summarize(run["requests"], slo=SLO)))
    assert run["meta"]["original"]["model_id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert run["meta"]["arrivals"] == "start_times - queue_times"


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["import", "vllm", str(tmp_path / "missing.json"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "missing.json" in err and "\n" not in err
    (tmp_path / "no_details.json").write_text(json.dumps({"model_id": "m", "completed": 3}))
    assert main(["import", "vllm", str(tmp_path / "no_details.json"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no_details.json: no 'duration'" in err and len(err.strip().splitlines()) == 1
    assert main(["import", "vllm", str(SGLANG), str(tmp_path / "out")]) == 2
    assert "is a sglang result, not vllm" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "testbed.interop", "add", str(tmp_path), str(VLLM), "--label", "x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr


# -- what an imported file holds, checked before it is expanded ---------------------------------------
def vllm_with(tmp_path, **changes) -> Path:
    """The vLLM fixture with request 1's entries changed ({key: value})."""
    data = json.loads(VLLM.read_text())
    for key, value in changes.items():
        data[key][1] = value
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ttfts": -0.5}, "request 1: ttfts=-0.5 must be a finite number of seconds >= 0"),
        ({"ttfts": math.nan}, "request 1: ttfts=nan must be a finite number of seconds >= 0"),
        ({"latencies": 0.01}, "request 1: ttfts=0.1527 is above its latencies=0.01"),
        ({"itls": [0.02, -1.0]}, "request 1: itls=-1.0 must be a finite number of seconds >= 0"),
        ({"queue_times": -2.0}, "request 1: queue_times=-2.0 must be a finite number of seconds >= 0"),
        ({"start_times": math.inf}, "request 1: start_times=inf must be a finite number of seconds"),
        ({"output_lens": 10**8}, "request 1: output_lens=100000000 must be a whole number of tokens in [0, 10000000]"),
        ({"input_lens": -3}, "request 1: input_lens=-3 must be a whole number of tokens"),
    ],
)
def test_an_imported_file_with_impossible_figures_is_refused_naming_file_and_request(tmp_path, changes, message):
    """Negative, NaN and inconsistent times were imported without a word; a 10^8-token output
    allocated gigabytes of token times before failing."""
    path = vllm_with(tmp_path, **changes)
    with pytest.raises(InteropError, match="^" + re.escape(str(path))) as refused:
        read_vllm_result(path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_an_sglang_file_with_a_negative_ttft_is_refused(tmp_path):
    runs = [json.loads(line) for line in SGLANG.read_text().splitlines() if line.strip()]
    runs[-1]["ttfts"][0] = -1.0
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in runs))
    with pytest.raises(InteropError, match="request 0: ttfts=-1.0"):
        read_sglang_result(path, arrivals=list(range(len(runs[-1]["ttfts"]))))


def test_a_fifo_a_device_or_an_oversized_file_is_refused_before_reading(tmp_path, monkeypatch):
    """A FIFO hung the import, /dev/zero read until memory ran out: refused by stat, unopened."""
    import os

    from testbed.interop import table

    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    for path, message in (
        (fifo, "not a regular file (a FIFO)"),
        (Path("/dev/zero"), "not a regular file"),
        (tmp_path, "not a regular file (a directory)"),
    ):
        with pytest.raises(InteropError, match=re.escape(f"{path}: {message}")):
            table.load_runs(path)
    monkeypatch.setattr(table, "MAX_FILE_BYTES", 100)
    with pytest.raises(InteropError, match="bytes, above the 100-byte cap"):
        read_vllm_result(VLLM)


def test_the_cli_refuses_a_fifo_in_one_line_without_hanging(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.json")
    done = subprocess.run(
        [sys.executable, "-m", "testbed.interop", "import", "vllm", str(tmp_path / "fifo.json"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "not a regular file (a FIFO)" in done.stderr and "Traceback" not in done.stderr


# -- a point exported, and runs added to a saved sweep -------------------------------------------------
def synthetic_run(rate: float, gap: float, n: int = 24, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        arrival = i / rate
        first = arrival + 0.05 + gap * rng.uniform(0, 20)
        rows.append(
            {
                "request_id": i,
                "arrival_s": arrival,
                "input_len": int(rng.integers(50, 5000)),
                "output_len": 6,
                "prefill_start_s": arrival + 0.01,
                "prefill_end_s": first,
                "decode_start_s": first,
                "finished_s": first + 5 * gap,
                "token_times": tokens(first, [gap] * 5),
                "output_token_ids": list(range(6)),
            }
        )
    return request_table(rows)


def make_sweep(directory: Path, study: str, rates: list[float]) -> Config:
    """A saved sweep of two configurations, written the way the runner writes one."""
    cfg = with_overrides(
        Config(),
        {
            "experiment.name": study,
            "experiment.repeats": 1,
            "slo.ttft_s": 0.3,
            "slo.tpot_s": 0.03,
            "workload.rate": rates[0],
        },
    )
    rows = []
    for label, gap in (("colocated", 0.02), ("chunked", 0.035)):
        for rate in rates:
            point = f"{label}_rate{rate:g}" if study in ("rate_sweep", "ratio_sweep") else label
            requests = synthetic_run(rate, gap * rate / rates[0])
            summary = summarize(requests, slo=cfg.slo, metrics=cfg.metrics, num_gpus=2)
            point_cfg = with_overrides(cfg, {"mode": label, "workload.rate": rate})
            write_results(
                directory / "points" / point,
                requests=requests,
                config=dataclasses.asdict(point_cfg),
                meta={},
                summary=summary,
            )
            rows.append(
                {
                    "point": point,
                    "label": label,
                    "mode": label,
                    "rate": rate,
                    "cell": point,
                    "repeat": 0,
                    "seed": 0,
                    "num_gpus": 2,
                    "error": "",
                    "status": "ok",
                    **flatten(summary),
                }
            )
    rewrite(directory, study, pd.DataFrame(rows), cfg)
    return cfg


def drawn(study: str, directory: Path) -> dict:
    from analysis.load import load_sweep
    from analysis.standard_figures import draw
    from tests.figure_checks import check_study

    plotted = {stem: data for stem, _, _, data in draw(study, load_sweep(directory))}
    check_study(plotted, directory)  # every figure still matches what the sweep saved
    return plotted


def test_runs_added_to_a_rate_sweep_become_one_more_line(tmp_path):
    make_sweep(tmp_path, "rate_sweep", [2.0, 4.0])
    before = pd.read_parquet(tmp_path / "sweep.parquet")
    first = add_point(tmp_path, VLLM, label="vllm", figures=False)  # its file says rate 4
    add_point(tmp_path, VLLM_OLD, label="vllm", knobs={"rate": 2.0}, figures=False)
    table = pd.read_parquet(tmp_path / "sweep.parquet")
    added = table[table["label"] == "vllm"].set_index("point")
    assert sorted(added.index) == ["vllm_rate2", "vllm_rate4"] and set(added["mode"]) == {"external"}
    summary = json.loads((tmp_path / "points" / "vllm_rate4" / "summary.json").read_text())
    assert summary["slo"] == {"ttft_s": 0.3, "tpot_s": 0.03}  # the sweep's SLOs, not the import's defaults
    for column, value in flatten(summary).items():
        assert added.loc["vllm_rate4", column] == pytest.approx(value, nan_ok=True), column
    pd.testing.assert_frame_equal(table[table["label"] != "vllm"].reset_index(drop=True)[before.columns], before)
    aggregate = json.loads((tmp_path / "sweep.json").read_text())["aggregate"]
    assert set(aggregate["goodput"]) == {"colocated", "chunked", "vllm"}
    assert first["aggregate"]["goodput"]["vllm"]["rates"] == [4.0]
    assert set(pd.read_parquet(tmp_path / "intervals.parquet")["cell"]) >= {"vllm_rate2", "vllm_rate4"}
    add_point(tmp_path, VLLM, label="vllm", knobs={"rate": 4.0}, figures=False)  # again: replaced, not doubled
    assert len(pd.read_parquet(tmp_path / "sweep.parquet")) == len(table)
    assert "vllm" in drawn("rate_sweep", tmp_path)["attainment_vs_rate"]


def test_a_testbed_run_and_an_sglang_run_added_to_mode_compare(tmp_path):
    sweep = tmp_path / "sweep"
    make_sweep(sweep, "mode_compare", [4.0])
    write_results(
        tmp_path / "other", requests=synthetic_run(4.0, 0.01, seed=3), config={"mode": "chunked"}, meta={}, summary={}
    )
    add_point(sweep, tmp_path / "other", label="chunked-next", figures=False)
    done = add_point(sweep, SGLANG, label="sglang 0.5", figures=True)
    assert done["point"] == "sglang_0.5" and any(p.suffix == ".png" for p in done["figures"])
    cells = json.loads((sweep / "sweep.json").read_text())["aggregate"]["points"]
    assert {"colocated", "chunked", "chunked-next", "sglang_0.5"} <= set(cells)
    plotted = drawn("mode_compare", sweep)
    assert {"chunked-next", "sglang 0.5"} <= set(plotted["latency_cdf"]["ttft"])


def test_add_refuses_what_it_cannot_draw(tmp_path):
    make_sweep(tmp_path / "rates", "rate_sweep", [2.0, 4.0])
    with pytest.raises(InteropError, match="sweep's own configurations"):
        add_point(tmp_path / "rates", VLLM, label="chunked", figures=False)
    unknown = json.loads(VLLM.read_text()) | {"request_rate": "inf"}
    (tmp_path / "inf.json").write_text(json.dumps(unknown))
    with pytest.raises(InteropError, match="--rate"):
        add_point(tmp_path / "rates", tmp_path / "inf.json", label="vllm", figures=False)
    assert not [p for p in (tmp_path / "rates" / "points").iterdir() if p.name.startswith(".")]
    body = json.loads((tmp_path / "rates" / "sweep.json").read_text()) | {"experiment": "chunk_sweep"}
    (tmp_path / "rates" / "sweep.json").write_text(json.dumps(body))
    with pytest.raises(InteropError, match=", ".join(MERGEABLE)):
        add_point(tmp_path / "rates", VLLM, label="vllm", figures=False)


def test_export_a_point(tmp_path, capsys):
    """A run writes its trace with the sharing of its real prompts; exporting the saved point
    later with a tokenizer makes text prompts that share exactly the same blocks."""
    requests = synthetic_run(4.0, 0.02, n=5)
    cfg = dataclasses.asdict(with_overrides(Config(), {"slo.ttft_s": 0.3, "workload.rate": 4.0}))
    write_results(tmp_path / "p", requests=requests, config=cfg, meta={}, summary={})
    assert main(["export", str(tmp_path / "p")]) == 0
    assert "no prompts" in capsys.readouterr().out
    trace = tmp_path / "p" / "exports" / "trace.mooncake.jsonl"
    ids = sum(map(list, read_mooncake_jsonl(trace).hash_ids), [])
    assert len(ids) == len(set(ids))  # lengths only: no block shared
    prompts = {i: [i % 2] * int(n) for i, n in zip(requests["request_id"], requests["input_len"])}
    export_run(tmp_path / "p" / "exports", requests, cfg, prompts)  # what the run itself writes
    shared = read_mooncake_jsonl(trace).hash_ids
    assert len(set(sum(map(list, shared), []))) < len(sum(map(list, shared), []))
    done = export_point(tmp_path / "p", decode=lambda ids: " ".join(map(str, ids)), vocab_size=50)
    assert [p.name for p in done["files"]] == ["trace.mooncake.jsonl", "vllm_custom.jsonl", "vllm_result.json"]
    assert read_mooncake_jsonl(trace).hash_ids == shared  # the stand-in prompts share what the run's shared
    lines = [json.loads(line) for line in (tmp_path / "p" / "exports" / "vllm_custom.jsonl").read_text().splitlines()]
    offered = offered_rows(requests)
    assert [len(line["prompt"].split()) for line in lines] == offered["input_len"].tolist()
    assert [line["output_tokens"] for line in lines] == offered["output_len"].tolist()
    result = json.loads((tmp_path / "p" / "exports" / "vllm_result.json").read_text())
    assert result["num_prompts"] == 5 and result["completed"] == 5 and result["request_rate"] == 4.0


# -- summary-only files, every format's quirks, and malformed files ------------------------------------
DETAIL_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def without_details(data: dict) -> dict:
    """What `vllm bench serve --save-result` keeps without --save-detailed (latencies and
    queue_times stay in recent versions), or an SGLang line without --output-details."""
    return {k: v for k, v in data.items() if k not in DETAIL_KEYS}


def written(tmp_path: Path, name: str, data: dict, lines: bool = False) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) + "\n" if lines else json.dumps(data))
    return path


def test_a_vllm_summary_file_imports_as_a_summary_only_point(tmp_path):
    data = without_details(json.loads(VLLM.read_text()))
    done = import_run(written(tmp_path, "v.json", data), tmp_path / "out", slo=SLO, num_gpus=2)
    summary = done["summary"]
    assert summary["summary_only"] is True and done["meta"]["summary_only"] is True and done["requests"].empty
    assert summary["num_requests"] == {
        "ok": 4,
        "failed": 1,
        "rejected": 0,
        "refused": 0,
        "total": 5,
        "failed_known": True,
    }
    for ours, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        assert summary[ours]["p99"] == pytest.approx(data[f"p99_{theirs}_ms"] / 1e3)
        assert summary[ours]["p50"] == pytest.approx(data[f"median_{theirs}_ms"] / 1e3)
        assert summary[ours]["mean"] == pytest.approx(data[f"mean_{theirs}_ms"] / 1e3)
        assert summary[ours]["max"] is None  # vLLM writes no max
    assert summary["throughput"]["requests_per_s"] == pytest.approx(data["request_throughput"])
    assert summary["throughput"]["requests_per_s_per_gpu"] == pytest.approx(data["request_throughput"] / 2)
    assert summary["slo_attainment"] is None and summary["offered_rate"] == 4.0 and done["rate"] == 4.0
    assert summary["source"]["request_goodput"] == pytest.approx(data["request_goodput"])
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["summary_only"] is True and saved["ttft"]["p99"] == pytest.approx(summary["ttft"]["p99"])


def test_an_sglang_summary_line_imports_with_its_own_keys(tmp_path):
    lines = [json.loads(line) for line in SGLANG.read_text().splitlines()]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(without_details(line)) + "\n" for line in lines))
    done = import_run(path, tmp_path / "out", slo=SLO, run=0)
    summary, data = done["summary"], lines[0]
    assert summary["summary_only"] and summary["num_requests"]["ok"] == data["completed"]
    assert summary["num_requests"]["failed_known"] is False  # SGLang writes no failed count
    assert summary["itl"]["p95"] == pytest.approx(data["p95_itl_ms"] / 1e3)
    assert summary["e2e"]["p99"] == pytest.approx(data["p99_e2e_latency_ms"] / 1e3)
    assert summary["throughput"]["total_tokens_per_s"] == pytest.approx(data["total_throughput"])


@pytest.mark.parametrize(
    "text, rate", [('"inf"', math.inf), ("Infinity", math.inf), ("8", 8.0), ("2.5", 2.5), ("null", math.nan)]
)
def test_request_rate_as_each_version_writes_it(tmp_path, text, rate):
    data = without_details(json.loads(VLLM.read_text()))
    body = json.dumps({**data, "request_rate": "RATE"}).replace('"RATE"', text)
    (tmp_path / "v.json").write_text(body)
    done = import_run(tmp_path / "v.json", tmp_path / "out", slo=SLO)
    assert done["rate"] == rate or (math.isnan(rate) and math.isnan(done["rate"]))
    detailed = json.dumps({**json.loads(VLLM_OLD.read_text()), "request_rate": "RATE"}).replace('"RATE"', text)
    (tmp_path / "d.json").write_text(detailed)
    table = read_vllm_result(tmp_path / "d.json")  # send times reconstructed from each form of the rate
    assert len(table) == 5 and (table["arrival_s"] == 0).all() == (not math.isfinite(rate) or math.isnan(rate))


def test_old_vllm_summaries_goodput_null_and_everything_failed(tmp_path):
    old = without_details(json.loads(VLLM_OLD.read_text()))  # 0.6: `request_goodput:` null, no failed key
    done = import_run(written(tmp_path, "old.json", old), tmp_path / "a", slo=SLO)
    assert done["summary"]["source"]["request_goodput"] is None
    assert done["summary"]["num_requests"]["failed"] == 1  # num_prompts - completed
    assert done["summary"]["ttft"]["p90"] is None and done["summary"]["ttft"]["p99"] == pytest.approx(0.150642)
    data = without_details(json.loads(VLLM.read_text()))
    zeros = {k: (0.0 if k.endswith("_ms") else v) for k, v in data.items()}
    failed = {**zeros, "completed": 0, "failed": 5, "request_throughput": 0.0, "request_goodput": None}
    summary = import_run(written(tmp_path, "failed.json", failed), tmp_path / "b", slo=SLO)["summary"]
    assert summary["num_requests"]["ok"] == 0 and summary["num_requests"]["failed"] == 5
    assert all(v is None for m in ("ttft", "tpot", "itl", "e2e") for v in summary[m].values())  # not 0 ms
    detailed = json.loads(VLLM.read_text())
    n = len(detailed["ttfts"])
    every_failed = {
        **detailed,
        "completed": 0,
        "failed": n,
        "ttfts": [0.0] * n,
        "itls": [[] for _ in range(n)],
        "output_lens": [0] * n,
        "errors": ["Server disconnected"] * n,
    }
    run = import_run(written(tmp_path, "all_failed.json", every_failed), tmp_path / "c", slo=SLO)
    assert run["summary"]["num_requests"]["failed"] == n and run["summary"]["slo_attainment"] == 0


def test_a_file_with_send_times_but_no_queue_times_says_so(tmp_path):
    data = json.loads(VLLM.read_text())
    data.pop("queue_times")
    table = read_vllm_result(written(tmp_path, "v.json", data))
    sent = np.array(data["start_times"])
    np.testing.assert_allclose(table["arrival_s"], sent - sent.min())
    assert table.attrs["interop"]["arrivals"].startswith("start_times (the file has no queue_times")


def test_the_export_writes_only_keys_vllm_writes(tmp_path):
    result = bench_result(hand_made(), slo_ttft_s=0.1, slo_tpot_s=0.03, model_id="tiny", request_rate=4.0)
    stats = {
        f"{s}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")
    }
    assert set(result) <= set(VLLM_KEYS) | stats | {"rtfx"}


def test_a_summary_only_point_joins_a_rate_sweep_and_the_figures_say_what_they_leave_out(tmp_path):
    make_sweep(tmp_path, "rate_sweep", [2.0, 4.0])
    data = without_details(json.loads(VLLM.read_text()))
    done = add_point(tmp_path, written(tmp_path, "v.json", data), label="vllm", figures=True)
    assert done["point"] == "vllm_rate4"
    table = pd.read_parquet(tmp_path / "sweep.parquet").set_index("point")
    assert table.loc["vllm_rate4", "ttft_p99"] == pytest.approx(data["p99_ttft_ms"] / 1e3)  # in the table
    aggregate = json.loads((tmp_path / "sweep.json").read_text())["aggregate"]
    assert set(aggregate["goodput"]) == {"colocated", "chunked"}  # no attainment: no goodput, not a made-up one
    assert aggregate["left_out"]["points"] == ["vllm_rate4"]
    cells = pd.read_parquet(tmp_path / "intervals.parquet").set_index("cell")
    assert cells.loc["vllm_rate4", "ttft_p99"] == pytest.approx(data["p99_ttft_ms"] / 1e3)
    assert np.isnan(cells.loc["vllm_rate4", "ttft_p99_low"])
    captions = {p.stem: p.read_text() for p in (tmp_path / "figures").glob("*.txt")}
    assert "Left out: vllm_rate4 (summary-only imports" in captions["attainment_vs_rate"]
    assert "vllm" in captions["latency_vs_rate"] and "Left out" not in captions["latency_vs_rate"]


# Hypothesis: whatever a file holds, an import is a results directory or one InteropError naming the file.
# No subnormal floats: a library loaded earlier in the process may have set flush-to-zero (-ffast-math)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True, allow_subnormal=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SUMMARY_KEYS = (
    "completed",
    "failed",
    "num_prompts",
    "duration",
    "request_rate",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "p99_ttft_ms",
    "median_tpot_ms",
    "mean_itl_ms",
    "p95_itl_ms",
    "ttfts",
    "itls",
    "input_lens",
    "output_lens",
    "errors",
    "start_times",
    "queue_times",
    "model_id",
    "dataset_name",
    "mean_e2e_latency_ms",
)
FILE_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def import_or_one_line(path: Path, out: Path, fmt) -> None:
    try:
        import_run(path, out, fmt=fmt, slo=SLO)
    except InteropError as error:
        assert str(path) in str(error) and "\n" not in str(error), str(error)


@FILE_SETTINGS
@given(
    body=st.one_of(JSON, st.dictionaries(st.sampled_from(SUMMARY_KEYS), JSON, max_size=10)),
    fmt=st.sampled_from([None, "vllm", "sglang"]),
)
def test_any_json_imports_or_is_one_line_naming_the_file(tmp_path, body, fmt):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(body))
    import_or_one_line(path, tmp_path / "out", fmt)


@FILE_SETTINGS
@given(
    source=st.sampled_from([VLLM, VLLM_OLD, SGLANG]), key=st.sampled_from(SUMMARY_KEYS), value=JSON, drop=st.booleans()
)
def test_a_real_file_with_one_field_broken_imports_or_is_one_line(tmp_path, source, key, value, drop):
    from testbed.interop.table import load_runs

    data = load_runs(source)[-1]
    if drop:
        data.pop(key, None)
    else:
        data[key] = value
    path = tmp_path / source.name
    path.write_text(json.dumps(data))
    import_or_one_line(path, tmp_path / "out", None)


@FILE_SETTINGS
@given(
    completed=st.integers(0, 10**6),
    failed=st.integers(0, 10**6),
    rate=st.one_of(st.floats(0.001, 1e4, allow_subnormal=False), st.just("inf"), st.just(math.inf)),
    p99=st.floats(0, 1e7, allow_subnormal=False),
    median=st.floats(0, 1e7, allow_subnormal=False),
    throughput=st.floats(0, 1e6, allow_subnormal=False),
    sglang=st.booleans(),
)
def test_a_valid_summary_keeps_its_figures(tmp_path, completed, failed, rate, p99, median, throughput, sglang):
    if sglang:
        data = {
            "backend": "sglang",
            "dataset_name": "random",
            "request_rate": rate,
            "completed": completed,
            "duration": 10.0,
            "request_throughput": throughput,
            "p99_ttft_ms": p99,
            "median_ttft_ms": median,
            "total_throughput": 1.0,
        }
    else:
        data = {
            "backend": "vllm",
            "model_id": "m",
            "request_rate": rate,
            "completed": completed,
            "failed": failed,
            "duration": 10.0,
            "request_throughput": throughput,
            "p99_ttft_ms": p99,
            "median_ttft_ms": median,
            "request_goodput": None,
            "total_token_throughput": 1.0,
        }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    done = import_run(path, tmp_path / "out", slo=SLO)
    summary = done["summary"]
    assert summary["num_requests"]["ok"] == completed
    assert summary["num_requests"]["failed"] == (0 if sglang else failed)
    assert summary["throughput"]["requests_per_s"] == pytest.approx(throughput)
    assert done["rate"] == (math.inf if rate in ("inf", math.inf) else pytest.approx(rate))
    if completed:
        assert summary["ttft"]["p99"] == pytest.approx(p99 / 1e3) and summary["ttft"]["p50"] == pytest.approx(
            median / 1e3
        )
    else:
        assert summary["ttft"]["p99"] is None
