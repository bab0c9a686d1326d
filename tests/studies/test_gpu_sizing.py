"""Every study's GPU sizing (the top level of conf/experiment/NAME.yaml) as a GPU box composes it:
a 7-8B model whose bf16 weights and the KV of one max_model_len sequence fit an 80 GB GPU, with
every request of the workload within that context; the same study on a CPU box (its
size=cpu chosen) runs the tiny model. Simulated studies on a GPU box run on a
GPU's profile, never on the shipped CPU one. CUDA is pretended (catalog.cuda_count,
interference.cuda_count, machine.cuda_count)."""

from __future__ import annotations

import json

import pytest

from testbed.cluster import layout
from testbed.errors import ConfigError
from testbed.experiment import ONE_POINT
from testbed.perf import weight_params
from testbed.perf.resolve import table_gpu
from testbed.sim.config import SHIPPED
from testbed.sizing import compose_sized
from testbed.studies import catalog, interference, machine, plan, sim_validate
from testbed.studies.runner import run
from testbed.workload.lengths import scale_lengths
from testbed.workload.traces import read_trace, resolve_trace_path, select

NAMES = [s.name for s in catalog.STUDIES if s.name != ONE_POINT]
GPU_BYTES = 80e9
BF16 = 2
CPU_PROFILE = str(SHIPPED / "tiny_cpu.json")


def compose_study(monkeypatch, name: str, *extra: str, gpus: int):
    """The study as the command line composes it on a box with `gpus` CUDA devices (size=cpu on none)."""
    monkeypatch.setattr(catalog, "cuda_count", lambda hardware: gpus)
    monkeypatch.setattr(interference, "cuda_count", lambda hardware: gpus)
    monkeypatch.setattr(machine, "cuda_count", lambda hardware: gpus)
    monkeypatch.setattr(layout, "cuda_count", lambda hardware: gpus)
    return compose_sized([f"+experiment={name}", *extra])


def longest_request(cfg) -> int:
    """The most tokens one sequence of the study holds: its prompt and output, over all of a
    session's turns; the decode background's; a trace's longest request, length-scaled."""
    w = cfg.workload
    if w.path:
        records = select(read_trace(resolve_trace_path(w.path), w.format), w.start_s, w.window_s, w.num_requests)
        return int(
            (scale_lengths(records.input_len, w.length_scale) + scale_lengths(records.output_len, w.length_scale)).max()
        )
    prompt = max(cfg.experiment.own["prefill_lengths"]) if cfg.experiment.name == "interference" else w.input_len.max
    session = w.system_prompt_len + w.turns * (prompt + w.output_len.max)
    background = w.background_input_len + w.background_output_len if w.background_requests else 0
    return max(session, background)


def gpu_profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"}))
    return str(path)


@pytest.mark.parametrize("name", NAMES)
def test_a_gpu_box_runs_a_real_model_that_fits_one_gpu(monkeypatch, name):
    cfg = compose_study(monkeypatch, name, gpus=8)
    args = cfg.model.args()
    assert cfg.model.name in ("llama3_8b", "qwen2_5_7b") and weight_params(args) > 7e9, cfg.model
    weights, kv = weight_params(args) * BF16, args.kv_bytes_per_token * BF16 * args.max_model_len
    assert weights + kv <= GPU_BYTES, (name, weights / 1e9, kv / 1e9)
    assert longest_request(cfg) <= args.max_model_len, (name, longest_request(cfg), args.max_model_len)


@pytest.mark.parametrize("name", NAMES)
def test_a_cpu_box_runs_the_tiny_model(monkeypatch, name):
    cfg = compose_study(monkeypatch, name, gpus=0)
    assert cfg.model.name == "tiny", cfg.model


def test_plan_on_a_gpu_box_without_a_gpu_profile_stops_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "gpu_here", lambda: "h100_sxm")
    cfg = compose_study(monkeypatch, "plan", gpus=8)
    with pytest.raises(ConfigError) as unset:
        run(cfg, tmp_path)
    message = str(unset.value)
    assert "\n" not in message and message.startswith("sim.profile is unset"), message
    assert "`python -m testbed +experiment=profile model=llama3_8b model.max_model_len=32768`" in message
    assert message.endswith("sim.profile=h100_sxm"), message
    assert not (tmp_path / "points").exists()  # stopped before any point
    with pytest.raises(ConfigError, match="was measured on a CPU"):
        catalog.check_executor(compose_study(monkeypatch, "plan", f"sim.profile={CPU_PROFILE}", gpus=8))


@pytest.mark.parametrize("spec", ["h100_sxm", "measured"])
def test_a_gpu_box_plans_on_a_gpu_profile(monkeypatch, tmp_path, spec):
    spec = gpu_profile(tmp_path) if spec == "measured" else spec
    cfg = compose_study(monkeypatch, "plan", f"sim.profile={spec}", gpus=8)
    catalog.check_executor(cfg)
    assert cfg.model.name == "llama3_8b" and {p.overrides["executor"] for p in plan.points(cfg)} == {"sim"}


def test_other_simulated_studies_on_a_gpu_box_need_a_gpu_profile(monkeypatch):
    cfg = compose_study(monkeypatch, "rate_sweep", "executor=sim", gpus=2)
    with pytest.raises(ConfigError, match=r"sim.profile is unset.*experiment=rate_sweep"):
        catalog.check_executor(cfg)
    with pytest.raises(ConfigError, match=r"sim.decode_profile=.*tiny_cpu.json was measured on a CPU"):
        catalog.check_executor(
            compose_study(
                monkeypatch,
                "rate_sweep",
                "executor=sim",
                "sim.profile=h100_sxm",
                f"sim.decode_profile={CPU_PROFILE}",
                gpus=2,
            )
        )


def test_sim_validate_on_a_gpu_box_fits_its_profile_on_this_gpus_runs(monkeypatch):
    cfg = compose_study(monkeypatch, "sim_validate", gpus=2)
    catalog.check_executor(cfg)
    sims = [p for p in sim_validate.points(cfg) if p.overrides["executor"] == "sim"]
    assert sims and all(p.overrides["sim.profile"].startswith("run:") for p in sims)
    with pytest.raises(ConfigError, match="was measured on a CPU"):
        catalog.check_executor(compose_study(monkeypatch, "sim_validate", f"sim.profile={CPU_PROFILE}", gpus=2))


def test_profile_on_a_gpu_box_measures_the_gpu_sizing_on_cuda(monkeypatch, tmp_path):
    from testbed.measure import step_profile
    from testbed.studies import profile as profile_study

    measured = {}

    def fake_engine(model, engine, device, quick=False):
        measured.update(model=model, device=device)
        return {"fit": {"step_relative_error": {"mean": 0.0, "max": 0.0}}, "samples": {"step": []}}

    monkeypatch.setattr(step_profile, "profile_engine", fake_engine)  # imported where the study runs
    monkeypatch.setattr(profile_study, "cuda_count", lambda hardware: 1)
    result = run(compose_study(monkeypatch, "profile", gpus=1), tmp_path)
    assert measured["device"] == "cuda:0" and result["path"] == tmp_path / "profile.json"
    assert (measured["model"].name, measured["model"].max_model_len) == ("llama3_8b", 32768)


def test_a_cpu_box_simulating_a_gpu_plans_at_the_gpu_sizing(monkeypatch, tmp_path):
    for spec in ("h100_sxm", gpu_profile(tmp_path)):  # plan's points are all simulated: executor=sim is implied
        cfg = compose_study(monkeypatch, "plan", f"sim.profile={spec}", gpus=0)
        assert cfg.model.name == "llama3_8b" and cfg.workload.length_scale == 0.25, spec
    assert compose_study(monkeypatch, "plan", f"sim.profile={CPU_PROFILE}", gpus=0).model.name == "tiny"


def test_cuda_device_names_map_to_the_analytical_table():
    assert table_gpu("NVIDIA H100 80GB HBM3") == "h100_sxm"
    assert table_gpu("NVIDIA H200") == "h200"
    assert table_gpu("NVIDIA A100-SXM4-80GB") == "a100_80g"
    assert table_gpu("NVIDIA H100 PCIe") is None
