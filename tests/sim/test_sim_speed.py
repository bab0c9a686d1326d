"""The simulator's shortcuts give the same floats and the same requests as the long way."""

from __future__ import annotations

import json

import pytest

from testbed.config import compose_config
from testbed.model.config import PRESETS
from testbed.perf.measured import CostModel
from testbed.perf.resolve import analytical
from testbed.sim.config import shipped_profile
from testbed.sim.decode_run import decode_times
from testbed.sim.simulator import workload_for


def step_by_step(cost, seqs: int, context: int, steps: int) -> list[float]:
    return [cost.step_time(0, 0.0, seqs, context + seqs * i) for i in range(steps)]


def measured_model() -> CostModel:
    return CostModel.from_profile(json.loads(shipped_profile("tiny").read_text()))


@pytest.mark.parametrize(
    "model, knobs",
    [
        ("llama3_8b", {}),
        ("llama3_8b", {"async_scheduling": True, "host_per_seq_s": 2e-5}),
        ("llama3_70b", {"tp": 4, "async_scheduling": True}),
        ("llama3_8b", {"cuda_graphs": False, "weight_dtype": "fp8", "kv_dtype": "fp8"}),
        ("mixtral_8x7b", {"tp": 2}),
    ],
)
def test_a_rooflines_decode_times_are_its_step_times_to_the_last_bit(model, knobs):
    cost, _ = analytical("h100_sxm", PRESETS[model], 2, **knobs)
    for seqs, context in [(1, 17), (7, 3000), (64, 250_000)]:
        assert cost.decode_times(seqs, context, 40) == step_by_step(cost, seqs, context, 40)


def test_a_measured_models_decode_times_are_its_step_times_to_the_last_bit():
    cost = measured_model()
    for seqs, context in [(1, 17), (7, 3000), (48, 90_000)]:
        assert cost.decode_times(seqs, context, 40) == step_by_step(cost, seqs, context, 40)


def test_a_cost_model_without_decode_times_is_asked_step_by_step():
    class Plain:
        def step_time(self, prefill_tokens, prefill_context, decode_seqs, decode_context):
            return 1e-3 + 1e-7 * decode_context

    assert decode_times(Plain(), 3, 10, 5) == step_by_step(Plain(), 3, 10, 5)


def test_an_open_loop_workload_is_shared_and_a_closed_loop_built_again():
    cfg = compose_config(["executor=sim", "hardware=cpu", "workload.num_requests=30"])
    first = workload_for(cfg.workload, 0, 1000, 4096)
    again = workload_for(cfg.workload, 0, 1000, 4096)
    assert again.requests == first.requests and again.report == first.report
    assert again.requests is not first.requests and again.report is not first.report
    assert workload_for(cfg.workload, 1, 1000, 4096).requests != first.requests  # another seed
    closed = compose_config(["executor=sim", "hardware=cpu", "workload.num_requests=30", "workload.concurrency=4"])
    one, two = (workload_for(closed.workload, 0, 1000, 4096) for _ in range(2))
    assert one.users is not two.users
