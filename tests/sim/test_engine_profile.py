"""Engine profiles (testbed/sim/engine_profile.py), the async-scheduling overlap law
(testbed/perf/overlap.py) and the vLLM 0.15.1 validation set they are calibrated and held out on."""

from __future__ import annotations

import csv
import json
import re

import pytest
import yaml

from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError
from testbed.model.config import PRESETS
from testbed.perf.overlap import AsyncRoofline, overlapped
from testbed.perf.resolve import analytical
from testbed.sim.config import SimConfig
from testbed.sim.engine_profile import engine_profile, for_engine, frontend_s, host_terms, profiles
from testbed.sim.executor import simulate
from tests.cluster_helpers import make_config, sim_args
from tests.paths import ROOT

DATA = ROOT / "tests" / "data" / "replay" / "inference_sim"
HELD_OUT_MODELS = {"meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf"}
MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"  # a mixture of experts in the fit set (model=mixtral_8x7b)


def test_an_unknown_profile_is_one_line_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as error:
        SimConfig(engine_profile="vllm_v2").validate()
    message = str(error.value)
    assert "\n" not in message and "sim.engine_profile='vllm_v2'" in message
    assert all(name in message for name in ("vllm_v0", "vllm_v1", "sglang"))


def test_every_profile_states_its_calibration_set():
    for profile in profiles().values():
        assert {"runs", "source", "fitted"} <= set(profile.calibration), profile.name
        assert profile.calibration["runs"], profile.name


@pytest.mark.parametrize(
    "text, name",
    [("vllm 0.15.1", "vllm_v1"), ("vllm 0.6.0", "vllm_v0"), ("vllm 0.6.2", "vllm_v0"), ("sglang 0.3.0", "sglang")],
)
def test_a_replay_setups_engine_picks_its_profile(text, name):
    assert for_engine(text) == name


def test_an_engine_no_profile_covers_is_one_line():
    with pytest.raises(ConfigError, match="names no engine profile") as error:
        for_engine("vllm 0.10.0")
    assert "\n" not in str(error.value)


def test_set_engine_terms_replace_the_profiles_and_the_front_end_falls_back_to_it():
    v1 = engine_profile("vllm_v1")
    terms = host_terms(EngineConfig(), "vllm_v1")
    assert terms["host_fixed_s"] == v1.host_overhead_s and terms["async_scheduling"] is True
    assert host_terms(EngineConfig(host_overhead_s=0.007), "vllm_v1")["host_fixed_s"] == 0.007
    assert "async_scheduling" not in host_terms(EngineConfig(), None)
    assert frontend_s(None, "vllm_v0") == engine_profile("vllm_v0").frontend_latency_s
    assert frontend_s(0.004, "vllm_v0") == 0.004 and frontend_s(None, None) == 0.0
    assert frontend_s(0.0, "vllm_v0") == 0.0  # a set 0 (a replay's fitted front end) replaces it


def test_an_analytical_gpu_runs_the_current_vllm_unless_another_profile_is_named():
    assert SimConfig().engine_profile == "vllm_v1" and for_engine("vllm 0.15.1") == "vllm_v1"
    label = one_request("sim.profile=h100_sxm")["summary"]["sim"]["profiles"]["mixed"]
    assert label["engine_profile"] == "vllm_v1" and label["host"]["async_scheduling"] is True
    assert SimConfig().frontend_s(analytical=False) == 0.0  # a measured profile holds its own host side


def test_the_profile_alone_sets_host_terms_async_overlap_and_the_front_end():
    """One 512-token prompt on an idle H100: its TTFT is the front end + the prefill step.
    vllm_v1: 10.5 ms + max(host 0, gpu); vllm_v0: 12.5 ms + (3 ms host + gpu), in sequence. The GPU
    part is the same kernels, so v0 - v1 = (12.5 + 3) - 10.5 = 5 ms; without the profile's front
    end (sim.frontend_latency_s=0) v1 is 10.5 ms sooner."""
    ttft = {
        name: one_request("sim.profile=h100_sxm", *extra)["requests"].ttft.iloc[0]
        for name, extra in {
            "v1": (),
            "v1_no_front": ("sim.frontend_latency_s=0",),
            "v0": ("sim.engine_profile=vllm_v0",),
        }.items()
    }
    assert ttft["v0"] - ttft["v1"] == pytest.approx(0.005, abs=1e-9)
    assert ttft["v1"] - ttft["v1_no_front"] == pytest.approx(0.0105, abs=1e-9)


def test_a_measured_profile_ignores_the_engine_profile():
    """The shipped CPU profile's step times hold its own host side: no front end, no host terms."""
    default, none = (one_request(*extra)["requests"].ttft.iloc[0] for extra in ((), ("sim.engine_profile=null",)))
    assert default == pytest.approx(none, abs=1e-12)


def one_request(*overrides: str) -> dict:
    return simulate(
        *sim_args(
            make_config(
                "executor=sim",
                "model=tiny",
                "mode=colocated",
                "cluster.num_workers=1",
                "hardware=cpu",
                "hardware.num_devices=1",
                "workload.num_requests=1",
                "workload.input_len.min=512",
                "workload.input_len.max=512",
                "workload.output_len.min=4",
                "workload.output_len.max=4",
                *overrides,
            )
        )
    )


def test_async_scheduling_costs_the_longer_of_host_and_gpu():
    """Hand-worked: host 2 ms + 8 x 0.25 ms = 4 ms; GPU 5 + 1 + 0.5 = 6.5 ms. In sequence 10.5 ms,
    overlapped 6.5; with 40 sequences the host (12 ms) is the longer and is the step."""
    parts = {"overhead": 2e-3, "host_per_seq": 8 * 0.25e-3, "gemm": 5e-3, "decode_attention": 1e-3, "lm_head": 0.5e-3}
    assert sum(parts.values()) == pytest.approx(10.5e-3)
    assert overlapped(parts) == pytest.approx(6.5e-3)
    assert overlapped({**parts, "host_per_seq": 40 * 0.25e-3}) == pytest.approx(12e-3)


def test_the_async_roofline_is_the_sync_one_with_host_and_gpu_overlapped():
    args = PRESETS["llama2_7b"]
    sync, _ = analytical("h100_sxm", args, 2, host_fixed_s=3e-3, host_per_seq_s=0.1e-3)
    fast, label = analytical("h100_sxm", args, 2, host_fixed_s=3e-3, host_per_seq_s=0.1e-3, async_scheduling=True)
    assert isinstance(fast, AsyncRoofline) and label["host"]["async_scheduling"] is True
    for shape in ((0, 0, 16, 16 * 600), (512, 256.0, 8, 8 * 600), (0, 0, 128, 128 * 300)):
        parts = sync.breakdown(*shape)
        host = parts["overhead"] + parts["host_per_seq"]
        assert fast.step_time(*shape) == pytest.approx(max(host, sync.step_time(*shape) - host))
        assert fast.step_time(*shape) < sync.step_time(*shape)


# -- the vLLM 0.15.1 set: calibrated on CodeLlama-34B and Mixtral-8x7B, held out on Llama-2 ---------------


def stages() -> dict[str, dict]:
    with open(DATA / "vllm0151_h100_stages.csv") as f:
        return {row["case"]: row for row in csv.DictReader(f)}


def test_the_held_out_llama2_rows_are_never_in_the_fit_set():
    rows = stages()
    fitted = engine_profile("vllm_v1").calibration["runs"]
    manifest = yaml.safe_load((ROOT / "tests" / "data" / "replay" / "cases.yaml").read_text())["cases"]
    calibrating = [c["name"].split("/", 1)[1] for c in manifest if c["group"] == "vllm0151_h100"]
    assert sorted(fitted) == sorted(calibrating)
    assert all(rows[name]["model"] not in HELD_OUT_MODELS for name in fitted)
    assert {rows[name]["model"] for name in fitted} == {"codellama/CodeLlama-34b-Instruct-hf", MIXTRAL}
    held = [c for c in manifest if c["group"] == "vllm0151_h100_llama2"]
    assert held and all(c["role"] == "held_out" for c in held)
    assert {rows[c["name"].split("/", 1)[1]]["model"] for c in held} == HELD_OUT_MODELS


def test_every_stage_row_names_its_source_and_its_tpot_is_two_events_a_token():
    for name, row in stages().items():
        assert row["source_repository"] == "inference-sim/training" and len(row["source_commit"]) == 40
        assert row["source_path"].endswith("_lifecycle_metrics.json")
        tokens = (float(row["e2e_mean_s"]) - float(row["ttft_mean_s"])) / (2 * float(row["tpot_event_mean_s"])) + 1
        assert tokens == pytest.approx(float(row["output_len_target"]), rel=0.02), name
        if (DATA / f"{name}.json").is_file():
            reference = json.loads((DATA / f"{name}.json").read_text())
            assert reference["median_tpot_ms"] == pytest.approx(2000 * float(row["tpot_event_p50_s"]), abs=1e-3)


def stated_held_out_mape() -> dict[str, float]:
    """The held-out MAPE docs/validation.md states for the Llama-2 set (its 'held out' row)."""
    text = (ROOT / "docs" / "validation.md").read_text()
    line = next(li for li in text.splitlines() if li.startswith("| held out: Llama-2-7B TP1 and Llama-2-70B TP4"))
    values = [float(v) for v in re.findall(r"([\d.]+)%", line)]
    return dict(zip(("ttft_mean", "tpot_p50", "e2e_mean"), values))


def test_the_held_out_error_recomputed_from_the_stored_data_is_what_the_docs_state():
    """The simulated figures of each held-out stage (stored by the validation run) against the
    stage's real figures converted from the CSV: the MAPE the docs state, to 0.1 point."""
    sims = yaml.safe_load((DATA / "vllm_v1_held_out.yaml").read_text())["cases"]
    rows = stages()
    assert {rows[name]["model"] for name in sims} == HELD_OUT_MODELS
    real = {
        "ttft_mean": lambda r: float(r["ttft_mean_s"]),
        "tpot_p50": lambda r: 2 * float(r["tpot_event_p50_s"]),
        "e2e_mean": lambda r: float(r["e2e_mean_s"]),
    }
    stated = stated_held_out_mape()
    for figure, of in real.items():
        errors = [abs(sim[figure] - of(rows[name])) / of(rows[name]) for name, sim in sims.items()]
        assert 100 * sum(errors) / len(errors) == pytest.approx(stated[figure], abs=0.1), figure
