"""The simulator: cost-model fit, conservation, KV accounting, back-pressure and determinism."""

import json

import numpy as np
import pandas as pd
import pytest

from testbed.errors import ConfigError
from testbed.sim.cost_model import STEP_TERMS, CostModel, attended_context, fit_step, fit_transfer
from testbed.sim.executor import simulate
from tests.cluster_helpers import make_config, sim_args, small_workload
from tests.paths import ROOT

PROFILE = json.loads((ROOT / "testbed/sim/profiles/tiny_cpu.json").read_text())
COST = CostModel.from_profile(PROFILE)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny: K and V x 2 layers x 2 KV heads x head dim 16, float32

MODES = {
    "colocated": ["mode=colocated", "cluster.num_workers=2"],
    "chunked": ["mode=chunked", "cluster.num_workers=2", "scheduler.chunk_size=64", "scheduler.max_running=16"],
}
for p, d in [(1, 1), (2, 2)]:
    for binding in ("late", "early"):
        MODES[f"disagg-{p}P{d}D-{binding}"] = [
            "mode=disagg",
            f"cluster.num_prefill={p}",
            f"cluster.num_decode={d}",
            f"kv_transfer.decode_binding={binding}",
        ]


def run(*overrides, **kwargs):
    return simulate(*sim_args(make_config(*small_workload(40, 40.0), *overrides)), PROFILE, **kwargs)


def lone_prefill_s(input_len: int) -> float:
    return COST.step_time(input_len, COST.prefill_context([(input_len, 0)]), 0, 0)


# -- cost model -------------------------------------------------------------------------------------
def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = dict(zip(STEP_TERMS, (5e-4, 2e-6, 3e-9, 0.0, 4e-8)))  # one term truly zero
    samples = []
    for _ in range(60):
        row = {
            "prefill_tokens": int(rng.integers(0, 4000)),
            "prefill_context": float(rng.integers(0, 4000)),
            "decode_seqs": int(rng.integers(0, 128)),
        }
        row["decode_context"] = row["decode_seqs"] * int(rng.integers(1, 4000))
        model = CostModel(**true, transfer_latency_s=0, transfer_bytes_per_s=1)
        row["seconds"] = model.step_time(
            *(row[k] for k in ("prefill_tokens", "prefill_context", "decode_seqs", "decode_context"))
        )
        samples.append(row)
    fitted, error = fit_step(samples)
    for term in STEP_TERMS:
        assert fitted[term] == pytest.approx(true[term], rel=1e-6, abs=1e-12), term
    assert error["max"] < 1e-6
    transfer, _ = fit_transfer([{"bytes": b, "seconds": 1e-4 + b / 5e9} for b in (4096, 1 << 16, 1 << 20, 1 << 24)])
    assert transfer["latency_s"] == pytest.approx(1e-4) and transfer["bytes_per_s"] == pytest.approx(5e9)


def test_fit_keeps_coefficients_non_negative():
    samples = [
        {"prefill_tokens": n, "prefill_context": n, "decode_seqs": 0, "decode_context": 0, "seconds": 1e-2 - 1e-6 * n}
        for n in (16, 64, 256, 1024)
    ]  # time falling with size
    fitted, _ = fit_step(samples)
    assert all(v >= 0 for v in fitted.values())


def test_attended_context_counts_a_chunk_s_own_keys():
    assert attended_context([(4, 0)], causal=True) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert attended_context([(4, 10)], causal=False) == 14
    assert attended_context([(2, 0), (2, 8)], causal=False) == pytest.approx((2 * 2 + 2 * 10) / 4)


def test_shipped_profile_is_complete():
    for key in ("model", "device", "dtype", "torch_version", "samples", "cost_model", "fit"):
        assert key in PROFILE
    assert PROFILE["fit"]["step_relative_error"]["samples"] == len(PROFILE["samples"]["step"])
    assert COST.step_time(0, 0, 1, 100) > 0 and COST.transfer_time(1 << 20) > COST.transfer_time(1 << 10)


# -- the simulation --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_conserves_requests_tokens_and_blocks(name):
    result = run(*MODES[name])
    requests, summary = result["requests"], result["summary"]
    assert len(requests) == 40 and requests.request_id.is_unique
    assert (requests.status == "ok").all(), requests.reason.unique()
    assert (requests.num_tokens == requests.output_len).all()
    assert all(v == 0 for v in summary["kv_blocks_leaked"].values())
    assert summary["executor"] == "sim" and summary["num_requests"]["ok"] == 40
    assert (requests.ttft > 0).all() and (requests.e2e >= requests.ttft).all()
    if "chunked" not in name:  # a whole prompt in one step: the first token needs at least that step
        floor = requests.input_len.map(lone_prefill_s)
        assert (requests.ttft >= floor - 1e-12).all()
    steps = result["steps"]
    assert {"worker", "role", "step", "start_s", "end_s", "batched_tokens"} <= set(steps.columns)
    assert (steps.end_s > steps.start_s).all()
    for _, worker_steps in steps.sort_values("step").groupby("worker"):  # a worker runs one step at a time
        assert (worker_steps.start_s.to_numpy()[1:] >= worker_steps.end_s.to_numpy()[:-1] - 1e-12).all()


@pytest.mark.parametrize("name", ["disagg-1P1D-late", "disagg-2P2D-early"])
def test_transfers_move_prompt_kv(name):
    result = run(*MODES[name])
    requests, transfers = result["requests"].set_index("request_id"), result["transfers"]
    assert len(transfers) == int((requests.output_len > 1).sum())
    prompt = requests.loc[transfers.request_id, "input_len"].to_numpy()
    assert (transfers.kv_bytes.to_numpy() == prompt * KV_BYTES_PER_TOKEN).all()
    assert (transfers.end_s > transfers.start_s).all()
    assert set(transfers.decode_worker) <= set(range(int(name[7]), 2 * int(name[7])))
    done = requests.loc[transfers.request_id]
    assert (done.decode_start_s.to_numpy() >= transfers.end_s.to_numpy()).all()


@pytest.mark.parametrize("backend", ["process_group", "ipc"])
def test_transfers_take_the_time_of_their_transport(backend):
    transfers = run("mode=disagg", f"kv_transfer.backend={backend}")["transfers"]
    expected = [COST.transfer_time(n, backend) for n in transfers.kv_bytes]
    assert np.allclose(transfers.end_s - transfers.start_s, expected, rtol=1e-9, atol=1e-12)
    assert COST.transfer_time(1 << 20, "ipc") < COST.transfer_time(1 << 20)  # one copy, no wire, on this CPU


def test_ipc_on_a_profile_made_before_the_ipc_transport_is_refused_in_one_line():
    old = {**PROFILE, "samples": {k: v for k, v in PROFILE["samples"].items() if k != "transfer_ipc"}}
    old["cost_model"] = {k: v for k, v in PROFILE["cost_model"].items() if not k.startswith("ipc_")}
    assert CostModel.from_profile(old).transports == ("process_group",)
    simulate(*sim_args(make_config(*small_workload(4, 40.0), "mode=disagg")), old)  # the wire still simulates
    with pytest.raises(
        ConfigError, match=r"kv_transfer.backend=ipc: the prefill profile \(given\) has no ipc transfer samples"
    ):
        simulate(*sim_args(make_config(*small_workload(4, 40.0), "mode=disagg", "kv_transfer.backend=ipc")), old)


def test_queueing_grows_past_capacity():
    base = ["mode=colocated", "cluster.num_workers=1"]
    light = simulate(*sim_args(make_config(*small_workload(60, 5.0), *base)), PROFILE)["summary"]
    heavy = simulate(*sim_args(make_config(*small_workload(60, 5000.0), *base)), PROFILE)["summary"]
    assert heavy["queue"]["prefill_queue_s"]["mean"] > 10 * max(light["queue"]["prefill_queue_s"]["mean"], 1e-4)
    assert heavy["ttft"]["p50"] > 5 * light["ttft"]["p50"]


def test_same_seed_same_tables():
    first, second = run(*MODES["disagg-2P2D-early"]), run(*MODES["disagg-2P2D-early"])
    for table in ("requests", "steps", "transfers"):
        pd.testing.assert_frame_equal(first[table], second[table])


def test_sessions_admission_and_waits_past_the_lease_leak_nothing():
    sessions = simulate(
        *sim_args(
            make_config(
                "workload=multiturn",
                "workload.num_requests=6",
                "workload.rate=50",
                "workload.think_time_s=0.01",
                "engine.enable_prefix_caching=true",
                "mode=chunked",
                "hardware=cpu",
            )
        ),
        PROFILE,
    )
    assert (sessions["requests"].status == "ok").all() and sessions["requests"].turn.max() == 3
    capped = run("mode=disagg", "cluster.max_outstanding=3", "workload.rate=5000")
    assert set(capped["requests"].status) == {"ok", "rejected"}
    # D holds 2 sequences at a time, so reservations and held KV wait far longer than the 1 ms
    # lease: as on the real cluster, the lease runs only while an attempt is on the wire
    waited = [
        run(
            "mode=disagg",
            "workload.rate=5000",
            "scheduler.max_running=2",
            "kv_transfer.timeout_s=0.001",
            f"kv_transfer.decode_binding={binding}",
        )
        for binding in ("late", "early")
    ]
    for result in waited:
        assert (result["requests"].status == "ok").all()
        assert (result["transfers"].wait_s > 0.001).any() and set(result["transfers"].outcome) == {"ok"}
    for result in (sessions, capped, *waited):
        assert all(v == 0 for v in result["summary"]["kv_blocks_leaked"].values())


def test_device_count_is_a_parameter():
    cfg = make_config(*small_workload(8), *MODES["disagg-2P2D-late"], "hardware.num_devices=2")
    with pytest.raises(ConfigError, match="needs 4 devices"):
        simulate(cfg.serving, cfg.sim, PROFILE)
    assert simulate(cfg.serving, cfg.sim, PROFILE, num_devices=64)["summary"]["num_gpus"] == 4


def test_profile_of_another_model_is_refused():
    with pytest.raises(ConfigError, match="does not match"):
        run("model=small")


def test_dispatch_latency_delays_every_first_step():
    base = run("mode=chunked")["requests"]
    late = run("mode=chunked", "sim.dispatch_latency_s=0.01")["requests"]
    assert (late.prefill_queue_s >= 0.01 - 1e-9).all()
    assert late.ttft.median() == pytest.approx(base.ttft.median() + 0.01, abs=0.002)
