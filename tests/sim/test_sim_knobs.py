"""The knobs a real engine's run is set up with, in the simulator (and emulation where the same
cost model paces it): each changes what it should, and the replay setup reaches it."""

import numpy as np
import pytest
import yaml

from testbed.cluster.emulation import Emulation, role_pacers
from testbed.errors import ConfigError
from testbed.interop.reference import read_reference
from testbed.model.config import PRESETS
from testbed.perf import cost_model
from testbed.perf.gpus import KERNEL_LAUNCH_S
from testbed.perf.roofline import KERNELS_PER_LAYER
from testbed.sim.executor import simulate
from testbed.studies.replay import load_setup, point_overrides
from tests.cluster_helpers import make_config, sim_args
from tests.studies.test_replay import REPLAY, SGLANG_RPS4

LLAMA3, LLAMA2 = PRESETS["llama3_8b"], PRESETS["llama2_7b"]
A100 = [
    "executor=sim",
    "sim.profile=a100_80g",
    "model=llama3_8b",
    "mode=colocated",
    "cluster.num_workers=1",
    "hardware=cpu",
    "hardware.num_devices=1",
    "scheduler.max_running=256",
    "scheduler.max_batched_tokens=4096",
    "workload.input_len.min=100",
    "workload.input_len.max=400",
    "workload.output_len.min=50",
    "workload.output_len.max=200",
]


def sim(*overrides, n: int = 60, rate: float = 4.0) -> dict:
    return simulate(*sim_args(make_config(*A100, f"workload.num_requests={n}", f"workload.rate={rate}", *overrides)))


def roofline(args=LLAMA3, **host):
    return cost_model("a100_80g", args, 2, **host)[0]


# (1) max_num_seqs ------------------------------------------------------------------------------
def test_running_cap_bounds_every_step():
    """scheduler.max_running is vLLM's max_num_seqs: no step of the simulated engine runs more."""
    capped = sim("scheduler.max_running=4", n=40, rate=1000.0)
    steps = capped["steps"]
    assert steps.num_running.max() == 4 and (steps.decode_seqs <= 4).all()
    assert sim(n=40, rate=1000.0)["steps"].num_running.max() > 4  # without the cap all 40 run together
    assert capped["summary"]["ttft"]["p50"] > sim(n=40, rate=1000.0)["summary"]["ttft"]["p50"]


# (2) constant-rate arrivals --------------------------------------------------------------------
def test_constant_rate_arrivals_are_evenly_spaced(tmp_path):
    gaps = np.diff(sim("workload.arrival=constant", n=30, rate=5.0)["requests"].sort_values("arrival_s").arrival_s)
    assert gaps == pytest.approx(np.full(len(gaps), 0.2))
    poisson = np.diff(sim(n=30, rate=5.0)["requests"].sort_values("arrival_s").arrival_s)
    assert poisson.std() > 0.05  # Poisson's are not
    setup = tmp_path / "setup.yaml"
    setup.write_text(yaml.safe_dump({"gpu": "a100_80g", "workload": {"arrival": "constant"}}))
    overrides, _ = point_overrides(read_reference(SGLANG_RPS4), load_setup(setup), None)
    assert overrides["workload.arrival"] == "constant" and overrides["workload.rate"] == 4


# (3) shared-prefix multi-turn traffic with prefix caching ------------------------------------
def test_shared_prefix_sessions_hit_the_simulated_prefix_cache(tmp_path):
    sessions = ["workload.turns=3", "workload.system_prompt_len=1024", "workload.think_time_s=0.5"]
    cached = sim(*sessions, "engine.enable_prefix_caching=true", n=20, rate=2.0)
    plain = sim(*sessions, n=20, rate=2.0)
    assert len(cached["requests"]) == len(plain["requests"]) == 60
    later = cached["requests"][cached["requests"].turn > 0]
    assert (later.prefix_hit_tokens >= 1024).all()  # the system prompt and the history are served
    assert (plain["requests"].prefix_hit_tokens == 0).all()
    assert cached["steps"].prefill_tokens.sum() < 0.6 * plain["steps"].prefill_tokens.sum()
    assert later.ttft.median() < plain["requests"][plain["requests"].turn > 0].ttft.median()
    setup = tmp_path / "setup.yaml"
    setup.write_text(
        yaml.safe_dump(
            {
                "gpu": "a100_80g",
                "prefix_caching": True,
                "workload": {"turns": 3, "system_prompt_len": 1024, "think_time_s": 0.5},
            }
        )
    )
    overrides, _ = point_overrides(read_reference(SGLANG_RPS4), load_setup(setup), None)
    assert overrides["workload.turns"] == 3 and overrides["workload.system_prompt_len"] == 1024
    assert overrides["engine.enable_prefix_caching"] is True


# (4) FP16 vs BF16 --------------------------------------------------------------------------------
def test_dtype_sets_the_bytes_and_the_peak_flops():
    """float16 and bfloat16: 2 bytes and the same tensor-core peak on these GPUs; float32: 4 bytes
    and the FP32 peak, so a compute-bound prefill is far slower than the bytes alone would make it."""
    bf16, fp16 = roofline(dtype="bfloat16"), roofline(dtype="float16")
    fp32 = cost_model("a100_80g", LLAMA3, 4, dtype="float32")[0]
    prefill = lambda m: m.step_time(4096, m.prefill_context([(4096, 0)]), 0, 0)  # noqa: E731
    assert prefill(bf16) == prefill(fp16)
    assert prefill(fp32) > 10 * prefill(bf16)  # 312 / 19.5 TFLOP/s; the bytes only double
    label = sim("model.dtype=float16", n=5)["summary"]["sim"]["profile"]
    assert label["dtype"] == "float16" and label["dtype_bytes"] == 2
    assert sim("model.dtype=float32", n=5)["summary"]["sim"]["profile"]["dtype"] == "float32"


# (5) MHA shapes -----------------------------------------------------------------------------------
def test_llama2_preset_is_multi_head_at_its_real_shape():
    assert LLAMA2.num_kv_heads == LLAMA2.num_heads == 32 and LLAMA2.vocab_size == 32000
    assert LLAMA2.kv_bytes_per_token == 4 * LLAMA3.kv_bytes_per_token  # every head a KV head
    l2, l3 = roofline(LLAMA2), roofline(LLAMA3)
    assert l2.decode_attention(32, 32 * 2048) == pytest.approx(4 * l3.decode_attention(32, 32 * 2048), rel=0.05)
    big = sim("model=llama2_7b", "model.max_model_len=4096", n=20)
    assert big["summary"]["tpot"]["p50"] > 0 and big["summary"]["sim"]["unfinished"] == 0


# (6) the per-step host overhead ----------------------------------------------------------------
def test_host_overhead_is_a_fixed_part_plus_a_part_per_sequence():
    base, host = roofline(), roofline(host_fixed_s=1e-3, host_per_seq_s=100e-6)
    for n in (1, 16, 64):
        extra = host.step_time(0, 0.0, n, n * 500) - base.step_time(0, 0.0, n, n * 500)
        assert extra == pytest.approx(1e-3 - base.gpu.step_overhead_s + n * 100e-6)
    assert host.breakdown(512, 256.0, 0, 0)["host_per_seq"] == pytest.approx(100e-6)  # the chunk ending a prompt
    # the host in sequence with the GPU, as the roofline above: no engine profile (vllm_v1's async
    # scheduling hides this host time under the GPU step; tests/sim/test_engine_profile.py)
    sync = "sim.engine_profile=null"
    fast, slow = sim(sync, n=40, rate=8.0), sim(sync, "engine.host_overhead_per_seq_s=1e-4", n=40, rate=8.0)
    assert slow["summary"]["tpot"]["p50"] > fast["summary"]["tpot"]["p50"] + 0.0005
    with pytest.raises(ConfigError, match="measured profile"):
        simulate(*sim_args(make_config("executor=sim", "hardware=cpu", "engine.host_overhead_s=0.001")))


def test_emulation_paces_with_the_same_host_terms():
    cfg = make_config(
        "model=tiny",
        "hardware=cpu",
        "hardware.emulate=a100_80g",
        "hardware.emulate_model=llama3_8b",
        "engine.host_overhead_s=0.004",
        "engine.host_overhead_per_seq_s=5e-5",
        "engine.cuda_graphs=false",
    )
    emulation = Emulation.from_hardware(cfg.hardware, cfg.engine)
    step, _ = role_pacers(emulation, "chunked", cfg.model, PRESETS["tiny"].kv_bytes_per_token * 4)
    terms = step.model.host_terms()
    assert terms["fixed_s"] == 0.004 and terms["per_seq_s"] == 5e-5 and not terms["cuda_graphs"]


# (7) CUDA graphs on and off -------------------------------------------------------------------
def test_eager_decode_pays_kernel_launches():
    graphs, eager = roofline(), roofline(cuda_graphs=False)
    launches = LLAMA3.num_layers * KERNELS_PER_LAYER * KERNEL_LAUNCH_S
    assert eager.step_time(0, 0.0, 8, 8000) - graphs.step_time(0, 0.0, 8, 8000) == pytest.approx(launches)
    assert eager.step_time(512, 256.0, 0, 0) == graphs.step_time(512, 256.0, 0, 0)  # prefill runs eagerly anyway
    assert sim("engine.cuda_graphs=false")["summary"]["tpot"]["p50"] > sim()["summary"]["tpot"]["p50"] + 0.8 * launches


# (8) multi-step scheduling -----------------------------------------------------------------------
def test_multi_step_windows_hold_new_requests_and_release_tokens_together():
    one, ten = sim(n=80), sim("sim.num_scheduler_steps=10", n=80)
    decode_step = one["steps"].query("prefill_tokens == 0").forward_s.median()
    waited = ten["summary"]["ttft"]["p50"] - one["summary"]["ttft"]["p50"]
    assert 2 * decode_step < waited < 10 * decode_step  # on average about half a window
    gaps = np.concatenate([np.diff(t) for t in ten["requests"].token_times if len(t) > 20])
    assert (gaps == 0).mean() > 0.7  # tokens leave a window together: 9 of every 10 gaps are 0
    assert (np.concatenate([np.diff(t) for t in one["requests"].token_times if len(t) > 20]) == 0).mean() < 0.05
    steps = ten["steps"].sort_values("start_s")
    runs = (steps.prefill_tokens > 0).cumsum()  # decode steps between two prefill steps
    lengths = steps[steps.prefill_tokens == 0].groupby(runs).size()
    assert (lengths.iloc[:-1] >= 10).mean() > 0.9  # a prefill waits for the window to end
    with pytest.raises(ConfigError, match="disagg"):
        simulate(
            *sim_args(
                make_config(
                    *A100,
                    "mode=disagg",
                    "cluster.num_prefill=1",
                    "cluster.num_decode=1",
                    "hardware.num_devices=2",
                    "sim.num_scheduler_steps=4",
                )
            )
        )


# (9) the front end per request ---------------------------------------------------------------
def test_frontend_latency_delays_every_request_before_the_scheduler():
    base, front = sim("sim.frontend_latency_s=0"), sim("sim.frontend_latency_s=0.012")  # set: replaces vllm_v1's
    for figure in ("ttft", "e2e"):
        assert front["summary"][figure]["p50"] == pytest.approx(base["summary"][figure]["p50"] + 0.012, abs=1e-6)
    assert front["summary"]["tpot"]["p50"] == pytest.approx(base["summary"]["tpot"]["p50"])


# P and D on two nodes, a quantized checkpoint -------------------------------------------------
def test_a_hand_off_between_nodes_crosses_the_network_at_its_rate():
    """hardware.num_nodes=2: the 1P1D hand-off takes the network's latency + bytes / GB/s, the
    simulator's NVLink time on one node."""
    disagg = ["mode=disagg", "hardware.num_devices=2", "workload.input_len.min=400", "workload.input_len.max=400"]
    one = sim(*disagg, n=10, rate=1.0)["transfers"]
    two = sim(*disagg, "hardware.num_nodes=2", "hardware.internode_gbps=2", "hardware.internode_latency_s=0.001")
    kv = two["transfers"]
    assert (kv.end_s - kv.start_s).to_numpy() == pytest.approx(0.001 + kv.kv_bytes.to_numpy() / 2e9, rel=1e-6)
    assert ((one.end_s - one.start_s) < 0.001).all()  # NVLink: 400 tokens' KV in well under a ms


def test_int4_weights_shorten_a_weight_bound_decode():
    base, int4 = sim(n=20), sim("sim.weight_bits=4", n=20)
    assert int4["summary"]["tpot"]["p50"] < 0.6 * base["summary"]["tpot"]["p50"]
    with pytest.raises(ConfigError, match="sim.weight_bits=3: allowed 4, 8, 16"):
        make_config(*A100, "sim.weight_bits=3")


def test_achievable_shares_replace_the_gpu_tables():
    """sim.hbm_share / matmul_mfu / attention_mfu: the GPU's roofline at those shares (a batch-1
    decode's weight read scales by 0.8 / 1.0, a 4,096-token prefill's GEMMs by 0.7 / 0.5, the A100's
    table values over the ones set), named in the profile's label; refused outside (0, 1] and on a
    measured profile, each in one line."""
    table = roofline()
    shared, label = cost_model("a100_80g", LLAMA3, 2, shares={"hbm_share": 1.0, "matmul_mfu": 0.5})
    decode, prefill = (0, 0.0, 1, 100), (4096, 2048.0, 0, 0)
    assert shared.breakdown(*decode)["gemm"] == pytest.approx(0.8 * table.breakdown(*decode)["gemm"], rel=1e-9)
    assert shared.breakdown(*prefill)["gemm"] == pytest.approx(0.7 / 0.5 * table.breakdown(*prefill)["gemm"])
    assert label["shares"] == {"hbm_share": 1.0, "matmul_mfu": 0.5}
    base, fast = sim(n=20), sim("sim.hbm_share=1.0", n=20)
    assert fast["summary"]["tpot"]["p50"] < 0.9 * base["summary"]["tpot"]["p50"]
    assert fast["summary"]["sim"]["profile"]["shares"] == {"hbm_share": 1.0}
    with pytest.raises(ConfigError, match=r"sim.hbm_share=1.5: allowed a share in \(0, 1\]"):
        make_config(*A100, "sim.hbm_share=1.5")
    with pytest.raises(ConfigError, match="sim.matmul_mfu set an analytical GPU's achievable shares"):
        simulate(*sim_args(make_config("executor=sim", "model=tiny", "sim.matmul_mfu=0.5", "workload.num_requests=2")))


# the replay setup reaches every knob ----------------------------------------------------------
def test_replay_setups_state_the_engines_knobs(tmp_path):
    ref = read_reference(SGLANG_RPS4)
    vllm, _ = point_overrides(ref, load_setup(REPLAY / "vllm060_a100.setup.yaml"), None)
    assert vllm["sim.num_scheduler_steps"] == 10 and vllm["engine.cuda_graphs"] is True
    assert vllm["scheduler.max_running"] == 256
    setup = tmp_path / "setup.yaml"
    setup.write_text(
        yaml.safe_dump(
            {
                "gpu": "a100_80g",
                "model": "llama2_7b",
                "dtype": "float16",
                "cuda_graphs": False,
                "host_overhead_s": 0.003,
                "host_overhead_per_seq_s": 2e-5,
                "frontend_latency_s": 0.01,
                "max_running": 32,
            }
        )
    )
    out, _ = point_overrides(ref, load_setup(setup), None)
    keys = (
        "model.name",
        "model.dtype",
        "engine.cuda_graphs",
        "engine.host_overhead_s",
        "engine.host_overhead_per_seq_s",
        "sim.frontend_latency_s",
        "scheduler.max_running",
    )
    assert {k: out[k] for k in keys} == {
        "model.name": "llama2_7b",
        "model.dtype": "float16",
        "engine.cuda_graphs": False,
        "engine.host_overhead_s": 0.003,
        "engine.host_overhead_per_seq_s": 2e-5,
        "sim.frontend_latency_s": 0.01,
        "scheduler.max_running": 32,
    }
    for bad in ({"num_scheduler_steps": 0}, {"frontend_latency_s": -1}, {"cuda_graphs": "yes"}):
        setup.write_text(yaml.safe_dump({"gpu": "a100_80g", **bad}))
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_setup(setup)
