"""Stated uncertainty and honest attainment: intervals, the best-configuration verdict, and
admission refusals counted as misses."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from testbed.metrics import RequestLog, SLOConfig, slo_attainment, summarize
from testbed.metrics.uncertainty import (bootstrap_interval, overlaps, point_intervals, ratio_interval,
                                         repeat_interval, verdict)


def req(i, arrival, tenant="default"):
    return SimpleNamespace(request_id=i, arrival_s=arrival, input_len=10, output_len=2, session_id=None, turn=0,
                           tenant=tenant)


def served_log(n_ok: int, n_refused: int, n_filtered: int = 0) -> RequestLog:
    """n_ok requests meeting any sane SLO, n_refused refused by admission, n_filtered overlength."""
    log = RequestLog(0.0)
    for i in range(n_ok):
        log.register(req(i, 0.1 * i))
        log.tokens(i, [1], 0.1 * i + 0.01, 0.1 * i + 0.01)
        log.tokens(i, [2], 0.1 * i + 0.02, 0.1 * i + 0.02)
        log.finish(i, 0.1 * i + 0.02)
    for j in range(n_refused):
        log.reject(req(n_ok + j, 0.05), 0.05, "5 requests outstanding (cluster.max_outstanding=2)", by="admission")
    for k in range(n_filtered):
        log.reject(req(n_ok + n_refused + k, 0.05), 0.05, "overlength", by="workload")
    return log


def test_admission_refusals_are_misses_but_the_overlength_filter_is_not():
    """Shedding load must not look good: 4 served in SLO + 4 refused by admission = 0.5, not 1.0;
    the workload's own overlength filter (the same in every mode) stays out, as a count."""
    slo = SLOConfig(ttft_s=1.0, tpot_s=1.0)
    table = served_log(4, 4, 2).table()
    assert slo_attainment(table, slo) == pytest.approx(0.5)
    summary = summarize(table, slo=slo)
    assert summary["num_requests"]["refused"] == 4 and summary["num_requests"]["rejected"] == 2
    assert set(table.loc[table.status == "rejected", "refused_by"]) == {"admission", "workload"}


def test_reject_names_who_refused():
    with pytest.raises(ValueError, match="admission"):
        RequestLog(0.0).reject(req(0, 0.0), 0.0, "x", by="router")


def test_bootstrap_interval_covers_the_estimate_and_narrows_with_samples():
    rng = np.random.default_rng(0)
    small, large = rng.exponential(size=50), rng.exponential(size=5000)
    lo_s, hi_s = bootstrap_interval(small, "p50")
    lo_l, hi_l = bootstrap_interval(large, "p50")
    assert lo_s <= np.percentile(small, 50) <= hi_s and lo_l <= np.percentile(large, 50) <= hi_l
    assert hi_l - lo_l < hi_s - lo_s
    assert all(math.isnan(v) for v in bootstrap_interval([1.0], "p99"))
    assert bootstrap_interval([2.0, 2.0, 2.0], "p99") == (2.0, 2.0)


def test_point_intervals_hold_the_pooled_estimate():
    table = served_log(30, 10).table()
    out = point_intervals(table, SLOConfig(ttft_s=1.0, tpot_s=1.0))
    estimate, low, high = out["slo_attainment"]
    assert estimate == pytest.approx(0.75) and low <= estimate <= high and high - low > 0
    for figure in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p99"):
        e, lo, hi = out[figure]
        assert lo <= e + 1e-12 and e <= hi + 1e-12


def test_repeat_interval_is_students_t_and_clipped():
    mean, low, high = repeat_interval([1.0, 2.0, 3.0])
    # t(0.975, 2) = 4.303, s = 1, n = 3: half width 4.303 / sqrt(3) = 2.484
    assert mean == 2.0 and low == pytest.approx(2.0 - 2.4843, abs=1e-3) and high == pytest.approx(4.4843, abs=1e-3)
    assert repeat_interval([1.0, 2.0, 3.0], bounds=(0.0, 3.5))[1:] == pytest.approx((0.0, 3.5))
    assert math.isnan(repeat_interval([5.0])[1])


def test_verdict_names_a_winner_only_when_its_interval_clears_the_runner_up():
    clear = verdict({"2P2D": (10.0, 9.0, 11.0), "3P1D": (7.0, 6.0, 8.0), "chunked": (3.0, 2.0, 4.0)})
    assert clear["separated"] and clear["label"] == "2P2D" and "best configuration: 2P2D" in clear["line"]
    tied = verdict({"2P2D": (10.0, 8.0, 12.0), "3P1D": (9.0, 7.5, 10.5), "chunked": (3.0, 2.0, 4.0)})
    assert not tied["separated"] and "not separated" in tied["line"]
    assert "2P2D" in tied["line"] and "3P1D" in tied["line"] and "chunked" not in tied["line"]
    single = verdict({"a": (1.0, math.nan, math.nan), "b": (0.5, math.nan, math.nan)})
    assert not single["separated"] and "no interval" in single["line"]
    assert overlaps((1, 2), (2, 3)) and not overlaps((1, 2), (2.5, 3))


def test_ratio_interval_brackets_a_real_difference():
    rng = np.random.default_rng(1)
    slow, fast = rng.normal(2.0, 0.1, 400), rng.normal(1.0, 0.05, 400)
    estimate, low, high = ratio_interval(slow, fast)
    assert 1.5 < low <= estimate <= high < 2.6
    assert all(math.isnan(v) for v in ratio_interval([], fast))


@pytest.mark.parametrize("statistic,q", [("p50", 50), ("p99", 99)])
def test_exact_quantile_bootstrap_matches_scipy_resampling(statistic, q):
    """The percentile interval computed from the exact bootstrap distribution agrees with scipy's
    resampling bootstrap (20,000 resamples) to within the resampling noise."""
    from scipy import stats

    x = np.random.default_rng(3).exponential(size=300)
    reference = stats.bootstrap((x,), lambda v, axis=-1: np.percentile(v, q, axis=axis), n_resamples=20000,
                                method="percentile", vectorized=True, random_state=np.random.default_rng(4))
    low, high = bootstrap_interval(x, statistic)
    width = reference.confidence_interval.high - reference.confidence_interval.low
    assert low == pytest.approx(reference.confidence_interval.low, abs=0.05 * width)
    assert high == pytest.approx(reference.confidence_interval.high, abs=0.05 * width)
