"""FP8 and expert placement in emulation (hardware.emulate_weight_dtype, emulate_kv_dtype,
emulate_expert_parallel): the real workers paced to the very roofline the simulator runs at those
widths, the KV link and pool at one byte an element, the labels saying so, a run that keeps its
tokens, and the one-line refusals. A GPU's FP8 weights halve a memory-bound decode's weight reads
(Llama-3-8B: 15.0 GB of bf16 layer weights, 7.5 GB in FP8, over 2.68e12 B/s achievable HBM)."""

from __future__ import annotations

import pytest

from testbed.cluster.emulation import Emulation, device_pool_tokens, emulation_meta, role_pacers
from testbed.errors import ConfigError
from testbed.metrics.record import StepRecord
from testbed.model.config import PRESETS
from testbed.perf import GPUS, RooflineModel
from testbed.perf.resolve import analytical
from testbed.studies.real_cluster import serve
from tests.cluster_helpers import make_config, small_workload
from tests.paths import ROOT

LLAMA = PRESETS["llama3_8b"]
TINY_KV = PRESETS["tiny"].kv_bytes_per_token * 4  # float32 on CPU
FP8 = ("hardware.emulate_weight_dtype=fp8", "hardware.emulate_kv_dtype=fp8")
EMULATE = ("hardware.emulate=h100_sxm", "hardware.emulate_model=llama3_8b")


def decode(seqs: int, context: int) -> StepRecord:
    """A decode step's record as a worker writes it (only its shape matters to the pacer)."""
    zeros = dict.fromkeys(("batched_tokens", "kv_blocks_used", "num_waiting", "num_running"), 0)
    times = dict.fromkeys(("schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s"), 0.0)
    return StepRecord(0.0, 0.001, "decode_only", 0, seqs, **zeros, **times, decode_context=context)


def pacers(*overrides: str, role: str = "decode_only"):
    cfg = make_config(*EMULATE, *overrides)
    return role_pacers(Emulation.from_hardware(cfg.hardware, cfg.engine), role, cfg.model, TINY_KV), cfg


def test_fp8_paces_the_roofline_the_simulator_runs_at_fp8():
    (step, link), cfg = pacers(*FP8)
    host = dict((k, v) for k, v in cfg.engine.host_terms().items() if k != "dtype")
    expected, _ = analytical("h100_sxm", LLAMA, 2, dtype="bfloat16", weight_dtype="fp8", kv_dtype="fp8", **host)
    assert step.modelled_s(decode(8, 8 * 512)) == pytest.approx(expected.step_time(0, 0.0, 8, 8 * 512), rel=1e-12)
    assert link.bytes_scale == LLAMA.kv_bytes_per_token * 1 / TINY_KV  # one byte a KV element, not two


def test_fp8_weights_take_half_a_memory_bound_decodes_weight_reads():
    (bf16, _), _ = pacers()
    (fp8, _), _ = pacers("hardware.emulate_weight_dtype=fp8")
    layers = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)  # qkv, o, gate/up/down: 6.98e9 parameters
    saved = layers * 1 / (3.35e12 * 0.8)  # a byte a parameter fewer: 2.6 ms of a ~9 ms step
    one = decode(1, 1000)
    assert bf16.modelled_s(one) - fp8.modelled_s(one) == pytest.approx(saved, rel=0.01)


def test_fp8_kv_doubles_the_emulated_pool_and_fp8_weights_free_more_of_it():
    cfg = make_config(*EMULATE)
    tokens = {
        name: device_pool_tokens("h100_sxm", LLAMA, cfg.model, 0.9, None, precision=precision)
        for name, precision in {
            "bf16": (),
            "kv": (("kv_dtype", "fp8"),),
            "both": (("weight_dtype", "fp8"), ("kv_dtype", "fp8")),
        }.items()
    }
    gpu = GPUS["h100_sxm"]
    # kv_bytes_per_token counts elements (K and V of every layer); two bytes each in bf16
    by_hand = (gpu.memory_bytes * 0.9 - RooflineModel(gpu, LLAMA).weight_bytes) // (LLAMA.kv_bytes_per_token * 2)
    assert tokens["bf16"] == pytest.approx(by_hand, abs=1)
    assert tokens["kv"] == pytest.approx(2 * tokens["bf16"], abs=2)
    assert tokens["both"] > tokens["kv"]


def test_the_labels_say_the_emulated_widths_and_placement():
    cfg = make_config(*EMULATE, *FP8)
    meta = emulation_meta(Emulation.from_hardware(cfg.hardware), cfg.model, disagg=True)
    assert meta["prefill"]["weight_dtype"] == meta["decode"]["kv_dtype"] == "fp8"
    moe = make_config("hardware.emulate=h100_sxm", "hardware.emulate_model=mixtral_8x7b", *FP8)
    (step, _) = role_pacers(Emulation.from_hardware(moe.hardware), "decode_only", moe.model, TINY_KV, tp=2)
    assert not step.model.expert_parallel
    ep = make_config(
        "hardware.emulate=h100_sxm", "hardware.emulate_model=mixtral_8x7b", "hardware.emulate_expert_parallel=true"
    )
    emulation = Emulation.from_hardware(ep.hardware)
    (step, _) = role_pacers(emulation, "decode_only", ep.model, TINY_KV, tp=2)
    assert step.model.expert_parallel


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["hardware.emulate_weight_dtype=int4", *EMULATE], "hardware.emulate_weight_dtype='int4' is not a known dtype"),
        (["hardware.emulate_kv_dtype=fp4", *EMULATE], "hardware.emulate_kv_dtype='fp4' is not a known dtype"),
    ],
)
def test_bad_widths_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words) as refused:
        make_config(*overrides)
    assert "\n" not in str(refused.value)


def test_a_measured_profile_or_a_dense_shape_refuses_what_it_cannot_take():
    profile = ROOT / "testbed" / "sim" / "profiles" / "tiny_cpu.json"
    cfg = make_config(f"hardware.emulate={profile}", "hardware.emulate_kv_dtype=fp8")
    with pytest.raises(ConfigError, match="sets an analytical GPU's terms") as refused:
        Emulation.from_hardware(cfg.hardware)
    assert "\n" not in str(refused.value)
    dense = make_config(*EMULATE, "hardware.emulate_expert_parallel=true")
    with pytest.raises(ConfigError, match="the modelled shape has no experts"):
        role_pacers(Emulation.from_hardware(dense.hardware), "decode_only", dense.model, TINY_KV)


def test_an_fp8_emulated_disagg_run_keeps_its_tokens_and_says_its_widths(tmp_path):
    cfg = make_config(*small_workload(4, rate=20.0), "mode=disagg", *EMULATE, *FP8)
    result = serve(cfg, tmp_path / "run", progress=False)
    requests = result["requests"]
    assert (requests.status == "ok").all(), requests.reason.unique()
    emulated = result["summary"]["emulated"]
    assert emulated["prefill"]["kv_dtype"] == "fp8" and emulated["decode"]["weight_dtype"] == "fp8"


def test_sim_validate_simulates_the_emulated_widths():
    from testbed.studies.sim_validate import emulated_sim

    cfg = make_config(*EMULATE, *FP8)
    assert emulated_sim(cfg) == {
        "sim.profile": "h100_sxm",
        "model.name": "llama3_8b",
        "sim.weight_dtype": "fp8",
        "sim.kv_dtype": "fp8",
    }
    assert "sim.kv_dtype" not in emulated_sim(make_config(*EMULATE))
