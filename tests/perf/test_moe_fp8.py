"""Mixture-of-Experts and FP8 in the analytical cost model: the union-of-experts law against an
enumeration, each MoE preset's step against hand-worked arithmetic, FP8 weights at the FP8 peak and
FP8 KV at one byte, memory fit (Mixtral-8x7B on one H100: bf16 refused, FP8 fits), the settings'
one-line errors, and a MoE model through the simulator.

Hand-worked numbers: H100 SXM [H100-DS] HBM 3.35 TB/s x 0.8 achievable = 2.68e12 B/s; bf16 dense
989 TFLOP/s, FP8 dense 1,979 TFLOP/s, GEMMs at 0.75 of peak. Shapes from each checkpoint's
config.json (testbed/model/config.py)."""

from __future__ import annotations

import itertools

import pytest

from testbed.config import compose_config
from testbed.errors import ConfigError
from testbed.model.config import PRESETS, ModelConfig
from testbed.perf import GPUS, RooflineModel, weight_params
from testbed.perf.moe import expected_experts, routed_gemm
from testbed.sim.devices import resolve_roles
from testbed.sim.fit import unfit
from tests.cluster_helpers import sim_args

H100 = GPUS["h100_sxm"]
HBM = 3350e9 * 0.8  # achievable bytes/s
MIXTRAL, QWEN3, GPT_OSS = PRESETS["mixtral_8x7b"], PRESETS["qwen3_30b_a3b"], PRESETS["gpt_oss_120b"]


# -- the union-of-experts law -----------------------------------------------------------------
def enumerated_experts(num_experts: int, k: int, tokens: int) -> float:
    """Mean distinct experts over every way `tokens` tokens each pick k of num_experts, all alike."""
    subsets = list(itertools.combinations(range(num_experts), k))
    unions = [len(set().union(*picks)) for picks in itertools.product(subsets, repeat=tokens)]
    return sum(unions) / len(unions)


@pytest.mark.parametrize("experts, k, tokens", [(4, 2, 1), (4, 2, 2), (4, 2, 3), (6, 2, 2), (5, 3, 2)])
def test_expected_experts_is_the_enumerated_mean(experts, k, tokens):
    # e.g. 4 experts, top-2, 2 tokens: of the 36 pairs of picks 6 coincide (2 experts), 24 share one
    # (3), 6 are disjoint (4): (12 + 72 + 24) / 36 = 3 = 4 x (1 - (1 - 2/4)^2)
    assert expected_experts(experts, k, tokens) == pytest.approx(enumerated_experts(experts, k, tokens))


def test_a_decode_reads_top_k_experts_and_a_prefill_reads_them_all():
    assert expected_experts(8, 2, 1) == pytest.approx(2)  # Mixtral, one token: its 2 experts
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # Qwen3-30B-A3B
    assert expected_experts(8, 2, 2) == pytest.approx(3.5)  # 8 x (1 - 0.75^2)
    assert expected_experts(128, 8, 16) == pytest.approx(128 * (1 - 0.9375**16))  # 82.4 of 128
    assert expected_experts(8, 2, 4096) == pytest.approx(8) and expected_experts(128, 4, 8192) == pytest.approx(128)
    assert expected_experts(8, 2, 0) == 0


# -- hand-worked steps, H100, bf16, one device ---------------------------------------------------
# Per layer at one token (a one-sequence decode), bytes = weights + activations in and out:
# Mixtral (h 4096, q 4096, kv 1024, 2 of 8 experts of 14336):
#   qkv 4096x6144: 50,331,648 + 8,192 + 12,288 = 50,352,128;  o 4096x4096: 33,554,432 + 8,192 + 8,192
#   router 4096x8: 65,536 + 8,192 + 16;  gate/up, 2 experts x 4096x28672: 469,762,048 + 2x8,192 + 2x57,344
#   down, 2 experts x 14336x4096: 234,881,024 + 2x28,672 + 2x8,192          -> 788,844,560 a layer
# Qwen3-30B-A3B (h 2048, q 4096, kv 512, 8 of 128 experts of 768):
#   qkv 2048x5120: 20,985,856; o 4096x2048: 16,789,504; router 2048x128: 528,640
#   gate/up 8 x 2048x1536: 50,331,648 + 32,768 + 24,576; down 8 x 768x2048: 25,165,824 + 12,288 + 32,768
#                                                                                 -> 113,903,872 a layer
# gpt-oss-120b (h 2880, q 4096, kv 512, 4 of 128 experts of 2880):
#   qkv 2880x5120: 29,507,200; o 4096x2880: 23,606,912; router 2880x128: 743,296
#   gate/up 4 x 2880x5760: 132,710,400 + 23,040 + 46,080; down 4 x 2880x2880: 66,355,200 + 23,040 + 23,040
#                                                                                 -> 253,038,208 a layer
# Every GEMM is memory-bound at one token (Mixtral's qkv: 50.3 MFLOP / 742 TFLOP/s = 68 ns against
# 50.4 MB / 2.68 TB/s = 18.8 us), so a layer's GEMMs take its bytes / 2.68e12.
@pytest.mark.parametrize("args, layer_bytes", [(MIXTRAL, 788_844_560), (QWEN3, 113_903_872), (GPT_OSS, 253_038_208)])
def test_moe_presets_decode_gemms_are_hand_worked(args, layer_bytes):
    model = RooflineModel(H100, args)
    assert model.layer_gemms(1) == pytest.approx(layer_bytes / HBM, rel=1e-12)


def test_mixtral_whole_decode_step_is_hand_worked():
    """One sequence at 1,000 tokens of context; every term memory-bound:
    GEMMs 32 x 788,844,560; elementwise (10x4096 + 2x(4096+1024) + 3x2x14336 = 137,216 elements a
    layer, x32, + 3x4096) x 2 B = 8,806,400; decode attention 32 x (1000x2x1024x2 + 2x4096x2 + 2x1024x2)
    = 32 x 4,116,480; lm_head 4096x32000x2 + 8,192 + 32,000x4 = 262,280,192: 25,645,839,872 B
    / 2.68e12 = 9.569 ms, + the 2 ms step overhead."""
    model = RooflineModel(H100, MIXTRAL)
    expected = 2e-3 + 25_645_839_872 / HBM
    assert model.step_time(0, 0.0, 1, 1000) == pytest.approx(expected, rel=1e-9)
    assert model.step_time(0, 0.0, 1, 1000) == pytest.approx(11.569e-3, abs=1e-6)


def test_a_prefill_reads_every_expert_and_is_compute_bound():
    """Mixtral's routed gate/up over 4,096 tokens (8,192 rows): 2 x 8192 x 4096 x 28672 =
    1.924e12 FLOP / (989e12 x 0.75) = 2.594 ms, against 8 experts' 1.879 GB + 0.537 GB of
    activations / 2.68e12 = 0.901 ms: compute-bound, at all 8 experts."""
    model = RooflineModel(H100, MIXTRAL)
    assert routed_gemm(model, 4096, 4096, 28672, 2, "bfloat16") == pytest.approx(
        2 * 8192 * 4096 * 28672 / (989e12 * 0.75)
    )
    # a 64-sequence decode: 8 x (1 - 0.75^64) = 8 experts, nearly the prefill's weight bytes
    one, batch = (routed_gemm(model, t, 4096, 28672, 2, "bfloat16") for t in (1, 64))
    assert batch / one == pytest.approx((8 * 4096 * 28672 * 2 + 128 * (4096 + 28672) * 2) / 469_893_120, rel=1e-6)


# -- FP8 -----------------------------------------------------------------------------------------
def test_fp8_weights_run_at_the_fp8_peak():
    """The same gate/up with FP8 weights: 1.924e12 FLOP / (1979e12 x 0.75) = 1.296 ms (bytes
    0.940 + 0.537 GB / 2.68e12 = 0.551 ms): twice as fast as bf16's 2.594 ms."""
    fp8 = RooflineModel(H100, MIXTRAL, weight_dtype="fp8")
    assert fp8.gemm_dtype == "fp8" and fp8.layer_weight_bytes == 1
    assert routed_gemm(fp8, 4096, 4096, 28672, 1, "fp8") == pytest.approx(1_924_145_348_608 / (1979e12 * 0.75))
    # a GPU without FP8 tensor cores runs the FP8 checkpoint weight-only, at the 16-bit peak
    assert GPUS["a100_80g"].flops_for("fp8") == 312e12 and GPUS["b200"].flops_for("fp8") == 4500e12


def test_fp8_weights_halve_a_decode_and_fp8_kv_halves_its_cache_reads():
    """Llama-3-8B decode of one sequence at 4,096 tokens, one layer of attention: bf16 reads
    4096x2x1024x2 = 16,777,216 B of KV + 2x4096x2 + 2x1024x2 of its own; FP8 KV 8,388,608 + 16,384
    + 2,048."""
    args = PRESETS["llama3_8b"]
    bf16, kv8 = RooflineModel(H100, args), RooflineModel(H100, args, kv_dtype="fp8")
    assert bf16.decode_attention(1, 4096) == pytest.approx(16_797_696 / HBM)
    assert kv8.decode_attention(1, 4096) == pytest.approx(8_407_040 / HBM)
    assert kv8.rank_kv_bytes_per_token * 2 == bf16.rank_kv_bytes_per_token == 131_072
    w8 = RooflineModel(H100, args, weight_dtype="fp8")
    # q/k/v, o, gate/up, down at one token: weights 218,103,808 params a layer, at 1 byte not 2
    assert bf16.layer_gemms(1) - w8.layer_gemms(1) == pytest.approx(218_103_808 / HBM, rel=1e-9)


# -- memory fit ---------------------------------------------------------------------------------
def test_mixtral_on_one_h100_needs_fp8():
    """Mixtral-8x7B: 2 x 32000 x 4096 embeddings + 32 layers x (4096x6144 + 4096x4096 attention +
    8 x 3 x 4096 x 14336 experts + 4096x8 router + 2x4096 norms) + 4096 = 46,702,792,704 params:
    93.4 GB in bf16, over 0.9 x 81,559 MiB = 77.0 GB; FP8 layers (1 B) and 16-bit embeddings:
    46,440,648,704 + 2 x 262,144,000 = 46.96 GB, and one 32,768-token sequence's FP8 KV 2.1 GB fits."""
    assert weight_params(MIXTRAL) == 46_702_792_704
    why = unfit(MIXTRAL, 1, "h100_sxm", 2, 0.9)
    assert why and "93.4 GB of weights" in why and "\n" not in why
    assert unfit(MIXTRAL, 1, "h100_sxm", 2, 0.9, weight_dtype="fp8", kv_dtype="fp8") is None
    assert RooflineModel(H100, MIXTRAL, weight_dtype="fp8").weight_bytes == 46_964_936_704
    assert unfit(MIXTRAL, 2, "h100_sxm", 2, 0.9) is None  # TP2 splits every expert over two H100s


def test_moe_presets_have_their_published_sizes():
    # Mixtral 46.7B; Qwen3-30B-A3B 30.5B (its model card); gpt-oss-120b 116.8B (OpenAI's model card)
    sizes = {name: weight_params(PRESETS[name]) / 1e9 for name in ("mixtral_8x7b", "qwen3_30b_a3b", "gpt_oss_120b")}
    assert sizes == pytest.approx({"mixtral_8x7b": 46.7, "qwen3_30b_a3b": 30.5, "gpt_oss_120b": 116.8}, abs=0.1)
    assert (QWEN3.head_dim, GPT_OSS.head_dim) == (128, 64)  # set apart from hidden / heads


# -- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, words",
    [
        ("sim.kv_dtype=int3", ["sim.kv_dtype='int3'", "fp8_e4m3"]),
        ("sim.weight_dtype=fp4", ["sim.weight_dtype='fp4'", "fp8"]),
        ("model.experts_per_token=9", ["experts_per_token=9", "num_experts=8"]),
    ],
)
def test_bad_settings_are_one_line(override, words):
    with pytest.raises(ConfigError) as error:
        compose_config(["executor=sim", "sim.profile=h100_sxm", "model=mixtral_8x7b", override]).validate()
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words)


def test_weight_bits_and_weight_dtype_are_one_setting():
    with pytest.raises(ConfigError, match="set one"):
        compose_config(["executor=sim", "sim.weight_bits=4", "sim.weight_dtype=fp8"]).validate()


def test_what_a_moe_shape_asks_of_the_real_engine_is_checked():
    """The engine runs routed experts (tests/model/test_moe.py); shared experts it refuses in one
    line, and a MoE preset's weights count every expert against the workers' memory (Mixtral-8x7B:
    46.7B parameters, its model card's figure)."""
    from testbed.config import check_overrides, register_configs
    from testbed.model.loader import build_model

    register_configs()
    shared = ModelConfig(name="tiny", num_experts=4, experts_per_token=2, num_shared_experts=1).args()
    with pytest.raises(ConfigError, match="shared experts run in the simulator"):
        build_model(shared, "cpu", None)
    problem = check_overrides(["model=mixtral_8x7b", "hardware=cpu", "limits.max_memory_gb=100"])
    assert "workers 187 GB" in problem and "limits.max_memory_gb" in problem


def test_the_simulator_counts_kv_at_the_kv_dtype():
    base = ["executor=sim", "sim.profile=h100_sxm", "model=mixtral_8x7b", "sim.weight_dtype=fp8", "hardware=cpu"]
    bf16 = resolve_roles(*sim_args(compose_config(base)), {"mixed"})["mixed"]
    fp8 = resolve_roles(*sim_args(compose_config([*base, "sim.kv_dtype=fp8"])), {"mixed"})["mixed"]
    assert (bf16.dtype_bytes, fp8.dtype_bytes) == (2, 1) and fp8.label["kv_dtype"] == "fp8"
    assert fp8.cost.rank_kv_bytes_per_token * 2 == bf16.cost.rank_kv_bytes_per_token


# -- the planner ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "widths, degrees",
    [([], [2, 4]), (["sim.weight_dtype=fp8", "sim.kv_dtype=fp8"], [1])],
)
def test_the_planner_places_mixtral_on_h100s_only_where_it_fits(widths, degrees):
    """bf16: 93.4 GB a device at TP1 does not fit, 46.7 GB at TP2 does; FP8: 47.0 GB at TP1 does."""
    from testbed.sim.fit import split_unfit
    from testbed.studies import placements

    base = ["executor=sim", "sim.profile=h100_sxm", "model=mixtral_8x7b", "hardware=cpu", "hardware.num_devices=8"]
    cfg = compose_config([*base, *widths])
    assert placements.fitting_degrees(cfg, 8)[0] == degrees
    tp1 = compose_config([*base, *widths, "mode=disagg"])
    assert (split_unfit(tp1.serving, tp1.sim) is None) == (degrees == [1])
