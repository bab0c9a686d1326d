"""In-situ profiles (sim.profile=run:<dir>) and the host model they feed: distributions sampled by
inverse transform, a fit that recovers a known cost model and known delays, and a simulation on
them that reproduces the run it was fitted on."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from testbed.errors import ConfigError
from testbed.perf import CostModel
from testbed.sim.host import Delay, Draws, HostModel, step_scale, transfer_scale
from testbed.sim.in_situ import RUN_STRIDE, fit_gap_phase, load_in_situ, phase_correlation, read_runs, report_delays
from testbed.studies.executors import simulate_point
from tests.cluster_helpers import make_config, small_workload

DELAYS = ["sim.dispatch_latency_s=0.003", "sim.step_gap_s=0.002", "sim.report_latency_s=0.001"]


def test_a_delay_samples_its_distribution():
    values = np.random.default_rng(0).exponential(0.01, 5000)
    delay = Delay.of(values)
    rng = random.Random(1)
    drawn = np.array([delay.sample(rng.random()) for _ in range(20000)])
    for q in (0.5, 0.9, 0.99):
        assert np.quantile(drawn, q) == pytest.approx(np.quantile(values, q), rel=0.1)
    assert Delay.fixed(0.5).sample(0.3) == 0.5 and Delay.fixed(0.5).is_fixed and not delay.is_fixed


def test_fixed_settings_win_over_what_was_measured():
    measured = {"dispatch": [0.0, 1.0], "report": [0.0, 2.0]}
    host = HostModel.from_dict(measured, {"dispatch": 0.25, "step_gap": None, "report": None})
    assert host.dispatch.quantiles == (0.25,) and host.report.quantiles == (0.0, 2.0) and host.step_gap.is_fixed
    assert step_scale(None).quantiles == (1.0,) and step_scale({"host": {"step_scale": [1.0, 3.0]}}).median == 2.0


@pytest.mark.parametrize(
    "mode",
    [["mode=chunked", "cluster.num_workers=2"], ["mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1"]],
)
def test_a_fit_on_a_run_recovers_its_delays_and_reproduces_it(tmp_path, mode):
    """A simulated run with known fixed delays stands for a measured one: the in-situ profile
    recovers the delays and the step model, and a simulation on it reproduces the run."""
    source = make_config(*small_workload(60, 30.0), *mode, *DELAYS, "hardware=cpu")
    original = simulate_point(source, tmp_path / "run")
    role = "mixed" if "mode=chunked" in mode else "decode"
    profile = load_in_situ(f"run:{tmp_path / 'run'}", role)
    host = HostModel.from_dict(profile["host"], {})
    assert host.report.median == pytest.approx(0.001, abs=1e-9)
    assert host.step_gap.median == pytest.approx(0.002, abs=1e-9)
    assert host.dispatch.median == pytest.approx(0.003, rel=0.05)
    assert step_scale(profile).median == pytest.approx(1.0, abs=0.05)  # a simulated step is its model
    again = simulate_point(
        make_config(*small_workload(60, 30.0), *mode, "hardware=cpu", f"sim.profile=run:{tmp_path / 'run'}"),
        tmp_path / "again",
    )
    for metric in ("ttft", "tpot"):
        assert again["summary"][metric]["p50"] == pytest.approx(original["summary"][metric]["p50"], rel=0.1)


def test_a_run_over_ipc_gives_ipc_times_only(tmp_path):
    """A run's transfers are times of the transport it used: an ipc run's profile simulates ipc
    (its own transfer times back) and refuses the wire in one line."""
    mode = ["mode=disagg", "kv_transfer.backend=ipc", "hardware=cpu"]
    original = simulate_point(make_config(*small_workload(40, 30.0), *mode, *DELAYS), tmp_path / "run")
    profile = load_in_situ(f"run:{tmp_path / 'run'}", "prefill")
    cost = CostModel.from_profile(profile)
    assert cost.transports == ("ipc",)
    moved = original["transfers"]
    assert np.allclose([cost.transfer_time(n, "ipc") for n in moved.kv_bytes], moved.end_s - moved.start_s, rtol=1e-3)
    with pytest.raises(ConfigError, match="transfer times for ipc only"):
        simulate_point(
            make_config(
                *small_workload(10, 30.0), "mode=disagg", "hardware=cpu", f"sim.profile=run:{tmp_path / 'run'}"
            ),
            tmp_path / "wire",
        )


def test_a_runs_transfer_tail_is_fitted_and_simulated(tmp_path):
    """Transfers that took 6x their link's time in the run (both ends off their cores: a loaded
    run's p99 was 6-10x its median) come back as the simulated transfers' tail, where a latency
    and bandwidth fit alone gave every transfer the median's time (the 1P1D TPOT p99 20-31% low)."""
    mode = ["mode=disagg", "hardware=cpu"]
    simulate_point(make_config(*small_workload(60, 30.0), *mode, *DELAYS), tmp_path / "run")
    path = tmp_path / "run" / "kv_transfers.parquet"
    run = pd.read_parquet(path)
    slow = np.arange(len(run)) % 5 == 0  # every fifth transfer 6x its link's time
    run["end_s"] = run["start_s"] + (run["end_s"] - run["start_s"]) * np.where(slow, 6.0, 1.0)
    run.to_parquet(path)
    profile = load_in_situ(f"run:{tmp_path / 'run'}", "prefill")
    scale = transfer_scale(profile)
    assert not scale.is_fixed and scale.sample(0.95) / scale.median > 3
    again = simulate_point(
        make_config(*small_workload(60, 30.0), *mode, "hardware=cpu", f"sim.profile=run:{tmp_path / 'run'}"),
        tmp_path / "again",
    )["transfers"]
    real, sim = (np.sort((t["end_s"] - t["start_s"]).to_numpy()) for t in (run, again))
    for q in (0.5, 0.9):
        assert np.quantile(sim, q) == pytest.approx(np.quantile(real, q), rel=0.3), q
    assert transfer_scale(None).quantiles == (1.0,)  # no in-situ profile: the link's own time


def test_a_router_stall_counts_once_however_many_reports_it_held():
    """Two streams on one worker, a step every 0.5 ms, each report read 0.1 ms after its stamp,
    but for a 50 ms stall after which the router reads the 100 reports sent meanwhile within
    0.5 ms: one long read among the others, not a hundred (the simulator draws a delay a step,
    independently, so a hundred would stall a hundred steps spread over the run)."""
    stamps = np.arange(1000) * 0.0005
    receipts = stamps + 0.0001
    held = (stamps >= 0.2) & (stamps < 0.25)
    receipts[held] = 0.25 + np.arange(held.sum()) * 5e-6  # the catch-up, 5 us a read
    requests = pd.DataFrame({"token_times": [receipts, receipts], "token_worker_times": [stamps, stamps]})
    delays = report_delays(requests)
    assert len(delays) <= 999 - held.sum() + 1  # one read for the stall (a fresh report may join it)
    assert (delays > 0.01).sum() == 1 and delays.max() == pytest.approx(0.05, abs=1e-3)
    assert len(report_delays(requests, first=True)) == 1  # both streams' first token: one report


def test_a_run_spec_must_name_a_finished_run(tmp_path):
    with pytest.raises(ConfigError, match="not a finished run"):
        load_in_situ(f"run:{tmp_path}", "mixed")


def test_runs_pooled_by_a_glob_keep_each_run_apart(tmp_path):
    """run:<glob> fits on several runs: their workers and requests renumbered apart, so a
    worker's gaps are never taken across two runs."""
    for seed in (0, 1):
        simulate_point(
            make_config(
                *small_workload(30, 30.0),
                "mode=chunked",
                "cluster.num_workers=2",
                *DELAYS,
                "hardware=cpu",
                f"seed={seed}",
            ),
            tmp_path / f"run_r{seed}",
        )
    pooled = read_runs(f"run:{tmp_path / 'run_r*'}", "sim.profile")
    assert sorted(pooled["steps"]["worker"].unique()) == [0, 1, RUN_STRIDE, RUN_STRIDE + 1]
    assert pooled["requests"]["request_id"].is_unique and len(pooled["requests"]) == 60
    host = HostModel.from_dict(load_in_situ(f"run:{tmp_path / 'run_r*'}", "mixed")["host"], {})
    assert host.step_gap.median == pytest.approx(0.002, abs=1e-9)  # no gap spans two runs


def test_contention_in_phases_keeps_its_distribution_and_its_correlation():
    """Draws.contention: the measured distribution, with the lag-1 correlation it was given; and
    phase_correlation recovers that correlation from a worker's step times."""
    delay = Delay(tuple(np.linspace(0.8, 1.6, 101)))
    draws = Draws(3, rho=0.8)
    values = np.array([draws.contention(delay) for _ in range(20000)])
    assert np.median(values) == pytest.approx(delay.median, rel=0.03)
    logs = np.log(values)
    assert np.corrcoef(logs[:-1], logs[1:])[0, 1] == pytest.approx(0.8, abs=0.05)
    n = 3000  # a worker's steps, each its real / fitted time as drawn, listed out of time order
    order = np.random.default_rng(0).permutation(n)
    starts = np.cumsum(np.full(n, 0.01))[order]
    assert phase_correlation(np.zeros(n, int), starts, np.zeros(n, bool), values[:n][order]) == pytest.approx(
        0.8, abs=0.05
    )


def test_gaps_in_the_phase_keep_their_distribution_and_the_fit_recovers_their_share():
    """Draws.gap: a step gap's measured distribution, moving with the worker's contention phase at
    the share it was given (a request's gaps then do not average out over its decode); fit_gap_phase
    recovers that share from a run's steps, and finds none where gaps are independent."""
    scale, gaps = Delay(tuple(np.linspace(0.8, 1.6, 101))), Delay(tuple(np.linspace(1e-4, 5e-4, 101)))
    n, rho = 6000, 0.9

    def run(share: float) -> pd.DataFrame:
        draws, start, rows = Draws(5, rho=rho, gap_phase=share), 0.0, []
        for _ in range(n):
            seconds = 1e-3 * draws.contention(scale)
            rows.append(
                {
                    "worker": 0,
                    "start_s": start,
                    "end_s": start + seconds,
                    "num_waiting": 0,
                    "num_running": 1,
                    "prefill_tokens": 0,
                }
            )
            start += seconds + draws.gap(gaps)
        return pd.DataFrame(rows)

    steps = run(0.6)
    drawn = steps["start_s"].to_numpy()[1:] - steps["end_s"].to_numpy()[:-1]
    assert np.median(drawn) == pytest.approx(gaps.median, rel=0.05)
    assert np.percentile(drawn, 90) == pytest.approx(gaps.sample(0.9), rel=0.05)
    assert fit_gap_phase(steps, rho) == pytest.approx(0.6, abs=0.1)
    assert fit_gap_phase(run(0.0), rho) < 0.05 and fit_gap_phase(steps, 0.0) == 0.0


def test_one_stall_in_thousands_keeps_its_weight_when_sampled():
    """A gap of 0.26 s among 4,000 of 0.3 ms: drawn as often as measured (not spread over the top
    percent of draws), so the simulated mean gap stays the measured one; profiles written with
    101 evenly spaced quantiles still sample as they did."""
    measured = np.r_[np.full(3999, 0.0003), 0.263]
    delay = Delay.of(measured)
    rng = np.random.default_rng(0)
    draws = np.array([delay.sample(u) for u in rng.random(100_000)])
    assert abs(draws.mean() - measured.mean()) < 0.2 * measured.mean()
    assert (draws > 0.01).mean() < 0.001 and delay.quantiles[-1] == 0.263
    even = Delay(tuple(np.linspace(0.0, 1.0, 101)))  # a stored profile's layout before LEVELS
    assert even.sample(0.5) == pytest.approx(0.5) and even.sample(0.995) == pytest.approx(0.995)
