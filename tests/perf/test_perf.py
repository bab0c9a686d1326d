"""Analytical GPU profiles: the roofline's physics, the resolver, and simulations on named GPUs."""

import json

import pandas as pd
import pytest

from testbed.errors import ConfigError
from testbed.model.config import PRESETS
from testbed.perf import GPUS, CostModel, RooflineModel, cost_model, weight_params
from testbed.perf.check import DECODE, PREFILL, RIDGE, decode_rows, prefill_rows
from testbed.perf.resolve import analytical
from testbed.sim.executor import simulate
from testbed.sim.load_split import analytical_split
from testbed.sim.simulator import Simulation
from testbed.studies.executors import simulate_point
from tests.cluster_helpers import make_config, sim_args, small_workload
from tests.paths import ROOT

LLAMA = PRESETS["llama3_8b"]
QWEN7B = PRESETS["qwen2_5_7b"]
SHIPPED = ROOT / "testbed/sim/profiles/tiny_cpu.json"


def model(name: str = "h100_sxm") -> RooflineModel:
    return cost_model(name, LLAMA, 2)[0]


def prefill_s(m: RooflineModel, tokens: int) -> float:
    return m.step_time(tokens, m.prefill_context([(tokens, 0)]), 0, 0)


def decode_s(m: RooflineModel, batch: int, context: int) -> float:
    return m.step_time(0, 0.0, batch, batch * context)


# -- the GPU table and the resolver ---------------------------------------------------------------
def test_gpu_table_has_the_named_gpus():
    assert {"a10", "a100_80g", "h100_sxm", "h200"} <= set(GPUS)
    for name, gpu in GPUS.items():
        gpu.validate()
        assert gpu.peak_flops > 1e14 and 0 < gpu.step_overhead_s < 0.01
        if name not in ("a10", "l40s", "rtx_pro_6000"):  # the datacenter GPUs with HBM and NVLink
            assert gpu.hbm_bytes_per_s > 1e12 and gpu.nvlink_bytes_per_s > 1e11 and gpu.memory_bytes > 40e9
    a10 = GPUS["a10"]  # GDDR6 and PCIe: [A10-DS]
    assert (a10.peak_flops, a10.hbm_bytes_per_s, a10.nvlink_bytes_per_s) == (125e12, 600e9, 32e9)
    assert GPUS["h200"].peak_flops == GPUS["h100_sxm"].peak_flops
    assert GPUS["h200"].hbm_bytes_per_s > GPUS["h100_sxm"].hbm_bytes_per_s


def test_a_quantized_checkpoint_reads_its_layer_weights_at_their_width():
    """GPTQ int4: a memory-bound decode reads a quarter of the 16-bit layer weights, the 16-bit
    embedding and lm_head whole; compute is unchanged (dequantized into 16-bit GEMMs)."""
    full, _ = cost_model("a10", QWEN7B, 2)
    int4, label = analytical("a10", QWEN7B, 2, weight_bits=4)
    vocab = QWEN7B.vocab_size * QWEN7B.hidden_size * (1 if QWEN7B.tie_embeddings else 2)
    layers = weight_params(QWEN7B) - vocab
    assert int4.weight_bytes == int(layers * 0.5 + vocab * 2) and full.weight_bytes == weight_params(QWEN7B) * 2
    assert label["weight_bits"] == 4
    assert int4.step_time(0, 0, 1, 512) < 0.5 * full.step_time(0, 0, 1, 512)  # weight-bound decode
    assert int4.layer_gemms(8192) == pytest.approx(full.layer_gemms(8192), rel=0.02)  # compute-bound prefill


def test_resolver_labels_analytical_and_measured():
    m, label = cost_model("h100_sxm", LLAMA, 2)
    assert isinstance(m, RooflineModel) and label["kind"] == "analytical" and label["name"] == "h100_sxm"
    measured, label = cost_model(str(SHIPPED), PRESETS["tiny"], 4)
    assert isinstance(measured, CostModel) and label == {**label, "kind": "measured", "name": str(SHIPPED)}
    with pytest.raises(ConfigError, match="does not match"):
        cost_model(str(SHIPPED), LLAMA, 2)  # a measured profile is of one model


def test_unknown_gpu_is_a_one_line_error_listing_the_names():
    with pytest.raises(ConfigError) as error:
        cost_model("h300", LLAMA, 2)
    message = str(error.value)
    assert "\n" not in message and all(name in message for name in GPUS)


def test_roofline_has_the_cost_model_interface():
    m = model()
    for name in ("step_time", "prefill_context", "transfer_time", "as_dict"):
        assert callable(getattr(m, name)) and callable(getattr(CostModel, name))
    assert m.causal_attention and m.as_dict()["kind"] == "analytical"
    assert m.prefill_context([(4, 0)]) == pytest.approx((1 + 2 + 3 + 4) / 4)
    gpu = GPUS["h100_sxm"]
    assert m.transfer_time(1 << 30) == pytest.approx(gpu.link_latency_s + (1 << 30) / (gpu.nvlink_bytes_per_s * 0.8))


# -- the physics ------------------------------------------------------------------------------------
def test_weights_of_an_8b_model():
    assert weight_params(LLAMA) == pytest.approx(8.03e9, rel=0.01)


def test_decode_grows_with_batch_and_context():
    m = model()
    assert decode_s(m, 1, 1024) < decode_s(m, 16, 1024) < decode_s(m, 64, 1024) < decode_s(m, 256, 1024)
    assert decode_s(m, 16, 512) < decode_s(m, 16, 2048) < decode_s(m, 16, 8192)


def test_decode_at_batch_1_is_memory_bound():
    m = model()
    step = decode_s(m, 1, 128)
    assert step - m.gpu.step_overhead_s == pytest.approx(m.weight_read_s(), rel=0.05)
    assert 0.007 <= step <= 0.009  # an 8B model on H100 with a Python engine's overhead


def test_prefill_of_2k_tokens_is_compute_bound():
    m = model()
    flops = 2 * weight_params(LLAMA) * 2048
    compute_floor = flops / (m.gpu.peak_flops * m.gpu.matmul_mfu)
    gpu_time = prefill_s(m, 2048) - m.gpu.step_overhead_s
    assert compute_floor <= gpu_time <= 1.25 * compute_floor
    assert compute_floor > 3 * m.weight_read_s()


def test_h200_decodes_faster_and_prefills_the_same():
    h100, h200 = model("h100_sxm"), model("h200")
    for batch in (1, 16, 64):
        assert decode_s(h200, batch, 1024) < 0.85 * decode_s(h100, batch, 1024)
    assert prefill_s(h200, 4096) == pytest.approx(prefill_s(h100, 4096), rel=0.05)


@pytest.mark.parametrize("chunk", [256, 2048])
def test_a_mixed_step_is_additive(chunk):
    m = model()
    context = m.prefill_context([(chunk, 0)])
    decode_only = m.step_time(0, 0.0, 32, 32 * 1024)
    prefill_only = m.step_time(chunk, context, 0, 0)
    mixed = m.step_time(chunk, context, 32, 32 * 1024)
    assert mixed >= max(decode_only, prefill_only)
    assert mixed <= decode_only + prefill_only - m.weight_read_s()  # the weights are read once


def test_the_check_stays_within_25_percent_of_every_published_figure():
    assert len(decode_rows()) == len(DECODE) and len(prefill_rows()) == len(PREFILL)
    for row in decode_rows():
        assert 0.75 <= float(row[6]) <= 1.25, row
    for row in prefill_rows():
        assert 0.75 <= float(row[5]) <= 1.25, row


def test_near_the_ridge_the_roofline_is_optimistic_but_bounded():
    for row in prefill_rows(RIDGE):  # neither bound is reached there: the max() of both runs fast
        assert 1.0 <= float(row[5]) <= 1.6, row


# -- simulations on analytical GPUs -----------------------------------------------------------------
def llama_config(*overrides):
    return make_config(*small_workload(30, 4.0), "model=llama3_8b", *overrides)


def test_simulated_h100_gives_gpu_plausible_latencies(tmp_path):
    cfg = llama_config("executor=sim", "sim.profile=h100_sxm", "mode=chunked", "cluster.num_workers=1")
    summary = simulate_point(cfg, tmp_path)["summary"]
    assert summary["num_requests"]["ok"] == 30
    assert 0.005 <= summary["tpot"]["p50"] <= 0.02  # an 8B decode on H100: milliseconds, not CPU seconds
    assert 0.005 <= summary["ttft"]["p50"] <= 0.2
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["sim"]["profiles"] == {"mixed": summary["sim"]["profile"]}
    assert written["sim"]["profile"]["kind"] == "analytical" and written["sim"]["profile"]["name"] == "h100_sxm"
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["profiles"]["mixed"]["kind"] == "analytical"


def test_heterogeneous_pools_name_both_devices_and_use_the_slower_link():
    cfg = llama_config("mode=disagg", "sim.prefill_profile=a100_80g", "sim.decode_profile=h200")
    result = simulate(cfg.serving, cfg.sim)
    profiles = result["summary"]["sim"]["profiles"]
    assert {role: p["name"] for role, p in profiles.items()} == {"prefill": "a100_80g", "decode": "h200"}
    assert all(p["kind"] == "analytical" for p in profiles.values())
    transfers = result["transfers"]
    assert len(transfers) > 0
    slower = cost_model("a100_80g", LLAMA, 2)[0]  # A100 NVLink: 300 GB/s against the H200's 450
    expected = transfers.kv_bytes.map(slower.transfer_time)
    assert (transfers.end_s - transfers.start_s).to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-6)


def test_decode_on_h200_beats_decode_on_h100():
    base = ["mode=disagg", "sim.prefill_profile=h100_sxm"]
    h100 = simulate(*sim_args(llama_config(*base, "sim.decode_profile=h100_sxm")))["summary"]
    h200 = simulate(*sim_args(llama_config(*base, "sim.decode_profile=h200")))["summary"]
    assert h200["tpot"]["p50"] < 0.85 * h100["tpot"]["p50"]


def test_an_analytical_pool_comes_from_the_gpu_memory():
    # no engine.num_kv_blocks; prefix caching keeps the whole pool (cached blocks outlive their requests)
    cfg = make_config(
        *small_workload(4, 4.0)[:-1],
        "model=llama3_8b",
        "mode=disagg",
        "engine.enable_prefix_caching=true",
        "sim.prefill_profile=h100_sxm",
        "sim.decode_profile=h200",
    )
    sim = Simulation(cfg.serving, cfg.sim)
    block_bytes = LLAMA.kv_bytes_per_token * 2 * cfg.engine.block_size
    for worker, gpu in zip(sim.workers, ("h100_sxm", "h200")):
        pool = GPUS[gpu].memory_bytes * cfg.engine.gpu_memory_utilization - weight_params(LLAMA) * 2
        assert worker.block_manager.num_blocks == int(pool // block_bytes)
    with pytest.raises(ConfigError, match="do not fit"):
        Simulation(
            *sim_args(
                make_config(
                    *small_workload(4, 4.0)[:-1],
                    "model=llama3_8b",
                    "sim.profile=a100_40g",
                    "engine.gpu_memory_utilization=0.3",
                )
            )
        )


def test_a_small_model_on_a_big_gpu_builds_only_the_blocks_it_can_use():
    cfg = make_config(*small_workload(20, 40.0)[:-1], "mode=disagg", "sim.profile=h100_sxm")  # tiny, no explicit pool
    sim = Simulation(cfg.serving, cfg.sim)
    per_sequence = -(-(cfg.model.args().max_model_len + 1) // cfg.engine.block_size)
    cap = (2 * cfg.scheduler.max_running + cfg.kv_transfer.max_pending) * per_sequence
    assert all(w.block_manager.num_blocks == cap for w in sim.workers)  # not the GPU's millions
    capped = simulate(cfg.serving, cfg.sim)
    peak = int(capped["steps"].kv_blocks_used.max())
    explicit = simulate(
        *sim_args(
            make_config(
                *small_workload(20, 40.0)[:-1],
                "mode=disagg",
                "sim.profile=h100_sxm",
                f"engine.num_kv_blocks={max(peak + 1, 17)}",
            )
        )
    )
    pool = ["kv_blocks_total", "kv_occupancy"]  # what describes the pool's size itself
    for table in ("requests", "steps", "transfers"):  # a pool that never fills: its size changes nothing else
        pd.testing.assert_frame_equal(
            capped[table].drop(columns=pool, errors="ignore"), explicit[table].drop(columns=pool, errors="ignore")
        )


def test_a_measured_cpu_profile_cannot_pair_with_a_gpu():
    with pytest.raises(ConfigError, match="different dtypes"):
        simulate(*sim_args(make_config(*small_workload(4, 4.0), "mode=disagg", "sim.decode_profile=h200")))


def test_a_bad_profile_name_is_refused_at_validation():
    with pytest.raises(ConfigError, match="neither a GPU"):
        make_config("sim.decode_profile=h300")


def test_a_gpu_name_loads_no_profile_file():
    cfg = llama_config("sim.profile=h200")
    assert cfg.sim.load(cfg.model.name) is None  # the load split then takes the GPU from cfg.sim
    assert analytical_split(cfg.serving, cfg.sim, cfg.sim.load(cfg.model.name), 8)["split"].endswith("D")


def test_the_load_split_takes_each_role_s_gpu():
    base = ["mode=disagg", "sim.prefill_profile=h100_sxm"]
    same = analytical_split(*sim_args(llama_config(*base, "sim.decode_profile=h100_sxm")), None, 8)
    faster_decode = analytical_split(*sim_args(llama_config(*base, "sim.decode_profile=h200")), None, 8)
    assert faster_decode["mean"]["decode_tokens_per_s"] > same["mean"]["decode_tokens_per_s"]
    assert faster_decode["mean"]["prefill_tokens_per_s"] == pytest.approx(same["mean"]["prefill_tokens_per_s"])
