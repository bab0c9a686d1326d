"""The figures show exactly what the saved results say: every figure function is drawn from the
results the tool itself produced (the `study_results` fixture) and its plotted data is held to
sweep.parquet, sweep.json and the points' request tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis import captions, figures, style, system
from analysis.__main__ import main as cli
from analysis.load import by_label, load_run, load_runs, load_sweep, served
from analysis.studies import FIGURES, run_figures, run_telemetry, study_figures
from testbed.metrics.latency import pooled_itl
from testbed.metrics.slo import goodput

pytestmark = pytest.mark.slow
MS = 1e3


def close(a, b) -> bool:
    return np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-9, atol=1e-12, equal_nan=True)


def lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


@pytest.fixture(scope="module")
def sweeps(study_results):
    return {name: load_sweep(path) for name, path in study_results.items() if name in FIGURES}


def test_load_sweep_and_runs(sweeps, study_results):
    sweep = sweeps["ratio_sweep"]
    assert sweep.experiment == "ratio_sweep"
    assert close(sweep.table["ttft_p99"], pd.read_parquet(study_results["ratio_sweep"] / "sweep.parquet")["ttft_p99"])
    requests = sweep.requests()
    for row in sweep.finished().itertuples():
        rows = requests[requests["point"] == row.point]
        assert len(rows) == row.num_requests_ok
        assert set(rows["label"]) == {row.label} and set(rows["mode"]) == {row.mode}
    point = sweep.finished()["point"].iloc[0]
    assert set(load_runs([sweep.point_dir(point)])["point"]) == {point}
    assert load_run(sweep.point_dir(point))["summary"]["num_requests"]["ok"] == len(sweep.requests([point]))


def test_goodput_by_split_matches_sweep(sweeps):
    sweep = sweeps["ratio_sweep"]
    fig, ax = style.figure()
    plotted = figures.goodput_by_split(ax, sweep.aggregate["goodput"])
    splits = [label for label in plotted if style.split_of(label)]
    assert [p.get_height() for p in ax.patches] == [plotted[s] for s in splits]
    for label, group in sweep.finished().groupby("label"):  # recomputed from the table itself
        expected = goodput(group["rate"], group["slo_attainment"]) / group["num_gpus"].iloc[0]
        assert close(plotted[label], expected)
        assert close(plotted[label], sweep.aggregate["goodput"][label]["goodput_per_gpu"])
    baselines = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
    assert {"colocated", "chunked"} <= set(baselines)
    assert all(close(baselines[b], plotted[b]) for b in baselines)
    text = captions.goodput_per_gpu(plotted)
    assert all(f"{label} {plotted[label]:.3g} req/s" in text for label in plotted)


def test_attainment_vs_rate_marks_goodput(sweeps):
    sweep = sweeps["ratio_sweep"]
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, sweep.finished())
    lines = lines_by_label(ax)
    for label, group in sweep.finished().groupby("label"):
        group = group.sort_values("rate")
        assert close(lines[label].get_xdata(), group["rate"])
        assert close(lines[label].get_ydata(), group["slo_attainment"])
        assert close(plotted[label]["goodput"], sweep.aggregate["goodput"][label]["goodput"])
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert sorted(s.get_xdata()[0] for s in stars) == sorted(p["goodput"] for p in plotted.values() if p["goodput"] > 0)
    assert all(s.get_ydata()[0] == 0.9 for s in stars)


def test_latency_vs_rate_matches_table(sweeps):
    table = sweeps["rate_sweep"].finished()
    fig, ax = style.figure()
    plotted = figures.latency_vs_rate(ax, table, "tpot")
    drawn = [(tuple(line.get_xdata()), tuple(line.get_ydata())) for line in ax.get_lines()]
    for p in ("p50", "p99"):
        for label, group in table.groupby("label"):
            group = group.sort_values("rate")
            x, y = plotted[p][label]
            assert close(x, group["rate"]) and close(y, group[f"tpot_{p}"] * MS)
            assert (tuple(x), tuple(y)) in drawn


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


def test_attainment_vs_scale_matches_aggregate(sweeps):
    curves = sweeps["slo_scale"].aggregate["curves"]
    fig, ax = style.figure()
    plotted = figures.attainment_vs_scale(ax, curves)
    lines = lines_by_label(ax)
    for label, curve in curves.items():
        assert close(lines[label].get_xdata(), curve["scales"]) and close(lines[label].get_ydata(), curve["attainment"])
        passing = [s for s, a in zip(curve["scales"], curve["attainment"]) if a >= 0.9]
        if passing:
            assert min(curve["scales"]) <= plotted[label]["tightest_scale"] <= min(passing)


def test_tightest_scale_interpolates():
    assert close(figures.tightest_scale([0.5, 1.0, 2.0], [0.5, 0.8, 1.0]), 1.5)
    assert np.isnan(figures.tightest_scale([1.0, 2.0], [0.1, 0.2]))


def test_itl_inflation_matches_aggregate_and_points(sweeps):
    sweep = sweeps["interference"]
    agg = sweep.aggregate["interference"]
    fig, ax = style.figure()
    plotted = figures.itl_inflation(ax, agg)
    for label, (x, y) in plotted.items():
        assert close(lines_by_label(ax)[label].get_ydata(), y)
        assert close(y, [agg[label][str(int(n))]["inflation"] for n in x])
        rows = sweep.finished()[sweep.finished()["label"] == label].set_index("prefill_len")
        background = lambda point: pooled_itl(sweep.requests([point]).query("tenant == 'background'"))  # noqa: E731
        base = np.percentile(background(rows.loc[0, "point"]), 99)
        for n, value in zip(x, y):  # recomputed from the points' request tables
            assert close(value, np.percentile(background(rows.loc[int(n), "point"]), 99) / base)


def test_ttft_by_bucket_bars_match_table(sweeps):
    table = sweeps["input_buckets"].finished()
    fig, ax = style.figure()
    plotted = figures.ttft_by_bucket(ax, table, "p99")
    heights = [p.get_height() for p in ax.patches]
    expected = [table.set_index("label").loc[label, f"ttft_by_bucket_{b}_p99"] * MS
                for label in plotted for b in plotted[label]]
    assert close(heights, np.nan_to_num(expected)) and len(heights) > 0


def test_chunk_tradeoff_matches_table(sweeps):
    table = sweeps["chunk_sweep"].finished().sort_values("chunk")
    fig, ax = style.figure()
    plotted = figures.chunk_tradeoff(ax, table)
    line = ax.get_lines()[0]
    assert close(line.get_xdata(), table["itl_p99"] * MS) and close(line.get_ydata(), table["ttft_p50"] * MS)
    assert [t.get_text() for t in ax.texts] == [str(c) for c in table["chunk"]]
    assert close(plotted["chunk"], table["chunk"])


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
    segments = system.request_timeline(ax, requests)
    bars = {c.get_label(): c for c in ax.containers}
    for phase, start, end in [("prefill", "prefill_start_s", "prefill_end_s"),
                              ("transfer", "kv_transfer_start_s", "kv_transfer_end_s"),
                              ("decode", "decode_start_s", "finished_s")]:
        rows = requests.dropna(subset=[start, end])
        drawn = bars[phase].patches
        assert close([b.get_x() for b in drawn], rows[start])
        assert close([b.get_width() for b in drawn], rows[end] - rows[start])
        assert len(segments.query("phase == @phase")) == len(rows)
    assert any("P0\u2192D1" in t.get_text() for t in ax.get_yticklabels())


def test_gpu_telemetry_draws_a_given_frame_and_cpu_runs_skip(sweeps):
    frame = pd.DataFrame({"t_s": [0.0, 0.1, 0.2, 0.0, 0.1, 0.2], "gpu": [0, 0, 0, 1, 1, 1],
                          "util_pct": [10.0, 50.0, 90.0, 0.0, 5.0, 7.0], "mem_used_bytes": [2**30] * 6,
                          "power_w": [100.0] * 6, "sm_clock_mhz": [1980.0] * 6,
                          "nvlink_tx_bytes_s": [np.nan] * 6, "nvlink_rx_bytes_s": [np.nan] * 6})
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
    plotted = figures.ttft_by_turn(ax, sweep.aggregate["turns"], sweep.finished())
    for point, (x, y) in plotted.items():
        requests = sweep.requests([point])
        assert close(y, requests.groupby("turn")["ttft"].mean().loc[x.astype(int)] * MS)
    table = sweeps["burstiness"].finished()
    fig, ax = style.figure()
    lines = figures.metric_by_label(ax, table, "burstiness", "slo_attainment")
    for label, (x, y) in lines.items():
        assert close(y, [sweeps["burstiness"].aggregate[label][str(float(b))] for b in x])


def test_study_figures_write_pdf_png_and_caption(study_results):
    assert set(FIGURES) <= set(study_results)  # every study with figures has a tiny run to draw
    for name, directory in study_results.items():
        if name not in FIGURES:
            assert study_figures(name, directory) == []
            continue
        paths = study_figures(name, directory, strict=True)
        stems = {p.stem for p in paths}
        assert len(stems) >= len(FIGURES[name]) - 1, name  # telemetry is skipped on CPU
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
        f"{s}.{e}" for s in ("latency_cdf", "timeline") for e in ("pdf", "png"))
    with pytest.raises(SystemExit):
        cli([str(tmp_path)])
