"""Decode runs (testbed/sim/decode_run.py) against the reference they shortcut: stepping one at a
time through the real Scheduler. The simulator with sim.decode_runs=true must write the very
tables it writes with false, to the last bit, whatever cuts the runs short."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from testbed.bench.sim import TINY_CPU, bench_config
from testbed.engine.block_manager import BlockManager
from testbed.engine.config import SchedulerConfig
from testbed.engine.policies import make_policy
from testbed.engine.scheduler import Scheduler
from testbed.engine.sequence import Sequence
from testbed.sim.decode_run import time_run
from testbed.sim.executor import simulate
from testbed.sim.host import Delay, Draws, HostModel


def _profile(sampled: bool) -> dict:
    profile = json.loads(TINY_CPU.read_text())
    if sampled:  # an in-situ profile's host section: every delay and contention drawn
        spread = lambda lo, hi: list(np.linspace(lo, hi, 101))  # noqa: E731
        profile["host"] = {
            "dispatch": spread(0, 3e-4),
            "step_gap": spread(0, 2e-4),
            "report": spread(1e-5, 5e-4),
            "step_scale": spread(0.8, 1.6),
            "step_scale_prefill": spread(0.9, 1.3),
            "step_scale_after_prefill": spread(1.0, 2.0),
            "step_gap_prefill": spread(0, 4e-4),
            "report_first": spread(1e-5, 8e-4),
            "release": spread(0, 5e-4),
            "handoff": spread(0, 1e-3),
            "step_scale_rho": 0.9,  # contention in phases: a run must restore the phase it cut
            "step_scale_weight": 0.7,
        }  # and each step's own jitter: two uniforms a step
    return profile


def _tables(overrides: list[str], requests: int, rate: float, sampled: bool, runs: bool):
    cfg = bench_config(requests, 2, 3, rate, 0, [*overrides, f"sim.decode_runs={str(runs).lower()}"])
    result = simulate(cfg.serving, cfg.sim, _profile(sampled), num_devices=5)
    order = {"requests": ["request_id"], "steps": ["worker", "step"], "transfers": ["request_id", "attempt"]}
    return {name: result[name].sort_values(keys).reset_index(drop=True) for name, keys in order.items()}, result


CASES = {
    "disagg": (["workload=poisson"], 300, 100.0, False),
    "disagg-sampled-host": (["workload=poisson"], 300, 100.0, True),
    "disagg-saturated-small-pool": (
        ["workload=poisson", "engine.num_kv_blocks=140", "model.max_model_len=1024"],
        300,
        1000.0,
        True,
    ),
    "early-binding": (["workload=poisson", "kv_transfer.decode_binding=early"], 300, 300.0, False),
    "colocated": (["workload=poisson", "mode=colocated"], 200, 100.0, True),
    "chunked": (["workload=poisson", "mode=chunked"], 200, 100.0, False),
    "multiturn-prefix-cache": (
        ["workload=multiturn", "engine.enable_prefix_caching=true", "cluster.dispatch=session_affinity"],
        200,
        100.0,
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_runs_write_the_tables_of_stepping_one_at_a_time(case):
    overrides, requests, rate, sampled = CASES[case]
    fast, result = _tables(overrides, requests, rate, sampled, runs=True)
    slow, reference = _tables(overrides, requests, rate, sampled, runs=False)
    for name in fast:
        pd.testing.assert_frame_equal(fast[name], slow[name], check_exact=True, obj=name)
    assert result["summary"]["sim"]["events"] < reference["summary"]["sim"]["events"] or case == "colocated"
    assert sum(result["summary"]["kv_blocks_leaked"].values()) == 0


# -- the scheduler's side ---------------------------------------------------------------------
def _decoding(lengths: list[tuple[int, int]], num_blocks: int = 64, block_size: int = 4) -> Scheduler:
    """A decode worker's scheduler with sequences (prompt, max tokens) installed and decoding."""
    scheduler = Scheduler(
        make_policy("decode_only"),
        BlockManager(num_blocks, block_size),
        SchedulerConfig(max_running=8, max_batched_tokens=64),
    )
    for rid, (prompt, max_tokens) in enumerate(lengths):
        seq = Sequence(rid, list(range(1, prompt + 1)), max_tokens)
        assert scheduler.reserve(seq)
        scheduler.install(rid, 7)
    return scheduler


def _state(scheduler: Scheduler) -> list:
    return [(s.seq_id, s.token_ids, s.num_computed_tokens, s.block_table, s.status) for s in scheduler.running] + [
        list(scheduler.block_manager.free_ids)
    ]


def test_quiet_run_stops_before_the_first_finish_and_advance_equals_stepping():
    lengths = [(5, 9), (3, 30), (10, 12)]
    fast, slow = _decoding(lengths), _decoding(lengths)
    quiet = fast.quiet_run()
    assert quiet.steps == 7  # the first sequence has 8 tokens to go; the step of its last one finishes it
    assert quiet.seqs == ((0, 1), (1, 1), (2, 1))
    assert quiet.context == 6 + 4 + 11
    used = []
    for _ in range(quiet.steps):
        batch = slow.schedule()
        assert [n for _, n in batch.items] == [1, 1, 1]
        result = slow.postprocess(batch, [0] * len(batch.items))
        assert not result.finished
        used.append(slow.block_manager.num_used_blocks)
    fast.advance_decodes(quiet.steps, 0)
    assert _state(fast) == _state(slow)
    assert quiet.used == used
    slow.block_manager.check_invariants(slow.running)
    fast.block_manager.check_invariants(fast.running)


def test_quiet_run_refuses_waiting_work_and_shrinks_to_the_free_blocks():
    scheduler = _decoding([(4, 40)], num_blocks=4)  # 2 blocks held (5 tokens), 2 free
    quiet = scheduler.quiet_run()
    # 38 quiet steps would take 9 blocks (at steps 4, 8, ...); halved until they fit: 9 steps, 2 blocks
    assert quiet.steps == 9 and quiet.used == [2] * 4 + [3] * 4 + [4]
    scheduler.add(Sequence(9, [1, 2, 3], 4))
    assert scheduler.quiet_run() is None  # a waiting sequence makes the next step a prefill


# -- draws --------------------------------------------------------------------------------------
def test_a_cut_run_gives_back_the_draws_stepping_would_not_have_made():
    scale = Delay(tuple(np.linspace(0.5, 1.5, 101)))
    host = HostModel(report=Delay(tuple(np.linspace(0, 1e-3, 101))), step_gap=Delay(tuple(np.linspace(0, 1e-4, 101))))
    scheduler = _decoding([(5, 30), (3, 30)])

    class Flat:  # a step costs 1 ms whatever its shape
        @staticmethod
        def step_time(*_):
            return 1e-3

    ahead, stepping = Draws(5), Draws(5)
    run = time_run(0.0, scheduler.quiet_run(), Flat, scale, host, ahead)
    done, in_flight = run.cut(run.starts[4] + 1e-6, ahead)  # in step 5 (index 4): 4 done, 1 in flight
    assert (done, in_flight) == (4, True)
    for _ in range(done):
        stepping.sample(scale), stepping.sample(host.report), stepping.sample(host.step_gap)
    stepping.sample(scale)  # the in-flight step's contention; its report and gap come at its end
    assert [ahead.sample(host.report) for _ in range(6)] == [stepping.sample(host.report) for _ in range(6)]
