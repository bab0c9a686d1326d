"""inference-perf's lifecycle-metrics JSON and GuideLLM's benchmark report, read in the testbed's
definitions: as replay references (testbed/interop/reference.py) and as summary-only points
(`python -m testbed.interop import`). The fixtures are real reports from public repositories,
trimmed (tests/data/interop/*.provenance.yaml says where each comes from and what was cut)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from testbed.interop import InteropError, import_run
from testbed.interop.__main__ import main
from testbed.interop.exchange import detect_format
from testbed.interop.guidellm import read_guidellm
from testbed.interop.inference_perf import read_inference_perf
from testbed.interop.reference import read_reference
from testbed.metrics.config import SLOConfig
from tests.paths import TEST_DATA

DATA = TEST_DATA / "interop"
GUIDELLM_05 = DATA / "guidellm_050_poisson5_trimmed.json"  # a real GPU run (2 x T4, llm-d P/D)
GUIDELLM_02 = DATA / "guidellm_020_synchronous_trimmed.json"  # GuideLLM's own test asset (0.2 layout)
INFERENCE_PERF = DATA / "inference_perf_llmd_pd_gptoss120b_summary.json"  # llm-d's P/D guide's summary


@pytest.mark.parametrize("path", [GUIDELLM_05, GUIDELLM_02, INFERENCE_PERF])
def test_each_fixture_has_its_provenance(path):
    provenance = yaml.safe_load(path.with_suffix(".provenance.yaml").read_text())
    assert {"repository", "commit", "path"} <= set(provenance["source"]) and provenance["unknown"]


def test_guidellm_itl_is_the_testbeds_tpot_and_its_tpot_is_not():
    """GuideLLM 0.5: ITL = (last - first) / (n - 1), the testbed's TPOT; its TPOT = latency / n
    (TTFT included). On the real report both hold against its own means: with n = 128 output
    tokens, (E2E - TTFT) / 127 is the ITL mean and E2E / 128 the TPOT mean."""
    run = read_guidellm(GUIDELLM_05)
    data = json.loads(GUIDELLM_05.read_text())["benchmarks"][0]["metrics"]
    e2e, ttft = run.figures["e2e"]["mean"], run.figures["ttft"]["mean"]
    assert run.figures["tpot"]["mean"] == pytest.approx(data["inter_token_latency_ms"]["successful"]["mean"] / 1000)
    assert (e2e - ttft) / 127 == pytest.approx(run.figures["tpot"]["mean"], rel=1e-3)
    assert e2e / 128 == pytest.approx(data["time_per_output_token_ms"]["successful"]["mean"] / 1000, rel=1e-3)
    assert run.figures["ttft"]["p99"] == pytest.approx(0.3599669933319092)
    assert run.figures["itl"]["mean"] is None  # no per-gap ITL in the report
    assert "weighted" in run.definitions["tpot"]  # 0.5 counts tokens: 42,799 = 337 x 127
    # the run's offered load and throughput: Poisson 5 req/s; 337 served, 3 cut off at the end (not failures)
    assert run.rate == 5.0 and run.arrival == "poisson" and run.max_concurrency is None
    assert run.counts == {"ok": 337, "failed": 0, "total": 337, "failed_known": True} and run.num_requests == 340
    assert run.throughput["requests_per_s"] == pytest.approx(5.6)
    assert run.throughput["output_tokens_per_s"] == pytest.approx(5.6 * 128)
    assert run.throughput["duration_s"] == pytest.approx(60.0)


def test_guidellm_02_layout_reads_the_same_figures():
    """The 0.2 layout (args.strategy, request_totals on the benchmark, no p50 key): synchronous is a
    closed loop of one request; its ITL (per request) is still (last - first) / (n - 1)."""
    run = read_guidellm(GUIDELLM_02)
    assert math.isinf(run.rate) and run.max_concurrency == 1 and run.arrival is None
    assert run.counts["ok"] == 46 and run.num_requests == 47
    assert run.figures["ttft"]["p50"] == pytest.approx(0.01638054847717285)  # the median stands in for p50
    assert run.figures["tpot"]["mean"] == pytest.approx(0.004941609043733832)
    assert "one value per request" in run.definitions["tpot"]
    assert any("closed loop" in note for note in run.notes)
    with pytest.raises(InteropError, match="out of range"):
        read_guidellm(GUIDELLM_02, run=3)


def test_inference_perf_tpot_is_per_token_and_ntpot_is_not_read():
    """inference-perf: TPOT = (latency - TTFT) / (n - 1), the testbed's; NTPOT = latency / n is not
    read; ITL is kept but never compared. The report's schedule delay (77.6 s mean: the client was
    concurrency-bound) is said, and no rate is invented for a file without `requested_rate`."""
    run = read_inference_perf(INFERENCE_PERF)
    data = json.loads(INFERENCE_PERF.read_text())["successes"]
    assert run.figures["tpot"]["p50"] == pytest.approx(data["latency"]["time_per_output_token"]["median"])
    assert run.figures["tpot"]["mean"] != pytest.approx(data["latency"]["normalized_time_per_output_token"]["mean"])
    assert run.figures["e2e"]["p99"] == pytest.approx(23.146584392286606)
    assert run.figures["ttft"]["mean"] == pytest.approx(1.0639281511114733)
    assert run.throughput["output_tokens_per_s"] == pytest.approx(12925.396206067344)
    assert math.isnan(run.rate) and run.num_requests == 10500
    assert run.counts == {"ok": 10500, "failed": 0, "total": 10500, "failed_known": True}
    assert any("77.6 s" in note for note in run.notes)
    assert "not comparable" in run.definitions["itl"] and "not read" in run.definitions["ntpot"]


def test_the_replay_reads_both_as_references():
    guide = read_reference(GUIDELLM_05)
    assert guide.format == "guidellm" and not guide.detailed and guide.arrival == "poisson"
    assert guide.figures["tpot"]["p50"] == pytest.approx(0.028322585924403874)
    assert set(guide.figures["e2e"]) == {"mean", "p50", "p90", "p99"}
    perf = read_reference(INFERENCE_PERF)
    assert perf.format == "inference_perf" and perf.figures["ttft"]["p90"] == pytest.approx(2.8348029804299584)
    assert perf.notes and perf.settings["mean_output_len"] == pytest.approx(976.13)


def test_the_formats_are_told_apart_and_a_prometheus_summary_is_refused(tmp_path):
    assert detect_format(GUIDELLM_05) == "guidellm" and detect_format(INFERENCE_PERF) == "inference_perf"
    server = tmp_path / "summary_prometheus_metrics.json"
    server.write_text(
        json.dumps(
            {"successes": {"count": 3, "time_to_first_token": {"mean": 0.1}}, "load_summary": {}, "failures": {}}
        )
    )
    with pytest.raises(InteropError, match="Prometheus"):
        read_inference_perf(server)


def test_import_from_the_command_line_writes_a_summary_only_point(tmp_path, capsys):
    assert main(["import", "guidellm", str(GUIDELLM_05), str(tmp_path / "g")]) == 0
    assert "summary-only point" in capsys.readouterr().out
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert summary["summary_only"] and summary["tpot"]["p50"] == pytest.approx(0.028322585924403874)
    assert summary["offered_rate"] == 5.0 and summary["slo_attainment"] is None
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    assert meta["format"] == "guidellm" and "tpot" in meta["definitions"]
    done = import_run(INFERENCE_PERF, tmp_path / "p", slo=SLOConfig())
    assert done["summary"]["e2e"]["mean"] == pytest.approx(16.949693734689514) and done["requests"].empty
    assert main(["import", "inference-perf", str(GUIDELLM_05), str(tmp_path / "x")]) == 2  # named wrongly
