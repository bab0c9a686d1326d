"""Workload generation: arrival processes, lengths, sessions, tenants, presets, validation."""

from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from testbed.workload import LengthConfig, TenantConfig, WorkloadConfig, WorkloadError, arrivals, build_workload
from testbed.workload.lengths import sample_lengths
from testbed.workload.traces import resolve_trace_path
from tests.paths import ROOT

CONF = ROOT / "conf" / "workload"
TINY = dict(vocab_size=512, max_model_len=2048)


def build(seed=0, **fields):
    return build_workload(WorkloadConfig(**fields), seed=seed, **TINY)


# --- arrival processes -------------------------------------------------------------------------


@pytest.mark.parametrize("process", ["poisson", "gamma", "constant", "onoff"])
def test_mean_rate_within_3_percent(process):
    rate, n = 7.0, 20_000
    cfg = WorkloadConfig(arrival=process, rate=rate, burstiness=0.5, on_s=1.0, off_s=3.0)
    times = arrivals.synthetic(np.random.default_rng(1), n, cfg)
    assert np.all(np.diff(times) >= 0)
    assert abs(n / times[-1] - rate) / rate < 0.03


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gap_cv_is_one_over_sqrt_burstiness(burstiness):
    gaps = np.diff(arrivals.gamma(np.random.default_rng(2), 20_000, rate=5.0, burstiness=burstiness))
    cv = gaps.std() / gaps.mean()
    expected = 1 / np.sqrt(burstiness)
    assert abs(cv - expected) / expected < 0.05


def test_constant_arrivals_are_evenly_spaced():
    assert np.allclose(arrivals.constant(4, rate=2.0), [0.5, 1.0, 1.5, 2.0])


def test_onoff_leaves_off_windows_empty():
    times = arrivals.on_off(np.random.default_rng(3), 5000, rate=4.0, on_s=1.0, off_s=2.0)
    phase = np.mod(times, 3.0)
    assert np.all(phase <= 1.0 + 1e-9)


def test_ramp_rate_rises_then_holds():
    times = arrivals.ramp(np.random.default_rng(4), 20_000, start_rate=10.0, end_rate=30.0, ramp_s=100.0)
    # Expected counts: first 50 s: 10*50 + (20/100)*50^2/2 = 750; 50..100 s: 2000 - 750 = 1250.
    first, second = np.sum(times < 50), np.sum((times >= 50) & (times < 100))
    assert abs(first - 750) < 4 * np.sqrt(750)
    assert abs(second - 1250) < 4 * np.sqrt(1250)
    late = times[times > 100]
    assert abs(len(late) / (late[-1] - 100) - 30.0) / 30.0 < 0.03


def test_replay_speedup_compresses_time():
    assert np.allclose(arrivals.replay(np.array([0.0, 2.0, 6.0]), 2.0), [0.0, 1.0, 3.0])


# --- lengths -------------------------------------------------------------------------------------


def test_lengths_are_clipped_and_counted():
    values, clipped = sample_lengths(LengthConfig(dist="fixed", mean=500, min=1, max=100), 10, np.random.default_rng(0))
    assert list(values) == [100] * 10 and clipped == 10


@pytest.mark.parametrize("dist,mean", [("normal", 200), ("lognormal", 200), ("pareto", 200)])
def test_length_means(dist, mean):
    cfg = LengthConfig(dist=dist, mean=mean, std=20, sigma=0.5, alpha=3.0, min=1, max=100_000)
    values, _ = sample_lengths(cfg, 50_000, np.random.default_rng(0))
    assert abs(values.mean() - mean) / mean < 0.03


def test_zipf_and_empirical_stay_in_range():
    values, clipped = sample_lengths(
        LengthConfig(dist="zipf", alpha=1.2, min=10, max=50), 2000, np.random.default_rng(0)
    )
    assert values.min() >= 10 and values.max() <= 50 and clipped == 0
    assert np.mean(values == 10) > np.mean(values == 11) > np.mean(values == 30)
    values, _ = sample_lengths(
        LengthConfig(dist="empirical", values=[3, 7], min=1, max=10), 100, np.random.default_rng(0)
    )
    assert set(values) == {3, 7}


# --- build_workload ------------------------------------------------------------------------------


def test_same_seed_same_requests_and_other_seed_differs():
    a, b, c = build(seed=5), build(seed=5), build(seed=6)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_requests_are_sorted_valid_and_numbered():
    w = build(num_requests=50)
    assert [r.request_id for r in w.requests] == list(range(50))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(w.requests, w.requests[1:]))
    for r in w.requests:
        assert 100 <= r.input_len <= 300 and 16 <= r.output_len <= 64
        assert all(0 <= t < 512 for t in r.prompt_token_ids)


def test_duration_caps_arrivals_and_zero_requests_means_until_duration():
    w = build(num_requests=0, duration_s=5.0, rate=10.0)
    assert 25 < len(w.requests) < 80
    assert w.requests[-1].arrival_s <= 5.0


def test_overlength_clip_is_reported():
    w = build(
        num_requests=4,
        input_len=LengthConfig(dist="fixed", mean=2040, min=1, max=4096),
        output_len=LengthConfig(dist="fixed", mean=20, min=1, max=64),
    )
    assert all(r.input_len + r.output_len <= 2048 for r in w.requests)
    assert w.report["clipped_input"] == 4 and w.report["rejected"] == 0


def test_overlength_reject_is_reported_with_reason():
    w = build(
        num_requests=20,
        overlength="reject",
        input_len=LengthConfig(dist="uniform", min=1900, max=2100),
        output_len=LengthConfig(dist="fixed", mean=20, min=1, max=64),
    )
    assert w.report["rejected"] == len(w.rejected) > 0
    assert len(w.requests) + len(w.rejected) == 20
    request, reason = w.rejected[0]
    assert request.input_len + request.output_len > 2048 and "max_model_len" in reason


def test_sessions_next_turn_extends_history_after_think_time():
    w = build(num_requests=3, turns=3, think_time_s=0.5, system_prompt_len=40)
    first = w.requests[0]
    assert first.session_id == first.request_id and first.turn == 0
    # Every session starts with the same system prompt.
    assert len({r.prompt_token_ids[:40] for r in w.requests}) == 1
    output = list(range(first.output_len))
    second = w.next_turn(first, output, finished_s=10.0)
    assert second.prompt_token_ids[: first.input_len + len(output)] == first.prompt_token_ids + tuple(output)
    assert second.input_len > first.input_len + len(output)
    assert second.arrival_s == pytest.approx(10.5)
    assert second.turn == 1 and second.session_id == first.session_id
    assert second.request_id not in {r.request_id for r in w.requests}
    assert second == build(num_requests=3, turns=3, think_time_s=0.5, system_prompt_len=40).next_turn(
        first, output, 10.0
    )
    third = w.next_turn(second, [1], finished_s=20.0)
    assert third.turn == 2 and w.next_turn(third, [1], finished_s=30.0) is None


def test_session_that_outgrows_the_model_ends():
    w = build(num_requests=1, turns=5, input_len=LengthConfig(dist="fixed", mean=700, min=1, max=2048))
    first = w.requests[0]
    second = w.next_turn(first, [0] * first.output_len, 1.0)
    assert w.next_turn(second, [0] * second.output_len, 2.0) is None
    assert w.report["sessions_ended_overlength"] == 1


def test_tenants_get_their_shares_and_lengths():
    w = build(
        num_requests=400,
        tenants=[
            TenantConfig(name="chat", weight=3, input_len=LengthConfig(dist="fixed", mean=50, min=1, max=64)),
            TenantConfig(name="batch", weight=1, input_len=LengthConfig(dist="fixed", mean=900, min=1, max=1000)),
        ],
    )
    chat = [r for r in w.requests if r.tenant == "chat"]
    batch = [r for r in w.requests if r.tenant == "batch"]
    assert abs(len(chat) / 400 - 0.75) < 0.07
    assert {r.input_len for r in chat} == {50} and {r.input_len for r in batch} == {900}


@pytest.mark.parametrize(
    "fields,key",
    [
        (dict(rate=-1.0), "workload.rate must be > 0 (got -1.0)"),
        (dict(rate=0.0), "workload.rate must be > 0"),
        (dict(arrival="weibull"), "workload.arrival must be one of"),
        (dict(input_len=LengthConfig(min=-5)), "workload.input_len.min must be >= 1"),
        (dict(output_len=LengthConfig(dist="fixed", mean=-3)), "workload.output_len.mean must be > 0"),
        (dict(overlength="truncate"), "workload.overlength must be one of clip, reject"),
        (dict(arrival="trace"), "workload.path must name a trace file"),
        (dict(path="no_such_trace.csv", arrival="trace"), "trace file 'no_such_trace.csv' not found"),
        (dict(turns=0), "workload.turns must be >= 1"),
    ],
)
def test_bad_input_is_a_one_line_workload_error(fields, key):
    with pytest.raises(WorkloadError) as info:
        build(**fields)
    assert key in str(info.value) and "\n" not in str(info.value)


# --- presets ---------------------------------------------------------------------------------------


def preset_files():
    return sorted(CONF.glob("*.yaml"))


def test_required_presets_exist():
    names = {p.stem for p in preset_files()}
    assert {"poisson", "bursty", "azure_conv", "azure_code", "mooncake_conv", "multiturn", "mixed_tenants"} <= names


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: p.stem)
def test_preset_merges_onto_schema_and_builds_tiny(path):
    merged = OmegaConf.merge(OmegaConf.structured(WorkloadConfig), OmegaConf.load(path))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, WorkloadConfig) and cfg.name == path.stem
    if cfg.path:
        resolve_trace_path(cfg.path)  # the bundled slice at least: a preset's trace is always there
    cfg = replace(cfg, num_requests=min(cfg.num_requests, 40) or 40)
    w = build_workload(cfg, seed=0, **TINY)
    assert len(w.requests) > 0
    assert all(r.input_len + r.output_len <= 2048 for r in w.requests)
    assert all(max(r.prompt_token_ids) < 512 for r in w.requests)
