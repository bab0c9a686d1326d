"""Expert parallelism in the analytical cost model (sim.expert_parallel): whole experts E/tp a rank,
the busiest rank's rows against a simulation of the router no one here fitted, a Mixtral step on
two H100s worked by hand, a prefill where the imbalance evens out, and the one-line refusals.

Hand-worked numbers: H100 SXM HBM 3.35 TB/s x 0.8 achievable = 2.68e12 B/s; bf16 dense 989 TFLOP/s,
GEMMs at 0.75 of peak (tests/perf/test_moe_fp8.py)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from testbed.config import compose_config
from testbed.errors import ConfigError
from testbed.model.config import PRESETS
from testbed.perf import GPUS, RooflineModel
from testbed.perf.moe import busiest_rows, routed_gemm
from testbed.sim.devices import resolve_roles
from tests.cluster_helpers import sim_args

H100 = GPUS["h100_sxm"]
HBM = 3350e9 * 0.8
MIXTRAL, QWEN3 = PRESETS["mixtral_8x7b"], PRESETS["qwen3_30b_a3b"]


def simulated_busiest(experts: int, k: int, tokens: int, ranks: int, trials: int = 4000) -> float:
    """Mean over `trials` of the most rows any rank runs: each token picks k distinct experts of
    `experts` uniformly, rank r holds experts [r E/ranks, (r+1) E/ranks) (vLLM's contiguous placement)."""
    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((trials, tokens, experts)), axis=2)[:, :, :k]  # k distinct a token
    rank = picks // (experts // ranks)
    rows = np.stack([(rank == r).sum(axis=(1, 2)) for r in range(ranks)], axis=1)
    return float(rows.max(axis=1).mean())


@pytest.mark.parametrize(
    "experts, k, tokens, ranks", [(8, 2, 16, 2), (8, 2, 64, 4), (128, 8, 8, 4), (128, 8, 32, 8), (8, 2, 256, 8)]
)
def test_the_busiest_ranks_rows_match_a_simulated_router(experts, k, tokens, ranks):
    """The normal approximation with Blom's expected maximum against the router itself: within 6%."""
    assert busiest_rows(tokens * k, ranks) == pytest.approx(simulated_busiest(experts, k, tokens, ranks), rel=0.06)


def test_the_busiest_rank_by_hand():
    # two ranks, one token of top-2: mean 1 row, sd sqrt(2 x 0.5 x 0.5) = 0.7071, z(2) = Phi^-1(1.625 / 2.25)
    # = Phi^-1(0.7222) = 0.5894: 1 + 0.5894 x 0.7071 = 1.4168
    assert busiest_rows(2, 2) == pytest.approx(1.4168, abs=1e-3)
    assert busiest_rows(16, 1) == 16 and busiest_rows(0, 8) == 0
    assert busiest_rows(1, 8) == 1  # the one row's rank runs it
    assert busiest_rows(64, 2) >= 32  # never under an even share


def test_a_mixtral_decode_on_two_h100s_by_hand():
    """Mixtral, TP2, 8 sequences decoding: 16 routed rows. Sharded: each rank reads its half of the
    8 x (1 - 0.75^8) = 7.20 experts touched and runs all 16 rows at width 7168. Expert-parallel: the
    busiest rank runs 8 + z(2) x sqrt(16 x 0.5 x 0.5) = 8 + 0.5894 x 2 = 9.18 rows over its 3.60 whole
    experts at width 14336. Gate/up GEMM, memory-bound both ways (bytes / 2.68e12):
      sharded: 7.20 x 4096 x 14336 x 2 + 16 x (4096 + 14336) x 2   = 846.3 MB + 0.59 MB
      expert:  3.60 x 4096 x 28672 x 2 + 9.18 x (4096 + 28672) x 2 = 846.3 MB + 0.60 MB"""
    touched = 8 * (1 - 0.75**8)
    sharded = RooflineModel(H100, MIXTRAL, tp=2)
    expert = RooflineModel(H100, MIXTRAL, tp=2, expert_parallel=True)
    rows = 8 + Z(2) * 2.0
    assert rows == pytest.approx(9.179, abs=1e-3)
    by_hand_sharded = (touched * 4096 * 14336 * 2 + 16 * (4096 + 14336) * 2) / HBM
    by_hand_expert = (touched / 2 * 4096 * 28672 * 2 + rows * (4096 + 28672) * 2) / HBM
    assert routed_gemm(sharded, 8, 4096, 2 * 7168, 2, "bfloat16") == pytest.approx(by_hand_sharded, rel=1e-9)
    assert routed_gemm(expert, 8, 4096, 2 * 14336, 2, "bfloat16") == pytest.approx(by_hand_expert, rel=1e-9)
    # the whole step: the same weights; the busiest rank's fewer, wider rows move about as many
    # activation bytes as every row at half width (0.94 MB against 0.95 MB a layer): within 0.1%
    assert expert.step_time(0, 0.0, 8, 8000) == pytest.approx(sharded.step_time(0, 0.0, 8, 8000), rel=1e-3)


def Z(n: int) -> float:
    """Blom's expected maximum of n standard normals: Phi^-1((n - 0.375) / (n + 0.25))."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def test_a_large_prefill_evens_out_and_a_small_batch_waits_for_its_busiest_rank():
    """Qwen3-30B-A3B on four H100s: an 8,192-token prefill puts within 2% of the mean rows on the
    busiest rank (compute-bound: the step barely moves); a one-sequence decode's 8 rows land on at
    most 4 ranks' experts, so its busiest rank runs 3.3 of them, not 2."""
    sharded = RooflineModel(H100, QWEN3, tp=4)
    expert = RooflineModel(H100, QWEN3, tp=4, expert_parallel=True)
    rows = 8192 * 8
    assert busiest_rows(rows, 4) / (rows / 4) == pytest.approx(1.0, abs=0.02)
    assert expert.step_time(8192, 8192 * 4096.0, 0, 0) == pytest.approx(
        sharded.step_time(8192, 8192 * 4096.0, 0, 0), rel=0.03
    )
    assert Z(4) == pytest.approx(1.0491, abs=1e-4)  # Phi^-1(3.625 / 4.25) = Phi^-1(0.8529)
    assert busiest_rows(8, 4) == pytest.approx(2 + Z(4) * math.sqrt(8 * 0.25 * 0.75), rel=1e-12)  # 3.285


def test_the_simulator_runs_mixtral_expert_parallel_and_says_so():
    cfg = compose_config(
        ["executor=sim", "model=mixtral_8x7b", "sim.profile=h100_sxm", "cluster.tp=2", "sim.expert_parallel=true"]
    )
    role = resolve_roles(*sim_args(cfg), {"mixed"})["mixed"]
    assert role.cost.expert_parallel and role.label["expert_parallel"] is True and role.label["tp"] == 2


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model=llama3_8b", "cluster.tp=2"], "sim.expert_parallel=true places a Mixture-of-Experts model's experts"),
        (["model=mixtral_8x7b", "cluster.tp=16"], "do not divide the model's 8 experts"),
    ],
)
def test_expert_parallel_where_it_cannot_place_is_one_line(overrides, words):
    cfg = compose_config(["executor=sim", "sim.profile=h100_sxm", "sim.expert_parallel=true", *overrides])
    with pytest.raises(ConfigError) as refused:
        resolve_roles(*sim_args(cfg), {"mixed"})
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_compute_bound_prefill_pays_for_its_busiest_rank():
    """Mixtral on eight H100s, 4,096 prompt tokens (8,192 rows): the routed gate/up is compute-bound
    both ways (sharded: 2 x 8192 x 4096 x 3584 = 2.41e11 FLOP, 324 us, against 235 MB of the eight
    experts' shards, 88 us), so expert parallelism costs what its busiest rank's extra rows cost:
    1024 + z(8) x sqrt(8192 x 0.125 x 0.875) = 1024 + 1.434 x 29.93 = 1066.9 rows against an even
    1024, +4.2%."""
    sharded = RooflineModel(H100, MIXTRAL, tp=8)
    expert = RooflineModel(H100, MIXTRAL, tp=8, expert_parallel=True)
    busiest = busiest_rows(8192, 8)
    assert busiest == pytest.approx(1066.9, abs=0.1)
    ratio = routed_gemm(expert, 4096, 4096, 2 * 14336, 2, "bfloat16") / routed_gemm(
        sharded, 4096, 4096, 2 * 1792, 2, "bfloat16"
    )
    assert ratio == pytest.approx(busiest / 1024, rel=1e-9)
