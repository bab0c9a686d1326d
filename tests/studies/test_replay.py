"""+experiment=replay: a real engine's result file replayed in the simulator, the relative error
per figure, and the validation set (tests/data/replay/: published GPU runs with provenance)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.config import Config, with_overrides
from testbed.errors import ConfigError
from testbed.interop.reference import read_reference, relative_error
from testbed.studies.replay import error_table, load_setup, mape, replay
from testbed.studies.validation_set import (
    fit_frontend,
    fit_overhead,
    headline,
    load_manifest,
    markdown,
    pair_rows,
    reference_file,
    shifted,
    table_mape,
)
from tests.paths import ROOT, TEST_DATA

REPLAY = TEST_DATA / "replay"
INTEROP = TEST_DATA / "interop"
SGLANG_RPS4 = REPLAY / "sglang030_a100_llama31_8b_rps4.jsonl"
VLLM_OFFLINE = REPLAY / "vllm060_a100_llama31_8b_offline.jsonl"


def _cfg() -> Config:
    return with_overrides(Config(), {"experiment.name": "replay", "experiment.repeats": 1})


def _run_point(cfg, out_dir):
    from testbed.studies.runner import run_point

    return run_point(cfg, out_dir)


SMALL_SETUP = {
    "engine": "sglang 0.5.2 (fixture)",
    "profile": "sglang",  # no profile covers SGLang 0.5: the setup names the nearest
    "gpu": "a100_80g",
    "tp": 1,
    "model": "llama3_8b",
    "dtype": "bf16",
    "policy": "colocated",
    "max_batched_tokens": 8192,
    "max_running": 64,
    "prefix_caching": False,
}


# -- the importers' definitions, on the files ----------------------------------------------------
@pytest.mark.parametrize(
    "path, keys",
    [
        (INTEROP / "sglang_bench_serving.jsonl", {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e_latency"}),
        (INTEROP / "vllm_bench_serve.json", {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el"}),
    ],
)
def test_detailed_reference_recomputes_the_clients_own_figures(path, keys):
    """Per-request lists read by the testbed's definitions (TTFT from the send, TPOT per token over
    output_len - 1) give back the summary the client wrote beside them: the definitions agree."""
    ref = read_reference(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else json.loads(text.splitlines()[-1])
    assert ref.detailed and ref.num_requests == len(data["ttfts"])
    for ours, theirs in keys.items():
        assert ref.figures[ours]["mean"] == pytest.approx(data[f"mean_{theirs}_ms"] / 1000, rel=2e-3)
        assert ref.figures[ours]["p50"] == pytest.approx(data[f"median_{theirs}_ms"] / 1000, rel=2e-3)
    assert "per token" in ref.definitions["tpot"] and "chunk" in ref.definitions["itl"]


def test_published_summary_reference_reads_only_what_was_published():
    """The SGLang README's row: medians in seconds, means and tails absent (None, not estimated)."""
    ref = read_reference(SGLANG_RPS4)
    assert ref.format == "sglang" and not ref.detailed
    assert ref.figures["ttft"]["p50"] == pytest.approx(0.03198)
    assert ref.figures["tpot"]["p50"] == pytest.approx(0.01317)
    assert ref.figures["e2e"]["p50"] == pytest.approx(1.56417)
    assert ref.figures["ttft"]["mean"] is None and ref.figures["e2e"]["p99"] is None
    assert ref.rate == 4 and ref.num_requests == 1200
    offline = read_reference(VLLM_OFFLINE)
    assert math.isinf(offline.rate) and offline.throughput["requests_per_s"] == pytest.approx(21.27)


# -- the error table's arithmetic ---------------------------------------------------------------
def test_error_arithmetic():
    assert relative_error(0.11, 0.10) == pytest.approx(0.10)
    assert relative_error(0.09, 0.10) == pytest.approx(-0.10)
    assert relative_error(None, 0.1) is None and relative_error(0.1, None) is None and relative_error(0.1, 0) is None
    rows = [
        {"figure": "ttft_p50", "real": 0.1, "sim": 0.08, "error": -0.2},
        {"figure": "tpot_p50", "real": 0.01, "sim": 0.011, "error": 0.1},
        {"figure": "e2e_mean", "real": 2.0, "sim": 2.2, "error": 0.1},
        {"figure": "e2e_p50", "real": None, "sim": 1.0, "error": None},
        {"figure": "throughput_requests_per_s", "real": 20.0, "sim": 22.0, "error": 0.1},
    ]
    assert mape(rows) == pytest.approx((0.2 + 0.1 + 0.1 + 0.1) / 4)
    assert mape(rows, {"ttft_p50", "tpot_p50"}) == pytest.approx(0.15)
    # the headline takes the mean where published, else the median
    assert headline(rows) == {
        "ttft": ("ttft_p50", -0.2),
        "tpot": ("tpot_p50", 0.1),
        "e2e": ("e2e_mean", 0.1),
        "requests_per_s": ("throughput_requests_per_s", 0.1),
    }
    cases = [{"headline": headline(rows)}, {"headline": {"ttft": ("ttft_mean", 0.4)}}]
    assert table_mape(cases)["ttft"] == {"mape": pytest.approx(0.3), "cases": 2}
    assert table_mape(cases)["tpot"] == {"mape": pytest.approx(0.1), "cases": 1}
    assert fit_overhead(
        {
            (0.0, 0.0): {"score": 0.3},
            (0.001, 0.0): {"score": 0.1},
            (0.002, 0.0): {"score": 0.1},
            (0.004, 0.0): {"score": None},
        }
    ) == (0.001, 0.0)
    # a front-end delay moves TTFT and E2E by itself and nothing else: fitted on the figures
    moved = {r["figure"]: r for r in shifted(rows, 0.02)}
    assert moved["ttft_p50"]["sim"] == pytest.approx(0.1) and moved["ttft_p50"]["error"] == pytest.approx(0.0)
    assert moved["tpot_p50"]["sim"] == 0.011 and moved["e2e_mean"]["sim"] == pytest.approx(2.22)
    assert fit_frontend([rows])[0] == pytest.approx(0.02)
    text = error_table(rows)
    assert "-20.0%" in text and "100.00" in text and "+10.0%" in text
    summary = {
        "cases": [
            {
                "name": "c",
                "role": "held_out",
                "rows": rows,
                "knobs": {"host_overhead_s": 0.002, "host_overhead_per_seq_s": 5e-5, "frontend_latency_s": 0.01},
            }
        ],
        "calibration": {"ttft": {"mape": None, "cases": 0}},
        "held_out": table_mape(cases),
    }
    table = markdown(summary)
    assert "| c | held_out | 2 ms + 50 us/seq, front end 10 ms | ttft_p50 | 100.00 | 80.00 | -20.0% |" in table
    assert "| held_out | ttft | 30.0% | 2 |" in table and "e2e_p50" not in table  # no real figure: no row


# -- the setup ------------------------------------------------------------------------------------
def test_setup_refuses_what_cannot_be_replayed(tmp_path):
    path = tmp_path / "setup.yaml"
    for bad, words in (
        ({"tp": 0}, "tensor-parallel degree"),
        ({"gpu": "tpu"}, "gpu="),
        ({"knob": 1}, "unknown"),
        ({"policy": "split"}, "policy"),
        ({"policy": "disagg", "nodes": 0}, "nodes"),
        ({"weight_bits": 3}, "weight_bits"),
        ({"dtype": "int3"}, "dtype"),
    ):
        path.write_text(yaml.safe_dump({**SMALL_SETUP, **bad}))
        with pytest.raises(ConfigError, match=words):
            load_setup(path)


def test_a_tensor_parallel_run_replays_on_a_group_of_its_degree(tmp_path):
    """The 70B cases (tp 4 on H100s): the simulated worker spans four devices, each rank a quarter
    of the weights; emulation, which runs in real time, skips a run this long and says so (a TP
    group is emulated as any worker: tests/cluster/test_tensor_parallel_workers.py)."""
    case = REPLAY / "vllm060_h100_tp4_llama31_70b_rps4.jsonl"
    result = replay(
        _cfg(), case, REPLAY / "vllm060_h100_tp4.setup.yaml", tmp_path, _run_point, emulate=True, quiet=True
    )
    assert result["overrides"]["cluster.tp"] == 4 and result["overrides"]["hardware.num_devices"] == 4
    assert any("emulation skipped: it runs in real time" in note for note in result["notes"])
    rows = {r["figure"]: r for r in result["rows"]}
    assert rows["tpot_p50"]["sim"] is not None and rows["tpot_p50"]["error"] is not None
    _, cases = load_manifest(REPLAY / "cases.yaml")
    assert {c["calibrated_by"] for c in cases if "tp4" in c["group"]} == {"sglang030_a100", "vllm060_a100"}


def test_a_group_without_calibration_must_borrow_one(tmp_path):
    manifest = tmp_path / "cases.yaml"
    manifest.write_text(yaml.safe_dump({"cases": [{"name": "a", "setup": "s.yaml", "group": "g", "role": "held_out"}]}))
    with pytest.raises(ConfigError, match="calibrated_by"):
        load_manifest(manifest)


def test_validation_set_files_have_provenance():
    """Every case has its reference file, setup and a provenance YAML naming repository, commit and
    path, and what is unknown; some are held out."""
    base, cases = load_manifest(REPLAY / "cases.yaml")
    assert {c["role"] for c in cases} == {"calibrate", "held_out"}
    for case in cases:
        assert reference_file(base, case).is_file()
        load_setup(base / case["setup"])
        provenance = yaml.safe_load((base / f"{case['name']}.provenance.yaml").read_text())
        assert (
            set(provenance["source"]) == {"repository", "commit", "path"} and len(provenance["source"]["commit"]) == 40
        )
        assert provenance["unknown"]


# -- the study end to end -----------------------------------------------------------------------
def test_replay_of_a_detailed_file_rebuilds_its_requests(tmp_path):
    """A per-request file replays its own requests (lengths and arrivals) in the simulator."""
    setup = tmp_path / "setup.yaml"
    setup.write_text(yaml.safe_dump(SMALL_SETUP))
    result = replay(_cfg(), INTEROP / "sglang_bench_serving.jsonl", setup, tmp_path / "out", _run_point, quiet=True)
    trace = [json.loads(line) for line in (tmp_path / "out" / "reference_trace.jsonl").read_text().splitlines()]
    data = json.loads((INTEROP / "sglang_bench_serving.jsonl").read_text().splitlines()[-1])
    assert [t["input_len"] for t in trace] == [n for n, e in zip(data["input_lens"], data["errors"]) if not e]
    rows = {r["figure"]: r for r in result["rows"]}
    assert all(rows[f"{m}_mean"]["error"] is not None for m in ("ttft", "tpot", "e2e"))
    assert (tmp_path / "out" / "replay.png").is_file() and (tmp_path / "out" / "replay.csv").is_file()
    saved = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert saved["overrides"]["workload.arrival"] == "trace" and saved["gpu"] == "a100_80g"


def test_replay_study_from_the_command_line(tmp_path):
    """`python -m testbed +experiment=replay` on a published case: the error table is printed and
    replay.json holds it; the setup's unset host terms leave the cost model as shipped."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed",
            "+experiment=replay",
            f"experiment.own.reference={SGLANG_RPS4}",
            f"experiment.own.setup={REPLAY / 'sglang030_a100.setup.yaml'}",
            f"hydra.run.dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ttft_p50 ms" in proc.stdout and "31.98" in proc.stdout
    result = json.loads((out / "replay.json").read_text())
    assert result["knobs"]["host_overhead_s"] is None and result["overrides"]["engine.host_overhead_s"] is None
    assert result["overrides"]["engine.cuda_graphs"] is True and result["overrides"]["sim.num_scheduler_steps"] == 1
    rows = {r["figure"]: r for r in result["rows"]}
    assert abs(rows["tpot_p50"]["error"]) < 0.5 and rows["ttft_mean"]["real"] is None
    assert any("torch-compile" in note for note in result["notes"])


def test_replay_needs_its_files():
    from testbed.studies.replay import run_replay

    with pytest.raises(ConfigError, match="experiment.own.reference"):
        run_replay(_cfg(), Path("."), _run_point)


def test_a_pd_pair_compares_the_difference_disagg_makes_real_and_simulated():
    """A pair's figure: disagg - colocated, real beside simulated, its sign and its error."""
    results = [
        {"name": "co", "rows": [{"figure": "ttft_mean", "real": 0.10, "sim": 0.08}]},
        {"name": "pd", "rows": [{"figure": "ttft_mean", "real": 0.20, "sim": 0.17}]},
        {"name": "pd2", "rows": [{"figure": "ttft_mean", "real": 0.20, "sim": 0.07}]},
    ]
    pairs = [{"colocated": "co", "disagg": "pd"}, {"colocated": "co", "disagg": "pd2"}]
    good, wrong = pair_rows(results, pairs, ("ttft_mean",))
    assert good["real"] == pytest.approx(0.10) and good["sim"] == pytest.approx(0.09)
    assert good["same_sign"] and good["error"] == pytest.approx(-0.1) and good["within"]
    assert not wrong["same_sign"] and not wrong["within"]


def test_the_mooncake_pd_pairs_replay_disagg_across_two_nodes(tmp_path):
    """Mooncake's vLLM 0.6.2 P/D benchmark on A10s: a 1P1D setup runs P and D on two nodes, the KV
    over the stated network, the int4 checkpoint's weights read at 4 bits."""
    setup = load_setup(REPLAY / "mooncake_vllm062_a10_in256_rdma.setup.yaml")
    assert setup["policy"] == "disagg" and setup["weight_bits"] == 4
    result = replay(
        _cfg(),
        REPLAY / "mooncake_vllm062_a10_in256_qps2_rdma.json",
        REPLAY / "mooncake_vllm062_a10_in256_rdma.setup.yaml",
        tmp_path,
        _run_point,
        quiet=True,
    )
    o = result["overrides"]
    assert (o["mode"], o["cluster.num_prefill"], o["cluster.num_decode"], o["hardware.num_nodes"]) == (
        "disagg",
        1,
        1,
        2,
    )
    assert o["sim.weight_bits"] == 4 and o["hardware.internode_gbps"] == 12.5
    rows = {r["figure"]: r for r in result["rows"]}
    assert rows["ttft_mean"]["sim"] and rows["throughput_requests_per_s"]["error"] == pytest.approx(0, abs=0.05)
    _, cases = load_manifest(REPLAY / "cases.yaml")
    names = {c["name"] for c in cases}
    pairs = yaml.safe_load((REPLAY / "cases.yaml").read_text())["pairs"]
    assert len(pairs) == 10 and all(set(p.values()) <= names for p in pairs)


def test_a_disaggregated_group_calibrates_its_link_at_a_colocated_groups_host_terms(tmp_path):
    """The manifest names, for a P/D calibration case, the colocated group whose host terms it runs
    at; without one, one line says so."""
    for name in ("mooncake_vllm062_a10_in256_rdma.setup.yaml", "mooncake_vllm062_a10_in256_colocated.setup.yaml"):
        (tmp_path / name).write_text((REPLAY / name).read_text())
    co = {"name": "co", "setup": "mooncake_vllm062_a10_in256_colocated.setup.yaml", "group": "a10", "role": "calibrate"}
    pd = {"name": "pd", "setup": "mooncake_vllm062_a10_in256_rdma.setup.yaml", "group": "a10_rdma", "role": "calibrate"}
    manifest = tmp_path / "cases.yaml"
    manifest.write_text(yaml.safe_dump({"cases": [co, {**pd, "calibrated_by": "a10"}]}))
    load_manifest(manifest)
    manifest.write_text(yaml.safe_dump({"cases": [co, pd]}))
    with pytest.raises(ConfigError, match="hand-off path at the host terms of a colocated group"):
        load_manifest(manifest)


def test_a_client_behind_a_disaggregating_proxy_sees_the_decode_workers_first_token(tmp_path):
    """first_token: decode: TTFT moves to the request's second token (the decode worker's first,
    after the KV), TPOT to the gaps after it."""
    import pandas as pd

    from testbed.studies.replay import decode_first

    requests = pd.DataFrame(
        {
            "status": ["ok", "ok"],
            "ttft": [0.05, 0.06],
            "token_times": [[1.05, 1.15, 1.16, 1.17], [2.06, 2.26, 2.28, 2.30]],
        }
    )
    summary = decode_first({"e2e": {"mean": 1.0}}, requests)
    assert summary["ttft"]["mean"] == pytest.approx((0.15 + 0.26) / 2)
    assert summary["tpot"]["mean"] == pytest.approx((0.01 + 0.02) / 2)
    assert summary["e2e"] == {"mean": 1.0}
    bad = yaml.safe_load((REPLAY / "mooncake_vllm062_a10_in256_rdma.setup.yaml").read_text())
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**bad, "first_token": "proxy"}))
    with pytest.raises(ConfigError, match="first_token='proxy' is not one of prefill, decode"):
        load_setup(tmp_path / "s.yaml")
