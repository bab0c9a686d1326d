"""The figures show exactly what the saved results say: every figure function is drawn from the
results the tool itself produced (the `study_results` fixture, one repeat per point, and
`repeated_results`, two) and its plotted data, bounds included, is held to sweep.json's
aggregate, intervals.parquet and the points' request tables; the artists drawn are held to the
plotted data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from analysis import bounds, captions, figures, style, system
from analysis.__main__ import main as cli
from analysis.load import Sweep, by_label, load_run, load_runs, load_sweep, served
from analysis.plotted import dumps
from analysis.standard_figures import draw, run_figures, run_telemetry, study_figures, ttft_by_turn
from testbed.metrics.config import MetricsConfig
from testbed.metrics.interference import background_gaps, injection_window
from testbed.metrics.latency import pooled_itl
from testbed.metrics.summary import measured
from testbed.metrics.uncertainty import mean_interval
from testbed.studies.catalog import STUDIES
from tests.figure_checks import check_study

pytestmark = pytest.mark.slow
MS = 1e3
DRAWN = {s.name: s.figures for s in STUDIES if s.figures}  # study -> the figures it draws


def close(a, b) -> bool:
    return np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-9, atol=1e-12, equal_nan=True)


def lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def segments(ax, name: str) -> np.ndarray:
    """The error bars drawn for `name`: one [[x0, y0], [x1, y1]] per bar with both bounds known
    (a figure the runs cannot bound, e.g. a p99 of a few requests, gets none)."""
    drawn = bounds.drawn(ax, name)
    if not drawn:
        return np.empty((0, 2, 2))
    (lines,) = drawn
    return np.array(lines.get_segments())


def known(pairs) -> np.ndarray:
    """The [low, high] pairs whose bounds are both known, as the figure draws them."""
    pairs = np.asarray(pairs, dtype=float).reshape(-1, 2)
    return pairs[np.isfinite(pairs).all(axis=1)]


def band_vertices(ax, name: str) -> set:
    (shade,) = bounds.drawn(ax, name)
    return {tuple(v) for path in shade.get_paths() for v in path.vertices}


def assert_band(ax, name: str, x, low, high) -> None:
    """The shaded band runs through every known (x, low) and (x, high); none is drawn where no
    bound is known."""
    known = np.isfinite(low) & np.isfinite(high)
    if not known.any():
        assert not bounds.drawn(ax, name)
        return
    vertices = band_vertices(ax, name)
    for xi, lo, hi in zip(np.asarray(x)[known], np.asarray(low)[known], np.asarray(high)[known]):
        assert (xi, lo) in vertices and (xi, hi) in vertices, (name, xi, lo, hi)


@pytest.fixture(scope="module")
def sweeps(study_results):
    return {name: load_sweep(path) for name, path in study_results.items() if name in DRAWN}


@pytest.fixture(scope="module")
def repeated(repeated_results):
    return load_sweep(repeated_results)


def test_load_sweep_cells_and_runs(sweeps, study_results, repeated):
    sweep = sweeps["ratio_sweep"]
    assert sweep.experiment == "ratio_sweep"
    assert close(sweep.table["ttft_p99"], pd.read_parquet(study_results["ratio_sweep"] / "sweep.parquet")["ttft_p99"])
    pd.testing.assert_frame_equal(sweep.cells(), pd.read_parquet(study_results["ratio_sweep"] / "intervals.parquet"))
    requests = sweep.requests()
    for row in sweep.finished().itertuples():
        rows = requests[requests["point"] == row.point]
        assert len(rows) == row.num_requests_ok
        assert set(rows["label"]) == {row.label} and set(rows["cell"]) == {row.cell}
    point = sweep.finished()["point"].iloc[0]
    assert set(load_runs([sweep.point_dir(point)])["point"]) == {point}
    assert load_run(sweep.point_dir(point))["summary"]["num_requests"]["ok"] == len(sweep.requests([point]))
    cells = repeated.cells()
    assert set(cells["repeats"]) == {2} and len(cells) * 2 == len(repeated.finished())
    summary = repeated.summary("slo_attainment", "ttft_p99")
    assert list(summary.columns[-6:]) == [
        "slo_attainment",
        "slo_attainment_low",
        "slo_attainment_high",
        "ttft_p99",
        "ttft_p99_low",
        "ttft_p99_high",
    ]


def test_cells_of_a_sweep_saved_without_intervals(repeated_results, tmp_path):
    """Interrupted before intervals.parquet, or written before repeats: cells without bounds."""
    copy = tmp_path / "interrupted"
    shutil.copytree(repeated_results, copy)
    (copy / "intervals.parquet").unlink()
    sweep = load_sweep(copy)
    cells = sweep.cells()
    assert set(cells["repeats"]) == {2} and not any(c.endswith("_low") for c in cells.columns)
    for cell, rows in sweep.finished().groupby("cell"):
        assert close(cells.set_index("cell").loc[cell, "slo_attainment"], rows["slo_attainment"].mean())
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, cells)
    for label, line in plotted.items():
        assert np.isnan(line["low"]).all() and not bounds.drawn(ax, f"{label}:slo_attainment")
    grid = sweep.table[sweep.table["stage"].fillna("grid") != "search"]
    old = grid.drop(columns=["cell", "repeat", "seed", "stage"])  # a sweep from before repeats and searches
    cells = Sweep(copy, "ratio_sweep", old).cells()
    assert list(cells["cell"]) == list(old["point"]) and set(cells["repeats"]) == {1}
    assert [stem for stem, *_ in draw("ratio_sweep", Sweep(copy, "ratio_sweep", old, sweep.aggregate))]


def test_every_figure_plots_the_saved_results(sweeps, study_results, repeated, repeated_results):
    runs = [(name, sweep, study_results[name]) for name, sweep in sweeps.items()]
    for name, sweep, directory in [*runs, ("ratio_sweep", repeated, repeated_results)]:
        with style.paper():
            plotted = {stem: data for stem, _, _, data in draw(name, sweep)}
        assert len(check_study(plotted, directory)) >= len(DRAWN[name]) - 1, name  # no telemetry on CPU
        check_study(json.loads(dumps(plotted)), directory)  # what a notebook prints reads back the same


def test_figure_checks_catch_a_wrong_bound(repeated, repeated_results):
    plotted = {stem: data for stem, _, _, data in draw("ratio_sweep", repeated)}
    wrong = json.loads(dumps(plotted))
    label = next(iter(wrong["latency_vs_rate"]["ttft"]["p50"]))
    assert np.isfinite(wrong["latency_vs_rate"]["ttft"]["p50"][label]["high"][0])
    wrong["latency_vs_rate"]["ttft"]["p50"][label]["high"][0] *= 1 + 1e-6
    with pytest.raises(AssertionError, match="high"):
        check_study(wrong, repeated_results)


def test_goodput_bars_carry_their_intervals_and_the_verdict(repeated):
    goodputs = repeated.aggregate["goodput"]
    fig, ax = style.figure()
    plotted = figures.goodput_by_split(ax, goodputs)
    splits = [label for label in plotted if style.split_of(label)]
    heights = [p.get_height() for p in ax.patches if p.get_gid() is None]  # the bars, not the baselines' bands
    assert heights == [plotted[s]["goodput_per_gpu"] for s in splits]
    widths = []
    for label, g in goodputs.items():
        assert close(
            [plotted[label][k] for k in ("goodput_per_gpu", "low", "high")],
            [g["goodput_per_gpu"], g["goodput_per_gpu_low"], g["goodput_per_gpu_high"]],
        )
        if label in splits:
            (bar,) = segments(ax, label)
            assert close(bar[:, 1], [g["goodput_per_gpu_low"], g["goodput_per_gpu_high"]])
        else:
            (shade,) = bounds.drawn(ax, label)  # the baseline's interval: a band across the axes
            assert close(
                [shade.get_y(), shade.get_y() + shade.get_height()],
                [g["goodput_per_gpu_low"], g["goodput_per_gpu_high"]],
            )
        widths.append(g["goodput_per_gpu_high"] - g["goodput_per_gpu_low"])
    assert max(widths) > 0  # the repeats disagree somewhere: the bars are not decoration
    text = captions.goodput_per_gpu(plotted, repeated.aggregate["best"])
    assert repeated.aggregate["best"]["line"] in text
    assert all(
        f"{label} {captions.rate(v['goodput_per_gpu'], v['low'], v['high'])}" in text for label, v in plotted.items()
    )


def test_attainment_vs_rate_bands_and_goodput_interval(repeated):
    cells, goodputs = repeated.cells(), repeated.aggregate["goodput"]
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, cells, goodputs)
    lines = lines_by_label(ax)
    for label, rows in cells.groupby("label"):
        rows, line = rows.sort_values("rate"), plotted[label]
        assert close(lines[label].get_xdata(), rows["rate"]) and close(lines[label].get_ydata(), rows["slo_attainment"])
        assert_band(ax, f"{label}:slo_attainment", rows["rate"], *bounds.column_bounds(rows, "slo_attainment"))
        g = goodputs[label]
        assert close(
            [line["goodput"], line["goodput_low"], line["goodput_high"]],
            [g["goodput"], g["goodput_low"], g["goodput_high"]],
        )
        if g["goodput"] > 0:  # the star's interval lies on the threshold line
            (bar,) = segments(ax, f"{label}:goodput")
            assert close(bar, [[g["goodput_low"], 0.9], [g["goodput_high"], 0.9]])
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert sorted(s.get_xdata()[0] for s in stars) == sorted(p["goodput"] for p in plotted.values() if p["goodput"] > 0)


def test_the_attainment_curve_goes_through_every_point_grid_and_search(repeated):
    """A paper's attainment figure: every rate each repeat tried as a dot, the monotone fit of
    them all as the line through the 90% line, the grid cells' intervals as error bars."""
    from testbed.metrics.rate_search import monotone_fit

    points, cells = repeated.searched(), repeated.cells()
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, cells, repeated.aggregate["goodput"], points=points)
    lines = lines_by_label(ax)
    for label, rows in points.groupby("label"):
        line = plotted[label]
        weights = (rows["num_requests_total"] - rows["num_requests_rejected"]).to_numpy(float)
        curve = monotone_fit(rows["rate"], rows["slo_attainment"], weights)
        assert close(lines[label].get_xdata(), curve.rates) and close(lines[label].get_ydata(), curve.fitted)
        assert sorted(line["points_rate"]) == sorted(rows["rate"]) and len(line["points_rate"]) > len(line["grid_rate"])
        grid = cells[cells["label"] == label].sort_values("rate")
        bars = segments(ax, f"{label}:slo_attainment")  # vertical, at the grid's rates
        known = grid["slo_attainment_low"].notna().to_numpy()
        assert close(bars[:, 0, 0], grid["rate"][known]) and close(bars[:, 0, 1], grid["slo_attainment_low"][known])
    assert any(s.get_marker() == "*" for s in ax.get_lines())


def test_latency_vs_rate_draws_cells_and_bands(sweeps):
    cells = sweeps["rate_sweep"].cells()
    fig, ax = style.figure()
    plotted = figures.latency_vs_rate(ax, cells, "tpot")
    drawn = [(tuple(line.get_xdata()), tuple(line.get_ydata())) for line in ax.get_lines()]
    for p in ("p50", "p99"):
        for label, rows in cells.groupby("label"):
            rows, line = rows.sort_values("rate"), plotted[p][label]
            assert close(line["x"], rows["rate"]) and close(line["y"], rows[f"tpot_{p}"] * MS)
            assert close(line["low"], rows[f"tpot_{p}_low"] * MS) and close(line["high"], rows[f"tpot_{p}_high"] * MS)
            assert (tuple(line["x"]), tuple(line["y"])) in drawn
            assert_band(ax, f"{label}:tpot_{p}", line["x"], line["low"], line["high"])
    text = captions.latency_vs_rate(plotted, "tpot", sweeps["rate_sweep"].finished())
    assert "lowest p99 TPOT" in text and "seed" in text  # the leader from the paired per-seed verdict only


def test_cdfs_match_summaries(sweeps):
    sweep = sweeps["mode_compare"]
    table = sweep.finished().set_index("label")
    fig, axes = style.figure("double", cols=2)
    ttft = figures.ttft_cdf(axes[0], sweep.requests())
    itl = figures.itl_cdf(axes[1], by_label(sweep.itls(), sweep.finished()))
    for label, row in table.iterrows():
        for plotted, metric, ax in ((ttft, "ttft", axes[0]), (itl, "itl", axes[1])):
            x, y = plotted[label]
            assert close(lines_by_label(ax)[label].get_xdata(), x) and y[-1] == 1.0
            for p in (50, 99):  # the CDF's own percentiles are the summary's
                assert close(np.percentile(x / MS, p), row[f"{metric}_p{p}"])
    requests = served(sweep.run(table.loc["chunked", "point"])["requests"])
    assert close(ttft["chunked"][0], np.sort(requests["ttft"]) * MS)
    assert close(itl["chunked"][0], np.sort(pooled_itl(requests)) * MS)


def test_itls_by_label_pool_every_point_of_the_label(repeated):
    """A label's repeats (or rates) are several points: the ITL CDF pools them all, not the last."""
    table = pd.DataFrame({"point": ["a_r0", "a_r1", "b_r0"], "label": ["chunked", "chunked", "1P1D"]})
    pooled = by_label({"a_r0": np.array([1.0, 2.0]), "a_r1": np.array([3.0]), "b_r0": np.array([4.0])}, table)
    assert close(pooled["chunked"], [1.0, 2.0, 3.0]) and close(pooled["1P1D"], [4.0])
    itls = repeated.itls()
    pooled = by_label(itls, repeated.finished())
    for label, rows in repeated.finished().groupby("label"):
        assert len(pooled[label]) == sum(len(itls[p]) for p in rows["point"])


def test_latency_summary_bars_and_intervals(sweeps):
    cells = sweeps["mode_compare"].cells()
    fig, ax = style.figure()
    plotted = figures.latency_summary(ax, cells)
    for label, by_metric in plotted.items():
        row = cells.set_index("label").loc[label]
        bars = segments(ax, label)
        for metric, bar in by_metric.items():
            assert close(
                [bar["ms"], bar["low"], bar["high"]],
                [row[metric] * MS, row[f"{metric}_low"] * MS, row[f"{metric}_high"] * MS],
            )
        assert close(bars[:, :, 1], known([[b["low"], b["high"]] for b in by_metric.values()]))
    assert "lowest ttft p99" in captions.latency_summary(plotted)


def test_attainment_vs_scale_matches_aggregate(sweeps):
    curves = sweeps["slo_scale"].aggregate["curves"]
    fig, ax = style.figure()
    plotted = figures.attainment_vs_scale(ax, curves)
    lines = lines_by_label(ax)
    for label, curve in curves.items():
        assert close(lines[label].get_xdata(), curve["scales"]) and close(lines[label].get_ydata(), curve["attainment"])
        assert close(plotted[label]["low"], curve["low"]) and close(plotted[label]["high"], curve["high"])
        assert_band(ax, f"{label}:slo_attainment", curve["scales"], plotted[label]["low"], plotted[label]["high"])
        passing = [s for s, a in zip(curve["scales"], curve["attainment"]) if a >= 0.9]
        if passing:
            assert min(curve["scales"]) <= plotted[label]["tightest_scale"] <= min(passing)


def test_tightest_scale_interpolates():
    assert close(figures.tightest_scale([0.5, 1.0, 2.0], [0.5, 0.8, 1.0]), 1.5)
    assert np.isnan(figures.tightest_scale([1.0, 2.0], [0.1, 0.2]))


def test_itl_inflation_and_the_step_level_view(sweeps):
    sweep = sweeps["interference"]
    agg = sweep.aggregate["interference"]
    made = {stem: (fig, caption, data) for stem, fig, caption, data in draw("interference", sweep)}
    fig, caption, plotted = made["itl_inflation"]
    inflation_ax, step_ax = fig.axes[:2]
    for label, line in plotted["inflation"].items():
        entries = [agg[label][str(int(n))] for n in line["prefill_len"]]
        assert close(lines_by_label(inflation_ax)[label].get_ydata(), [e["inflation"] for e in entries])
        bars = segments(inflation_ax, f"{label}:inflation")
        pairs = [
            [
                np.nan if e["inflation_low"] is None else e["inflation_low"],
                np.nan if e["inflation_high"] is None else e["inflation_high"],
            ]
            for e in entries
        ]
        assert close(bars[:, :, 1], known(pairs))
        steps = plotted["decode_step"][label]
        assert close(
            lines_by_label(step_ax)[label].get_ydata(),
            [
                np.nan if e["decode_step_s_with_prefill"] is None else e["decode_step_s_with_prefill"] * MS
                for e in entries
            ],
        )
        without = [e["decode_step_s_without_prefill"] for e in entries]  # None: no such step was measured
        assert close(steps["without_prefill_ms"], [np.nan if w is None else w * MS for w in without])
        rows = sweep.finished()[sweep.finished()["label"] == label].set_index("prefill_len")
        for n, value in zip(line["prefill_len"], line["inflation"]):  # recomputed from the point's own tables
            run = sweep.run(rows.loc[int(n), "point"])
            requests = measured(run["requests"], MetricsConfig(**run["config"]["metrics"]))
            gaps = background_gaps(requests, run["steps"], injection_window(requests))
            exposed, quiet = (gaps.loc[gaps["exposed"] == flag, "itl"] for flag in (True, False))
            both = len(exposed) and len(quiet)  # a loaded host may leave one side empty: no ratio
            assert close(value, np.percentile(exposed, 99) / np.percentile(quiet, 99) if both else np.nan)
    assert "overlap an injected prefill over p99 of the gaps that do not" in caption
    assert "with / without prefill work" in caption


def test_ttft_by_bucket_bars_and_bounds(sweeps):
    sweep = sweeps["input_buckets"]
    fig, ax = style.figure()
    plotted = figures.ttft_by_bucket(ax, sweep.ttft_buckets(), "p99")
    points = sweep.aggregate["points"]
    names = [t.get_text() for t in ax.get_xticklabels()]
    heights = [p.get_height() for p in ax.patches]
    expected = [plotted[label].get(b, {"ms": np.nan})["ms"] for label in plotted for b in names]
    assert close(heights, np.nan_to_num(expected))
    for label, buckets in plotted.items():
        for bucket, bar in buckets.items():
            assert close(bar["ms"], points[label][f"ttft_by_bucket_{bucket}_p99"] * MS)
        known = [(b["low"], b["high"]) for b in buckets.values() if np.isfinite(b["low"])]
        if known:
            assert close(segments(ax, label)[:, :, 1], known)


def test_chunk_tradeoff_draws_both_intervals(sweeps):
    cells = sweeps["chunk_sweep"].cells().sort_values("chunk")
    fig, ax = style.figure()
    plotted = figures.chunk_tradeoff(ax, cells)
    line = ax.get_lines()[0]
    assert close(line.get_xdata(), cells["itl_p99"] * MS) and close(line.get_ydata(), cells["ttft_p50"] * MS)
    assert [t.get_text() for t in ax.texts] == [str(c) for c in cells["chunk"]]
    assert close(plotted["chunk"], cells["chunk"])
    horizontal, vertical = segments(ax, "chunked:itl_p99"), segments(ax, "chunked:ttft_p50")
    assert close(horizontal[:, :, 0], known(np.c_[cells["itl_p99_low"], cells["itl_p99_high"]] * MS))
    assert close(vertical[:, :, 1], known(np.c_[cells["ttft_p50_low"], cells["ttft_p50_high"]] * MS))


def test_kv_bandwidth_matches_table(sweeps):
    table = sweeps["kv_bandwidth"].table
    fig, ax = style.figure()
    figures.kv_bandwidth(ax, table, 5e9)
    raw, connector, ceiling = ax.get_lines()
    assert close(raw.get_xdata(), table["bytes"]) and close(raw.get_ydata(), table["raw_gbps"])
    assert close(connector.get_ydata(), table["connector_gbps"]) and close(ceiling.get_ydata(), [5, 5])


def test_request_timeline_matches_requests(sweeps):
    sweep = sweeps["mode_compare"]
    point = sweep.finished().query("mode == 'disagg'")["point"].iloc[0]
    requests = sweep.run(point)["requests"].sort_values("arrival_s")
    fig, ax = style.figure("double")
    segments_drawn = system.request_timeline(ax, requests)
    bars = {c.get_label(): c for c in ax.containers}
    for phase, start, end in [
        ("prefill", "prefill_start_s", "prefill_end_s"),
        ("transfer", "kv_transfer_start_s", "kv_transfer_end_s"),
        ("decode", "decode_start_s", "finished_s"),
    ]:
        rows = requests.dropna(subset=[start, end])
        drawn = bars[phase].patches
        assert close([b.get_x() for b in drawn], rows[start])
        assert close([b.get_width() for b in drawn], rows[end] - rows[start])
        assert len(segments_drawn.query("phase == @phase")) == len(rows)
    assert any("P0\u2192D1" in t.get_text() for t in ax.get_yticklabels())


def test_gpu_telemetry_draws_a_given_frame_and_cpu_runs_skip(sweeps):
    frame = pd.DataFrame(
        {
            "t_s": [0.0, 0.1, 0.2, 0.0, 0.1, 0.2],
            "gpu": [0, 0, 0, 1, 1, 1],
            "util_pct": [10.0, 50.0, 90.0, 0.0, 5.0, 7.0],
            "mem_used_bytes": [2**30] * 6,
            "power_w": [100.0] * 6,
            "sm_clock_mhz": [1980.0] * 6,
            "nvlink_tx_bytes_s": [np.nan] * 6,
            "nvlink_rx_bytes_s": [np.nan] * 6,
        }
    )
    fig, ax = style.figure()
    plotted = system.gpu_telemetry(ax, frame, "util_pct")
    assert close(ax.get_lines()[1].get_ydata(), [0.0, 5.0, 7.0]) and close(plotted[0][1], [10.0, 50.0, 90.0])
    assert system.telemetry_metrics(frame) == ["util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz"]
    run = sweeps["mode_compare"].run(sweeps["mode_compare"].finished()["point"].iloc[0])
    assert run["telemetry"] is None and run_telemetry(run) == []
    assert len(run_telemetry({**run, "telemetry": frame})) == 1


def test_ttft_by_turn_and_burstiness_match(sweeps):
    sweep = sweeps["multiturn"]
    fig, ax = style.figure()
    plotted = figures.ttft_by_turn(ax, sweep.aggregate["turns"], sweep.cells())
    for cell, line in plotted.items():
        requests = sweep.requests(sweep.finished().query("cell == @cell")["point"])
        assert close(line["ttft"], requests.groupby("turn")["ttft"].mean().loc[line["turn"].astype(int)] * MS)
        assert_band(ax, cell, line["turn"], line["low"], line["high"])
    burst = sweeps["burstiness"]
    fig, ax = style.figure()
    lines = figures.metric_by_label(ax, burst.cells(), "burstiness", "slo_attainment")
    for label, line in lines.items():
        assert close(line["y"], [burst.aggregate[label][str(float(b))] for b in line["x"]])
        assert close(
            np.c_[line["low"], line["high"]], [burst.aggregate[f"{label}_interval"][str(float(b))] for b in line["x"]]
        )


def test_ttft_by_turn_reads_cells_of_repeated_points(tmp_path):
    """With repeats, the aggregate's turns are keyed by cell, and the sweep rows are its repeats."""
    table = pd.DataFrame(
        {
            "point": ["chunked_rr_r0", "chunked_rr_r1"],
            "cell": ["chunked_rr"] * 2,
            "repeat": [0, 1],
            "seed": [0, 1],
            "label": ["chunked"] * 2,
            "mode": ["chunked"] * 2,
            "dispatch": ["round_robin"] * 2,
            "status": ["ok"] * 2,
            "ttft_p50": [0.01, 0.03],
        }
    )
    turns = {
        "chunked_rr": {
            "ttft_mean_by_turn": {"0": 0.02, "1": 0.01},
            "ttft_mean_by_turn_low": {"0": 0.015, "1": 0.008},
            "ttft_mean_by_turn_high": {"0": 0.025, "1": 0.012},
        }
    }
    sweep = Sweep(tmp_path, "multiturn", table, {"turns": turns})
    ((stem, fig, caption, plotted),) = ttft_by_turn(sweep)
    assert close(plotted["chunked_rr"]["ttft"], [20.0, 10.0]) and close(plotted["chunked_rr"]["low"], [15.0, 8.0])
    assert "20 [15, 25]" in caption


def test_captions_name_a_leader_only_when_separated():
    clear = {"chunked": (10.0, 9.0, 11.0), "colocated": (20.0, 18.0, 22.0)}
    assert captions.leader(clear, "p99 TTFT", lower=True) == (
        "lowest p99 TTFT: chunked, clear of colocated (unpaired intervals)"
    )
    tied = {"chunked": (10.0, 9.0, 15.0), "colocated": (12.0, 11.0, 14.0), "1P1D": (30.0, 25.0, 35.0)}
    text = captions.leader(tied, "p99 TTFT", lower=True)
    assert "not separated (chunked, colocated: 95% intervals overlap)" in text and "1P1D" not in text
    unknown = {"chunked": (10.0, np.nan, np.nan), "colocated": (20.0, np.nan, np.nan)}
    assert "no interval to tell them apart" in captions.leader(unknown, "goodput")
    assert captions.leader({"chunked": (1.0, 0.5, 2.0)}, "goodput") == ""
    plotted = {
        "colocated": {"goodput_per_gpu": 4.0, "low": 3.0, "high": 6.0},
        "1P1D": {"goodput_per_gpu": 5.0, "low": 4.5, "high": 5.5},
    }
    assert "no paired verdict" in captions.goodput_per_gpu(plotted)  # never a leader from unpaired overlap
    assert captions.goodput_per_gpu(plotted, {"line": "best configuration: 1P1D"}).endswith("best configuration: 1P1D.")


def test_a_caption_names_the_leader_the_paired_verdict_names_where_unpaired_intervals_overlap():
    """Seeds spread by 40 ms, chunked 5 ms lower on every one: the unpaired intervals overlap, the
    paired verdict separates, and the caption follows the verdict."""
    import pandas as pd

    runs = pd.DataFrame(
        {
            "label": ["chunked"] * 3 + ["colocated"] * 3,
            "seed": [0, 1, 2] * 2,
            "ttft_p99": [0.10, 0.14, 0.12, 0.105, 0.145, 0.125],
        }
    )
    unpaired = {k: tuple(mean_interval(g["ttft_p99"].tolist())) for k, g in runs.groupby("label")}
    assert "not separated" in captions.leader(unpaired, "p99 TTFT", lower=True)
    text = captions.paired_leader(runs, "ttft_p99", "p99 TTFT", lower=True)
    assert text.startswith("lowest p99 TTFT: chunked") and "paired over 3 seeds" in text
    tied = runs.assign(ttft_p99=[0.10, 0.14, 0.12, 0.095, 0.15, 0.12])
    assert "not separated seed by seed" in captions.paired_leader(tied, "ttft_p99", "p99 TTFT", lower=True)


def test_attainment_caption_notes_follow_the_goodput_not_the_pooled_curve():
    """With repeats the curve is a pooled estimate and the goodput a mean over repeats: a repeat
    that met 90% gives a goodput even where the pooled curve stays under it."""
    line = {
        "rate": np.array([20.0, 80.0]),
        "attainment": np.array([0.85, 0.4]),
        "low": np.array([0.8, 0.3]),
        "high": np.array([0.9, 0.5]),
        "goodput": 11.9,
        "goodput_low": 0.0,
        "goodput_high": 160.0,
    }
    text = captions.attainment_vs_rate({"1P1D": line}, pd.DataFrame())
    assert "1P1D 11.9 [0, 160] req/s" in text and "no swept rate" not in text
    assert "no swept rate meets 90%" in captions.attainment_vs_rate({"1P1D": {**line, "goodput": 0.0}}, pd.DataFrame())


def test_ttft_buckets_pool_a_cells_repeats(repeated):
    buckets = repeated.ttft_buckets()
    table = repeated.finished()
    for row in buckets.itertuples():
        repeats = table[table["cell"] == row.cell]
        assert len(repeats) == 2 and row.count == repeats[f"ttft_by_bucket_{row.bucket}_count"].sum()
        if np.isfinite(row.p50_low):  # a bucket of a handful of requests bounds no median
            assert row.p50_low <= row.p50 <= row.p50_high


def test_study_figures_write_pdf_png_and_caption(study_results, repeated_results):
    assert set(DRAWN) <= set(study_results)  # every study with figures has a tiny run to draw
    for name, directory in [*study_results.items(), ("ratio_sweep", repeated_results)]:
        if name not in DRAWN:
            assert study_figures(name, directory) == []
            continue
        paths = study_figures(name, directory, strict=True)
        stems = {p.stem for p in paths}
        assert len(stems) >= len(DRAWN[name]) - 1, name  # telemetry is skipped on CPU
        for stem in stems:
            pdf, png = directory / "figures" / f"{stem}.pdf", directory / "figures" / f"{stem}.png"
            assert pdf in paths and png in paths
            assert pdf.read_bytes()[:4] == b"%PDF" and png.read_bytes()[:4] == b"\x89PNG"
            assert (directory / "figures" / f"{stem}.txt").read_text().strip()


def test_cli_regenerates_a_run_and_a_sweep(study_results, capsys, tmp_path):
    sweep = load_sweep(study_results["chunk_sweep"])
    point_dir = sweep.point_dir(sweep.finished()["point"].iloc[0])
    assert cli([str(point_dir), str(study_results["chunk_sweep"])]) == 0
    out = capsys.readouterr().out
    assert "latency_cdf.pdf" in out and "timeline.png" in out and "chunk_tradeoff.pdf" in out
    assert sorted(p.name for p in run_figures(point_dir)) == sorted(
        f"{s}.{e}" for s in ("latency_cdf", "timeline") for e in ("pdf", "png")
    )
    with pytest.raises(SystemExit):
        cli([str(tmp_path)])


@pytest.mark.slow
def test_a_multirun_directory_merges_its_jobs_into_one_study(tmp_path):
    """`python -m testbed -m mode=chunked,disagg workload.rate=4,8`: four runs that
    `python -m analysis` draws as one rate sweep, a line per mode."""
    import subprocess
    import sys

    import pandas as pd

    from analysis.__main__ import main
    from tests.paths import ROOT

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed",
            "-m",
            "executor=sim",
            "mode=chunked,disagg",
            "workload.rate=4,8",
            "workload.num_requests=10",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert main([str(tmp_path)]) == 0
    table = pd.read_parquet(tmp_path / "merged" / "sweep.parquet")
    assert sorted(zip(table.label, table.rate)) == [
        ("chunked", 4.0),
        ("chunked", 8.0),
        ("disagg", 4.0),
        ("disagg", 8.0),
    ]
    assert (tmp_path / "merged" / "figures" / "attainment_vs_rate.png").is_file()
    assert main([str(tmp_path / "0")]) == 0  # one job alone is still a run


def test_multirun_jobs_are_named_by_what_varies():
    from pathlib import Path

    from analysis.multirun import RATE_KEY, job_labels

    jobs = [(0, Path("0"), {"mode": "chunked", RATE_KEY: "4"}), (1, Path("1"), {"mode": "disagg", RATE_KEY: "4"})]
    assert job_labels(jobs) == {0: "chunked", 1: "disagg"}
    only_rates = [(0, Path("0"), {RATE_KEY: "4"}), (1, Path("1"), {RATE_KEY: "8"})]
    assert job_labels(only_rates, leave_out=(RATE_KEY,)) == {0: "", 1: ""}  # one line, named by its mode
    two = [(0, Path("0"), {"mode": "chunked", "seed": "1"}), (1, Path("1"), {"mode": "disagg", "seed": "2"})]
    assert job_labels(two) == {0: "mode=chunked,seed=1", 1: "mode=disagg,seed=2"}


def test_the_placement_heat_map_draws_the_best_of_each_tp_cell(tmp_path):
    """A synthetic plan sweep over TP [1, 2, 4] on 8 devices: each disaggregated (prefill TP, decode
    TP) cell holds the best of its worker counts, annotated with the value and the split; colocated
    and chunked get a row each by TP (chunked at TP1 the best of its chunk sizes); the caption reads
    the plotted values; a sweep of one-device placements draws no heat map."""
    goodputs = {
        "colocated": 0.5,
        "colocated-TP2": 0.9,
        "chunked": 0.6,
        "chunked512": 0.7,
        "chunked-TP4": 1.1,
        "3P5D": 0.8,
        "4P4D": 1.0,
        "2xTP2P-4xTP1D": 1.2,
        "1xTP2P-6xTP1D": 0.4,
        "1xTP4P-2xTP2D": 1.3,
    }
    aggregate = {
        "analytical": {"split": "3P5D"},
        "simulated": {
            "goodput": {k: {"goodput_per_gpu": v, "goodput": 8 * v} for k, v in goodputs.items()},
            "best": {"label": "1xTP4P-2xTP2D", "line": "best configuration: 1xTP4P-2xTP2D"},
        },
    }
    (tmp_path / "sweep.json").write_text(json.dumps({"experiment": "plan", "aggregate": aggregate}))
    pd.DataFrame({"point": list(goodputs), "label": list(goodputs)}).to_parquet(tmp_path / "sweep.parquet")
    sweep = load_sweep(tmp_path)
    with style.paper():
        made = {stem: (fig, caption, data) for stem, fig, caption, data in draw("plan", sweep)}
    fig, caption, plotted = made["placement_goodput"]
    disagg, mixed = plotted["disagg"], plotted["mixed"]
    assert disagg["prefill_tp"] == [1, 2, 4] and disagg["decode_tp"] == [1, 2]
    assert close(disagg["goodput_per_gpu"], [[1.0, np.nan], [1.2, np.nan], [np.nan, 1.3]])
    assert disagg["label"][0][0] == "4P4D" and disagg["label"][1][0] == "2xTP2P-4xTP1D"
    assert mixed["modes"] == ["colocated", "chunked"] and mixed["tp"] == [1, 2, 4]
    assert close(mixed["goodput_per_gpu"], [[0.5, 0.9, np.nan], [0.7, np.nan, 1.1]])
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"1.2\n2P:4D", "1.3\n1P:2D", "0.7\nchunk 512", "1.1"} <= texts
    assert "P TP2 / D TP1 1.2 (2xTP2P-4xTP1D)" in caption and "chunked TP1 0.7 (chunked512)" in caption
    assert caption.endswith("best configuration: 1xTP4P-2xTP2D.")
    check_study({"placement_goodput": json.loads(dumps(plotted))}, tmp_path)
    paths = study_figures("plan", tmp_path, strict=True)
    assert {p.name for p in paths} >= {"placement_goodput.pdf", "placement_goodput.png"}
    assert (tmp_path / "figures" / "placement_goodput.txt").read_text().strip() == caption
    one_device = {k: v for k, v in aggregate["simulated"]["goodput"].items() if "TP" not in k}
    flat = Sweep(tmp_path, "plan", sweep.table, {**aggregate, "simulated": {"goodput": one_device}})
    assert [stem for stem, *_ in draw("plan", flat)] == ["plan_goodput_per_gpu"]


def _interference_entry(with_prefill, without, count) -> dict:
    return {
        "inflation": 3.5,
        "inflation_low": None,
        "inflation_high": None,
        "inflation_note": "",
        "inflation_vs_baseline": 1.2,
        "inflation_vs_baseline_low": None,
        "inflation_vs_baseline_high": None,
        "decode_step_s_with_prefill": with_prefill,
        "decode_step_s_without_prefill": without,
        "decode_steps_with_prefill": count,
    }


@pytest.mark.parametrize(
    "entry, panel",
    [
        (_interference_entry(0.006, 0.004, 12), "decode_step"),
        (_interference_entry(None, 0.004, 0), "decode_step"),  # a loaded host: no step had prefill work alongside
        (_interference_entry(None, None, 0), "vs_baseline"),  # an engine measured from outside: no steps at all
    ],
    ids=["steps", "none-with-prefill", "no-steps"],
)
def test_the_step_panel_shows_wherever_steps_were_measured(entry, panel):
    from types import SimpleNamespace

    from analysis import standard_figures

    sweep = SimpleNamespace(aggregate={"interference": {"chunked": {"0": {}, "256": entry}}})
    with style.paper():
        [(_, _, caption, plotted)] = standard_figures.itl_inflation(sweep)
    assert set(plotted) == {"inflation", panel}
    if panel == "decode_step":
        with_ms = plotted["decode_step"]["chunked"]["with_prefill_ms"]
        assert np.isnan(with_ms[0]) if entry["decode_step_s_with_prefill"] is None else with_ms[0] == pytest.approx(6.0)
        assert "mean decode step" in caption
