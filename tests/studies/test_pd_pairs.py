"""The 2026 P/D pairs (tests/data/replay/pd_pairs_2026.yaml): the third parties' files parse, every
setup is valid, and the errors docs/validation.md states are what the stored real and simulated
figures give (the simulated ones: simulated.csv, from the command in the docs)."""

from __future__ import annotations

import csv
import re

import pandas as pd
import pytest
import yaml

from testbed.interop.reference import read_reference
from testbed.studies.replay import instances, load_setup
from testbed.studies.validation_set import PROFILE, load_manifest, load_pairs, pair_figures, reference_file
from tests.paths import ROOT, TEST_DATA

REPLAY = TEST_DATA / "replay"
MANIFEST = REPLAY / "pd_pairs_2026.yaml"
DOCS = ROOT / "docs" / "validation.md"
SIMULATED = REPLAY / "pd2026_ankdeshm_gke" / "simulated.csv"
NAMES = {
    "TTFT mean ms": "ttft_mean",
    "TPOT mean ms": "tpot_mean",
    "TPOT p99 ms": "tpot_p99",
    "E2E mean ms": "e2e_mean",
    "requests/s": "throughput_requests_per_s",
}


def section() -> str:
    text = DOCS.read_text()
    start = text.index("### 2026 P/D pairs")
    return text[start : text.index("\n## ", start)]


def simulated() -> dict:
    with SIMULATED.open() as f:
        return {(r["case"], r["figure"]): (float(r["real"]), float(r["sim"])) for r in csv.DictReader(f)}


def test_every_case_parses_and_is_held_out_at_its_profile():
    base, cases = load_manifest(MANIFEST)
    assert len(cases) == 12
    for case in cases:
        assert case["role"] == "held_out" and case["calibrated_by"] == PROFILE
        ref = read_reference(reference_file(base, case))
        setup = load_setup(base / case["setup"])
        assert setup["_profile"] == "vllm_v1"
        devices = instances(setup)["hardware.num_devices"]
        assert devices == 8, f"{case['name']}: both arms of a pair run on the same 8 GPUs"
        assert ref.figures["ttft"]["mean"] is not None and ref.throughput["requests_per_s"] is not None
    pairs = load_pairs(MANIFEST)
    assert len(pairs) == 6 and all("vllm" in p["colocated"] and "dynamo" in p["disagg"] for p in pairs)
    assert "throughput_requests_per_s" in pair_figures(MANIFEST)


def test_disagg_setups_split_the_phases_as_the_manifests_did():
    b200 = instances(load_setup(REPLAY / "pd2026_ankdeshm_gke" / "b200_in8000_dynamo_4p_tp1_1d_tp4.setup.yaml"))
    assert (b200["cluster.num_prefill"], b200["cluster.prefill_tp"]) == (4, 1)
    assert (b200["cluster.num_decode"], b200["cluster.decode_tp"]) == (1, 4)
    plain = instances(load_setup(REPLAY / "pd2026_ankdeshm_gke" / "b200_in8000_vllm_2x_tp4.setup.yaml"))
    assert (plain["cluster.num_workers"], plain["cluster.tp"]) == (2, 4)


def test_provenance_names_repository_commit_and_path():
    for folder in ("pd2026_ankdeshm_gke", "pd2026_bhajian_nemotron"):
        prov = yaml.safe_load((REPLAY / folder / "PROVENANCE.yaml").read_text())
        assert prov["source"]["repository"].count("/") == 1 and prov["unknown"]
        for entry in prov["source"]["files"]:
            assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]) and entry["path"]


def test_simulated_file_holds_the_references_real_figures():
    base, cases = load_manifest(MANIFEST)
    stored = simulated()
    for case in cases:
        ref = read_reference(reference_file(base, case))
        short = case["name"].split("/")[1]
        for (name, figure), (real, _) in stored.items():
            if name != short:
                continue
            if figure.startswith("throughput"):
                expected = ref.throughput[figure.removeprefix("throughput_")]
            else:
                kind, stat = figure.split("_")
                expected = ref.figures[kind][stat]
            assert real == pytest.approx(expected, rel=1e-5), (name, figure)


def _pct(text: str) -> float:
    return float(text.strip().strip("()").rstrip("%"))


def test_docs_table_is_what_the_stored_figures_give():
    stored = simulated()
    rows = [line for line in section().splitlines() if line.startswith(("| B200", "| H200"))]
    assert len(rows) == 22
    labels = {}
    for pair in load_pairs(MANIFEST):
        a, b = pair["colocated"].split("/")[1], pair["disagg"].split("/")[1]
        gpu, work = a.split("_")[0].upper(), a.split("_")[1:3]
        if gpu == "B200":
            label = f"B200 {int(work[0][2:]) // 1000}k C{work[1][1:]}"
        else:
            label = {"in1000": "H200 1k/1k", "in8192": "H200 8k/200"}[work[0]]
        labels[label] = (a, b)
    signs = within = 0
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        a, b = labels[cells[0]]
        figure = NAMES[cells[1]]
        (ar, asim), (br, bsim) = stored[a, figure], stored[b, figure]
        assert _pct(cells[2].split()[-1]) == round(100 * (asim - ar) / ar), line
        assert _pct(cells[3].split()[-1]) == round(100 * (bsim - br) / br), line
        real, sim = br - ar, bsim - asim
        assert cells[5] == ("right" if (real > 0) == (sim > 0) else "wrong"), line
        error = (sim - real) / abs(real)
        assert _pct(cells[6]) == round(100 * error), line
        signs += (real > 0) == (sim > 0)
        within += (real > 0) == (sim > 0) and abs(error) <= 0.25
    assert f"right sign in {signs} of {len(rows)}" in section().replace("\n", " ")
    assert (signs, within) == (13, 0)


def test_nemotron_figures_in_the_docs_are_the_summary_csv_means():
    runs = pd.read_csv(REPLAY / "pd2026_bhajian_nemotron" / "summary.csv")
    assert len(runs) == 6 and (runs["successful_requests"] == runs["requests"]).all()
    mean = runs.groupby("technology").mean(numeric_only=True)
    disagg, agg = mean.loc["dynamo-disagg-k8s"], mean.loc["dynamo-agg-k8s"]
    text = " ".join(section().split())
    assert f"run time {disagg.duration_s:.2f} / {agg.duration_s:.2f} s" in text
    assert f"requests/s {disagg.request_throughput_rps:.3f} / {agg.request_throughput_rps:.3f}" in text
    assert f"median TTFT {disagg.ttft_ms_p50:,.0f} / {agg.ttft_ms_p50:,.0f} ms" in text
    assert f"median TPOT {disagg.tpot_ms_p50:.2f} / {agg.tpot_ms_p50:.2f} ms" in text
    assert f"TPOT p90 {disagg.tpot_ms_p90:.2f} / {agg.tpot_ms_p90:.2f} ms" in text
