"""The SLO-aware split (testbed/sim/slo_split.py): its queueing and decode-batch formulas on
hand-computed cases, the direction of its answers (a tighter TTFT SLO wants more P; a slower
inter-node link serves less), bad node counts refused, and its best split within one device of the
simulated search's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from testbed.config import register_configs, to_config
from testbed.errors import ConfigError
from testbed.sim.slo_split import Demand, decode_batch, estimate, max_rate, pk_wait, placement, prefill_time, slo_split
from testbed.sizing import compose_sized
from testbed.studies.runner import run
from tests.cluster_helpers import sim_args
from tests.paths import CONF

register_configs()

GPU_SIM = [
    "executor=sim",
    "sim.profile=h100_sxm",
    "model=llama3_8b",
    "hardware=cpu",
    "experiment.repeats=1",
    "experiment.figures=false",
]


def config(*extra: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return to_config(compose("config", overrides=["+experiment=plan", *GPU_SIM, *extra]))


class LinearCost:
    """step = 0.01 + 1e-4 per prefill token + 1e-3 per decode sequence; KV context ignored."""

    def prefill_context(self, chunks):
        return 0.0

    def step_time(self, prefill_tokens, prefill_context, decode_seqs, decode_context):
        return 0.01 + 1e-4 * prefill_tokens + 1e-3 * decode_seqs


def test_pollaczek_khinchine_wait_of_md1_and_saturation():
    assert pk_wait(0.5, 1.0, 1.0) == pytest.approx(0.5)  # rho 0.5, deterministic: rho S / (2 (1 - rho))
    assert pk_wait(0.5, 1.0, 2.0) == pytest.approx(1.0)  # exponential service (E[S^2] = 2 S^2): twice
    assert pk_wait(1.0, 1.0, 1.0) == math.inf


def test_prefill_time_runs_budget_sized_chunks():
    assert prefill_time(LinearCost(), 250, 100) == pytest.approx(3 * 0.01 + 250 * 1e-4)


def test_decode_batch_solves_littles_law_or_refuses_past_the_cap():
    step = lambda b: 0.01 + 1e-4 * b  # noqa: E731
    # B = 500 (0.01 + 1e-4 ceil(B)) = 5 + 0.05 x 6 = 5.3
    assert decode_batch(50, 10, step, cap=64) == pytest.approx(5.3)
    assert decode_batch(50, 10, step, cap=5) is None
    assert decode_batch(100, 2, lambda b: 0.01 + 0.01 * b, cap=10_000) is None  # B = 2 + 2B: no fixed point


def test_estimate_adds_queueing_service_and_transfer():
    demand = Demand(
        prompt_len=100,
        output_len=10,
        mean_service_s=0.1,
        second_moment_s2=0.01,
        prompt_service_s=0.1,
        transfer_s=0.05,
        decode_cap=64,
    )
    decode = SimpleNamespace(cost=LinearCost())
    e = estimate(demand, decode, context=0.0, p=2, d=1, rate=10)  # 5/s per P worker: rho 0.5, W 0.05
    assert e["ttft_s"] == pytest.approx(0.05 + 0.1 + 0.05)
    # B = 10 x 10 x (0.01 + 1e-3 ceil(B)) = 1 + 0.1 x 2 = 1.2 ; TPOT = 0.01 + 0.002
    assert e["decode_batch"] == pytest.approx(1.2)
    assert e["tpot_s"] == pytest.approx(0.012)
    top = max_rate(demand, decode, 0.0, 2, 1, ttft_s=0.3, tpot_s=1.0)
    # TTFT = 0.15 + lambda 0.01 / (2 (1 - 0.1 lambda)) with lambda = r / 2 equals 0.3 at lambda = 7.5
    assert top == pytest.approx(15.0, rel=1e-6)


def test_placement_fills_nodes_with_p_first():
    assert placement(8, 16, 2) == {"prefill_nodes": [0], "decode_nodes": [1]}
    assert placement(5, 16, 2) == {"prefill_nodes": [0], "decode_nodes": [0, 1]}


def test_bad_node_counts_are_one_line_errors():
    with pytest.raises(ConfigError, match="does not divide"):
        config("hardware.num_devices=6", "hardware.num_nodes=4")
    with pytest.raises(ConfigError, match="num_nodes must be >= 1"):
        config("hardware.num_nodes=0")


def split_p(name: str) -> int:
    return int(name.split("P")[0])


def test_tighter_ttft_slo_wants_more_prefill():
    loose = slo_split(*sim_args(config("hardware.num_devices=8", "slo.ttft_s=5.0", "slo.tpot_s=0.1")), 8)
    tight = slo_split(*sim_args(config("hardware.num_devices=8", "slo.ttft_s=0.3", "slo.tpot_s=0.1")), 8)
    assert split_p(tight["best"]) > split_p(loose["best"]), (loose["best"], tight["best"])


def test_slower_internode_link_serves_less():
    shape = ("hardware.num_devices=16", "hardware.num_nodes=2", "slo.ttft_s=1.0")
    fast = slo_split(*sim_args(config(*shape, "hardware.internode_gbps=25")), 16)
    slow = slo_split(*sim_args(config(*shape, "hardware.internode_gbps=2")), 16)
    assert slow["transfer_s"] > fast["transfer_s"]
    assert slow["splits"][slow["best"]]["max_rate"] < fast["splits"][fast["best"]]["max_rate"]


def test_best_split_agrees_with_the_simulated_search(tmp_path):
    overrides = [
        "+experiment=plan",
        *GPU_SIM,
        "hardware.num_devices=8",
        "workload.num_requests=80",
        "workload=poisson",
        "workload.input_len.dist=uniform",
        "workload.output_len.dist=uniform",
        "workload.input_len.min=3000",
        "workload.input_len.max=6000",
        "workload.output_len.min=4",
        "workload.output_len.max=16",
        "experiment.rates=[16,32,64,128,256]",
        "experiment.own.chunk_sizes=[512]",
        "slo.ttft_s=1.0",
        "slo.tpot_s=0.05",
    ]
    aggregate = run(compose_sized(overrides), tmp_path)["aggregate"]
    simulated = {k: v["goodput_per_gpu"] for k, v in aggregate["simulated"]["goodput"].items() if "P" in k}
    best = max(simulated, key=simulated.get)
    assert abs(split_p(aggregate["slo_plan"]["best"]) - split_p(best)) <= 1, (aggregate["slo_plan"]["best"], simulated)
    # every planner ran the current vLLM's host side, and the plan says so
    assert aggregate["engine_profile"] == "vllm_v1" and aggregate["engine"].startswith("vllm_v1 (vllm >=0.14")


def test_report_names_the_slo_aware_split():
    from testbed.studies.report import slo_split_lines

    plan = {
        "num_nodes": 2,
        "devices_per_node": 8,
        "transfer_s": 0.042,
        "best": "7P9D",
        "splits": {"7P9D": {"max_rate": 54.4, "rate_per_device": 3.4}},
    }
    (line,) = slo_split_lines(plan)
    assert "2 nodes x 8" in line and "7P9D" in line and "54.4 req/s" in line
    assert "no split" in slo_split_lines({**plan, "best": None})[0]
    assert slo_split_lines(None) == []
