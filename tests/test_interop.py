"""Interop with vLLM's and SGLang's benchmarks: export (Mooncake trace, vLLM custom dataset, vLLM
result keys), import (their result files as results directories) and drawing an imported run
beside a study's own configurations. Fixtures under tests/data/interop/ carry the real key names
of `vllm bench serve --save-result --save-detailed` (current and pre-0.10) and of SGLang's
`bench_serving --output-file --output-details`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.config import Config, with_overrides
from testbed.experiments.merge import SUPPORTED, add_point, rewrite
from testbed.experiments.sweep import flatten
from testbed.interop import (InteropError, bench_result, block_hash_ids, export_point, export_run, import_run,
                             read_sglang_result, read_vllm_result, write_mooncake_jsonl, write_vllm_custom_jsonl)
from testbed.interop.__main__ import main
from testbed.interop.points import offered_rows
from testbed.metrics.config import SLOConfig
from testbed.metrics.events import request_table
from testbed.metrics.latency import pooled_itl
from testbed.metrics.slo import meets_slo
from testbed.metrics.summary import summarize
from testbed.tracking.results import write_json, write_results
from testbed.workload.traces import read_mooncake_jsonl

DATA = Path(__file__).parent / "data" / "interop"
VLLM, VLLM_OLD, SGLANG = DATA / "vllm_bench_serve.json", DATA / "vllm_benchmark_serving_old.json", \
    DATA / "sglang_bench_serving.jsonl"
SLO = SLOConfig(ttft_s=0.1, tpot_s=0.03)
# what `vllm bench serve --save-result --save-detailed` writes (vllm/benchmarks/serve.py)
VLLM_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests"]


def tokens(first: float, gaps: list[float]) -> list[float]:
    return list(first + np.concatenate([[0.0], np.cumsum(gaps)]))


def hand_made() -> pd.DataFrame:
    """Served requests (one with two tokens in one message), a failure after one token, a
    refusal by admission control and one the workload's overlength filter dropped."""
    served = [(0, 0.10, 700, tokens(0.15, [0.02, 0.0, 0.03])), (1, 0.30, 90, tokens(0.50, [0.05, 0.01])),
              (2, 0.35, 2000, [0.41]), (6, 0.60, 300, tokens(0.64, [0.02, 0.02]))]
    rows = [{"request_id": i, "arrival_s": a, "input_len": n, "output_len": len(t), "token_times": t}
            for i, a, n, t in served]
    rows += [{"request_id": 3, "arrival_s": 0.40, "input_len": 50, "output_len": 5, "status": "failed",
              "reason": "worker died", "token_times": [0.47]},
             {"request_id": 4, "arrival_s": 0.45, "input_len": 60, "output_len": 5, "status": "rejected",
              "reason": "queue full", "refused_by": "admission"},
             {"request_id": 5, "arrival_s": 0.50, "input_len": 99999, "output_len": 5, "status": "rejected",
              "reason": "too long", "refused_by": "workload"}]
    return request_table(sorted(rows, key=lambda r: r["request_id"]))


def test_bench_result_round_trips_through_vllms_file(tmp_path):
    requests = hand_made()
    result = bench_result(requests, slo_ttft_s=SLO.ttft_s, slo_tpot_s=SLO.tpot_s, model_id="tiny", request_rate=4.0)
    assert [k for k in VLLM_KEYS if k not in result] == []
    assert {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p90",
                                                                              "p95", "p99")} <= set(result)
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
    prompts = [turn0, system + rng.integers(0, 1000, 700).tolist(), turn0 + rng.integers(0, 1000, 600).tolist(),
               system + rng.integers(0, 1000, 100).tolist(), None, turn0[:512] + [7] * 10]
    rows = pd.DataFrame({"request_id": range(6), "arrival_s": [0.5, 0.0123, 1.7, 2.25, 2.5, 3.0],
                         "input_len": [len(p) if p else 900 for p in prompts], "output_len": [5, 6, 7, 8, 9, 10],
                         "session_id": [0, 1, 0, 2, 3, 4], "turn": [0, 0, 1, 0, 0, 0],
                         "prompt_token_ids": pd.Series(prompts, dtype=object)})
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
                same = prompt is not None and prompts[j] is not None and \
                    prompt[:512 * (k + 1)] == prompts[j][:512 * (k + 1)]
                assert (ids[k] == hashes[j][k]) == same, (i, j, k)
    assert sorted(set(sum(map(list, hashes), []))) == list(range(len(set(sum(map(list, hashes), [])))))
    assert block_hash_ids([[1, 2, 3]], [3], block_size=2) == [[0, 1]]


def test_vllm_custom_dataset_lines(tmp_path):
    rows = pd.DataFrame({"request_id": [0, 1], "arrival_s": [1.0, 0.5], "input_len": [2, 3], "output_len": [7, 9],
                         "session_id": [None, None], "turn": [0, 0],
                         "prompt_token_ids": pd.Series([[1, 2], [3, 4, 5]], dtype=object)})
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
        "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"]  # a traceback's last line
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
    assert "'ttfts'" in err and "--save-detailed" in err
    assert main(["import", "vllm", str(SGLANG), str(tmp_path / "out")]) == 2
    assert "is a sglang result, not vllm" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "testbed.interop", "add", str(tmp_path), str(VLLM), "--label", "x"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr


# -- a point exported, and runs added to a saved sweep -------------------------------------------------
def synthetic_run(rate: float, gap: float, n: int = 24, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        arrival = i / rate
        first = arrival + 0.05 + gap * rng.uniform(0, 20)
        rows.append({"request_id": i, "arrival_s": arrival, "input_len": int(rng.integers(50, 5000)), "output_len": 6,
                     "prefill_start_s": arrival + 0.01, "prefill_end_s": first, "decode_start_s": first,
                     "finished_s": first + 5 * gap, "token_times": tokens(first, [gap] * 5),
                     "output_token_ids": list(range(6))})
    return request_table(rows)


def make_sweep(directory: Path, study: str, rates: list[float]) -> Config:
    """A saved sweep of two configurations, written the way the runner writes one."""
    cfg = with_overrides(Config(), {"experiment.name": study, "experiment.repeats": 1, "slo.ttft_s": 0.3,
                                    "slo.tpot_s": 0.03, "workload.rate": rates[0]})
    rows = []
    for label, gap in (("colocated", 0.02), ("chunked", 0.035)):
        for rate in rates:
            point = f"{label}_rate{rate:g}" if study in ("rate_sweep", "ratio_sweep") else label
            requests = synthetic_run(rate, gap * rate / rates[0])
            summary = summarize(requests, slo=cfg.slo, metrics=cfg.metrics, num_gpus=2)
            point_cfg = with_overrides(cfg, {"mode": label, "workload.rate": rate})
            write_results(directory / "points" / point, requests=requests, config=dataclasses.asdict(point_cfg),
                          meta={}, summary=summary)
            rows.append({"point": point, "label": label, "mode": label, "rate": rate, "cell": point, "repeat": 0,
                         "seed": 0, "num_gpus": 2, "error": "", "status": "ok", **flatten(summary)})
    rewrite(directory, study, pd.DataFrame(rows), cfg)
    return cfg


def drawn(study: str, directory: Path) -> dict:
    from analysis.load import load_sweep
    from analysis.studies import draw
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
    write_results(tmp_path / "other", requests=synthetic_run(4.0, 0.01, seed=3), config={"mode": "chunked"},
                  meta={}, summary={})
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
    with pytest.raises(InteropError, match=", ".join(SUPPORTED)):
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
