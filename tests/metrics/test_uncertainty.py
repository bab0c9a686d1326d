"""Stated uncertainty and honest attainment: intervals, the best-configuration verdict, and
admission refusals counted as misses."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from testbed.metrics import RequestLog, SLOConfig, slo_attainment, summarize
from testbed.metrics.comparisons import comparison_lines, repeats_to_separate, verdict
from testbed.metrics.rate_search import ABOVE, BELOW, Goodput, RateSearch, goodput_of, next_rate
from testbed.metrics.uncertainty import (
    estimable,
    mean_interval,
    order_interval,
    overlaps,
    point_intervals,
    ratio_interval,
    request_units,
    sample_interval,
    share_interval,
)


def req(i, arrival, tenant="default"):
    return SimpleNamespace(
        request_id=i, arrival_s=arrival, input_len=10, output_len=2, session_id=None, turn=0, tenant=tenant
    )


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


def test_mean_interval_is_students_t_over_the_units_and_clipped():
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    # t(0.975, 2) = 4.303, s = 1, n = 3: half width 4.303 / sqrt(3) = 2.484 (the jackknife of a mean)
    assert mean == 2.0 and low == pytest.approx(2.0 - 2.4843, abs=1e-3) and high == pytest.approx(4.4843, abs=1e-3)
    assert tuple(mean_interval([1.0, 2.0, 3.0], bounds=(0.0, 3.5)))[1:] == pytest.approx((0.0, 3.5))
    one = mean_interval([5.0])
    assert math.isnan(one.low) and one.note == "one unit"


def test_a_pooled_percentile_varies_whole_runs_not_requests():
    """Three runs whose medians differ: the interval spans the run-to-run spread, where resampling
    the 3000 values as if independent would give a band a few hundredths wide."""
    rng = np.random.default_rng(0)
    runs = [rng.normal(centre, 0.1, 1000) for centre in (1.0, 1.5, 2.0)]
    interval = sample_interval(runs, "p50")
    assert interval.estimate == pytest.approx(np.percentile(np.concatenate(runs), 50))
    assert interval.low < 1.1 and interval.high > 1.9 and interval.units == 3


def test_a_tail_too_thin_to_bound_is_marked_not_narrowed():
    """p99 needs 368 values before even independent ones bound it at 95%: 300 give no interval."""
    assert not estimable(300, "p99") and estimable(368, "p99") and estimable(6, "p50") and not estimable(5, "p50")
    rng = np.random.default_rng(1)
    thin = sample_interval([rng.exponential(size=100) for _ in range(3)], "p99")
    assert thin.note == "not estimable" and math.isnan(thin.low) and not math.isnan(thin.estimate)


def test_order_interval_is_the_binomial_bound_and_may_exceed_no_sample():
    x = np.arange(1.0, 1001.0)  # the q-quantile of 1000 values near rank 1000 q
    low, high = order_interval(x, 0.5)
    assert 468 <= low <= 500 <= high <= 532
    low, high = order_interval(x, 0.99)
    assert 980 <= low <= 990 <= high <= 1000


def test_runs_that_agree_still_get_the_order_statistics_width():
    """Three identical runs: the jackknife alone would give a zero-width p99; the order statistics do not."""
    run = np.random.default_rng(2).exponential(size=400)
    interval = sample_interval([run, run, run], "p99")
    assert interval.high > interval.low


def test_attainment_of_every_request_is_not_known_to_be_exactly_one():
    interval = share_interval([np.ones(60), np.ones(60), np.ones(60)])
    assert interval.estimate == 1.0 and interval.high == 1.0 and 0.95 < interval.low < 0.99


def test_a_single_run_is_cut_into_arrival_ordered_batches():
    table = served_log(30, 0).table()
    units = request_units(table)
    assert len(units) == 5 and sum(len(u) for u in units) == 30
    assert all(u["arrival_s"].max() <= v["arrival_s"].min() for u, v in zip(units, units[1:]))


def test_point_intervals_hold_the_pooled_estimate():
    table = served_log(30, 10).table()
    out = point_intervals(table, SLOConfig(ttft_s=1.0, tpot_s=1.0))
    estimate, low, high = out["slo_attainment"]
    assert estimate == pytest.approx(0.75) and low <= estimate <= high and high - low > 0
    for figure in ("ttft_p50", "tpot_p50", "itl_p50"):
        e, lo, hi = out[figure]
        assert lo <= e + 1e-12 and e <= hi + 1e-12
    assert out["ttft_p99"].note == "not estimable"


def test_jackknife_of_a_ratio_pairs_the_runs():
    rng = np.random.default_rng(1)
    slow = [rng.normal(2.0, 0.1, 400) for _ in range(4)]
    fast = [rng.normal(1.0, 0.05, 400) for _ in range(4)]
    estimate, low, high = ratio_interval(slow, fast, "p50")
    assert 1.8 < low <= estimate <= high < 2.2
    assert all(math.isnan(v) for v in tuple(ratio_interval([np.array([])], [fast[0]], "p50"))[1:])


def per_seed(values, censored=""):
    return {seed: Goodput(v, censored) for seed, v in enumerate(values)}


def test_paired_differences_separate_what_overlapping_intervals_cannot():
    """Common random numbers: B trails A by 0.5 on every seed though the seeds spread by 4."""
    a = per_seed([10.0, 12.0, 14.0, 11.0])
    b = per_seed([9.5, 11.5, 13.4, 10.5])
    assert overlaps(
        tuple(mean_interval(list(g.value for g in a.values())))[1:],
        tuple(mean_interval(list(g.value for g in b.values())))[1:],
    )
    chosen = verdict({"A": a, "B": b})
    assert chosen["separated"] and chosen["label"] == "A" and "best configuration: A" in chosen["line"]
    assert chosen["comparisons"][0]["difference_low"] > 0


def test_no_winner_when_the_paired_difference_holds_zero_and_the_repeats_needed_are_said():
    a, b = per_seed([10.0, 12.0, 11.0]), per_seed([10.5, 11.0, 10.8])
    chosen = verdict({"A": a, "B": b})
    assert not chosen["separated"] and "not separated" in chosen["line"]
    row = chosen["comparisons"][0]
    assert row["repeats_needed"] is None or row["repeats_needed"] > 3
    assert "not separated" in "\n".join(comparison_lines(chosen["comparisons"]))
    # the spread at its 90% upper bound (0.62, not 0.2) and 80% power: 6 repeats, not the 3 that
    # plugging in the observed spread gives (a coin flip's power)
    assert repeats_to_separate(np.array([1.0, 1.2, 0.8])) == 6
    assert repeats_to_separate(np.array([1.0, 1.2, 0.8]), error=1.0) is None  # the search error eats the lead
    assert (
        repeats_to_separate(np.array([0.1, -0.1, 0.05])) is None
        or repeats_to_separate(np.array([0.1, -0.1, 0.05])) > 10
    )


def test_a_censored_goodput_takes_part_only_where_its_bound_points_the_claims_way():
    leader_bound = verdict({"A": per_seed([20.0, 20.0, 20.0], ABOVE), "B": per_seed([10.0, 11.0, 9.0])})
    assert leader_bound["separated"]  # A >= 20 beats B's exact values whatever A truly is
    runner_bound = verdict({"A": per_seed([20.0, 21.0, 19.0]), "B": per_seed([10.0, 10.0, 10.0], ABOVE)})
    assert not runner_bound["separated"]  # B >= 10 could be anything above: no claim


def test_no_verdict_is_separated_unless_it_outlasts_both_search_errors():
    """A lead of 1.0 on every seed is separated by the spread alone, but each side's crossing is
    known only to within 0.6: widened by both errors (1.2) the interval holds zero."""
    exact = verdict({"A": per_seed([11.0, 12.0, 13.1]), "B": per_seed([10.0, 11.0, 12.0])})
    assert exact["separated"]
    loose = {
        "A": {s: Goodput(v, "", 0.6) for s, v in enumerate([11.0, 12.0, 13.1])},
        "B": {s: Goodput(v, "", 0.6) for s, v in enumerate([10.0, 11.0, 12.0])},
    }
    chosen = verdict(loose)
    row = chosen["comparisons"][0]
    assert not chosen["separated"] and row["difference_low"] < 0 < row["difference"]
    assert row["repeats_needed"] is None and row["detectable"] > 1.2 and row["search_error"] == pytest.approx(1.2)


def test_the_search_error_of_every_repeat_reaches_the_verdict_from_the_aggregate():
    """goodput_by_label keeps each repeat's error; per_seed hands it to the paired verdict
    (it once rebuilt each repeat's goodput with no error, so the verdict widened by zero)."""
    from testbed.studies.aggregates import best_of

    goodputs = {
        label: {
            "num_gpus": 2,
            "seeds": [0, 1, 2],
            "goodput_per_repeat": values,
            "censoring_per_repeat": ["", "", ""],
            "error_per_repeat": [1.2, 1.2, 1.2],
            "goodput_per_gpu": float(np.mean(values)) / 2,
        }
        for label, values in (("A", [22.0, 24.0, 26.2]), ("B", [20.0, 22.0, 24.0]))
    }
    best = best_of(goodputs)
    assert not best["separated"], best["comparisons"]
    assert best["comparisons"][0]["difference_low"] < 0


def test_a_censored_leaders_lead_prints_as_a_bound():
    chosen = verdict({"A": per_seed([20.0, 20.0, 20.0], ABOVE), "B": per_seed([10.0, 11.0, 9.0])})
    text = "\n".join(comparison_lines(chosen["comparisons"])) + chosen["line"]
    assert ">= " in text and "[" not in text.splitlines()[1]


def test_the_monotone_fit_pools_a_noisy_rise_and_reports_a_real_one():
    from testbed.metrics.rate_search import monotone_fit

    curve = monotone_fit([10, 20, 30, 40], [1.0, 0.88, 0.92, 0.3], [100, 100, 100, 100])
    assert np.all(np.diff(curve.fitted) <= 0) and curve.fitted[1] == pytest.approx(0.90)
    assert curve.monotone  # 0.88 -> 0.92 over 100 requests each is noise
    assert not monotone_fit([10, 20, 30], [0.95, 0.3, 0.95], [200, 200, 200]).monotone
    g = goodput_of([10, 20, 30, 40], [1.0, 0.88, 0.92, 0.3], weights=[100, 100, 100, 100])
    assert 30 <= g.value <= 40 and g.monotone  # the pooled block passes at 30
    assert not goodput_of([10, 20, 30], [0.95, 0.3, 0.95], weights=[200] * 3).monotone


@pytest.mark.parametrize("shape", ["cliff", "linear", "logistic"])
def test_the_search_reaches_its_tolerance_within_five_points_from_a_wide_grid(shape):
    """From a grid of 25 and 100 req/s, five points bring the search error within 8% of the
    goodput whatever the curve's shape (bisection alone leaves about 15% on a cliff)."""
    truth = 61.0
    curves = {
        "cliff": lambda r: 1.0 if r <= truth else 0.3,
        "linear": lambda r: min(1.0, max(0.0, 0.9 - (r - truth) / 80)),
        "logistic": lambda r: 1 / (1 + math.exp((r - truth) / 6 - math.log(9))),
    }
    f = curves[shape]
    search = RateSearch(budget=5, tolerance=0.08, floor=3, cap=800)
    rates = [25.0, 100.0]
    found = [f(r) for r in rates]
    used = 0
    while (rate := next_rate(rates, found, search, used)) is not None:
        rates.append(rate)
        found.append(f(rate))
        used += 1
    g = goodput_of(rates, found)
    assert not g.censored and abs(g.value - truth) <= g.error + 1e-9
    assert g.error <= 0.08 * g.value, (shape, rates, g)


def test_goodput_of_interpolates_and_states_bounds():
    g = goodput_of([2, 4, 8], [1.0, 0.95, 0.5])
    assert g.value == pytest.approx(4 + 0.05 / 0.45 * 4) and not g.censored
    assert g.error == pytest.approx(max(g.value - 4, 8 - g.value))
    assert goodput_of([2, 4, 8], [1.0, 1.0, 0.95]) == Goodput(8.0, ABOVE)
    assert goodput_of([2, 4, 8], [0.5, 0.2, 0.1]) == Goodput(2.0, BELOW)
    assert Goodput(8.0, ABOVE).text() == ">= 8" and Goodput(2.0, BELOW).text() == "< 2"


def test_rate_search_brackets_then_bisects_within_its_budget():
    search = RateSearch(budget=6, tolerance=0.1, floor=0.5, cap=64)
    truth = 11.0  # attainment falls below 90% past this rate
    rates, found = [2.0, 4.0], []
    found = [1.0 if r <= truth else 0.5 for r in rates]
    used = 0
    while (rate := next_rate(rates, found, search, used)) is not None:
        rates.append(rate)
        found.append(1.0 if rate <= truth else 0.5)
        used += 1
    g = goodput_of(rates, found)
    assert used <= 6 and not g.censored and abs(g.value - truth) <= g.error + 1e-9
    assert rates[2:4] == [8.0, 16.0]  # doubled until a rate failed, then narrowed
    capped = RateSearch(budget=6, tolerance=0.1, floor=0.5, cap=10)
    assert next_rate([4.0, 8.0], [1.0, 1.0], capped, 0) is None  # 16 is past the cap: a bound
    assert next_rate([1.0], [0.2], RateSearch(floor=0.6), 0) is None  # 0.5 is under the floor


def test_points_run_repeat_by_repeat_so_drift_does_not_line_up_with_a_configuration():
    from types import SimpleNamespace

    from testbed.studies.repeats import with_repeats
    from testbed.studies.sweep import Point

    cfg = SimpleNamespace(seed=7, experiment=SimpleNamespace(repeats=3))
    points = [Point(n, {"mode": "colocated"}, {"label": n}) for n in ("A", "B")]
    order = [(p.knobs["label"], p.knobs["seed"]) for p in with_repeats(points, cfg)]
    assert order == [("A", 7), ("B", 7), ("A", 8), ("B", 8), ("A", 9), ("B", 9)]
    # a point that reads another's results keeps its builder's order (its inputs run first)
    reading = [
        Point("real", {}, {"label": "real"}),
        Point("sim", {"sim.profile": "run:{points}/real_r*"}, {"label": "sim"}),
    ]
    assert [p.name for p in with_repeats(reading, cfg)] == [
        "real_r0",
        "real_r1",
        "real_r2",
        "sim_r0",
        "sim_r1",
        "sim_r2",
    ]
