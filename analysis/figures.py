"""One function per figure of the studies. Each takes the data and a matplotlib `ax`, draws, and
returns exactly what it plotted (in the units on the axes), so tests can hold the figure to the
saved summaries. Latencies are drawn in milliseconds; rates in requests per second.

Figures of one run (request timeline, GPU telemetry, KV bandwidth) are in analysis.system and
re-exported here, so `analysis.figures` is the one place to look.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator, PercentFormatter

from analysis import style
from analysis.system import gpu_telemetry, kv_bandwidth, request_timeline  # noqa: F401  (re-exported)
from testbed.metrics.latency import BUCKETS
from testbed.metrics.slo import goodput

MS = 1e3  # seconds -> milliseconds on every latency axis
THRESHOLD = 0.9  # SLO attainment that defines goodput (DistServe)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def cdf(ax, samples: Mapping[str, Sequence[float]], xlabel: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Empirical CDF per label of latencies in seconds: {label: (sorted ms, cumulative share)}."""
    plotted = {}
    for label in style.order(samples):
        x = np.sort(np.asarray(samples[label], dtype=float)) * MS
        if x.size == 0:
            continue
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", color=style.colour(label), label=label)
        plotted[label] = (x, y)
    ax.set(xlabel=xlabel, ylabel="CDF", ylim=(0, 1.02))
    _legend(ax)
    return plotted


def ttft_cdf(ax, requests: pd.DataFrame) -> dict:
    """TTFT CDF per label from load_runs rows (served requests, tagged with label)."""
    return cdf(ax, {label: g["ttft"].to_numpy() for label, g in requests.groupby("label")}, "TTFT (ms)")


def itl_cdf(ax, itls: Mapping[str, np.ndarray]) -> dict:
    """ITL CDF per label from pooled gaps ({label: seconds})."""
    plotted = cdf(ax, itls, "inter-token latency (ms)")
    ax.set_xscale("symlog", linthresh=0.1)  # gaps of 0 (tokens of one message) beside long stalls
    ax.set_xlim(left=0)
    return plotted


def metric_by_label(ax, table: pd.DataFrame, x: str, y: str, scale: float = 1.0, linestyle: str = "-",
                    legend: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One line per label of table[y] * scale against table[x]: {label: (x, y as plotted)}."""
    plotted = {}
    for label in style.order(table["label"]):
        rows = table[table["label"] == label].sort_values(x)
        xs, ys = rows[x].to_numpy(dtype=float), rows[y].to_numpy(dtype=float) * scale
        kwargs = style.line_style(label) | ({} if legend else {"label": "_nolegend_"})
        ax.plot(xs, ys, linestyle=linestyle, **kwargs)
        plotted[label] = (xs, ys)
    return plotted


def latency_vs_rate(ax, table: pd.DataFrame, metric: str = "ttft", percentiles=("p50", "p99"),
                    x: str = "rate") -> dict[str, dict]:
    """p50 (solid) and p99 (dashed) of a latency metric against the rate, per label:
    {percentile: {label: (x, ms)}}."""
    plotted = {}
    for i, p in enumerate(percentiles):
        plotted[p] = metric_by_label(ax, table, x, f"{metric}_{p}", MS, style.PERCENTILE_STYLES.get(p, ":"),
                                     legend=i == 0)
    ax.set(xlabel="request rate (req/s)" if x == "rate" else x, ylabel=f"{metric.upper()} (ms)")
    ax.set_yscale("log")
    style.plain_ticks(ax.yaxis)
    # One legend entry per configuration (colour) and one per percentile (line style).
    handles, names = ax.get_legend_handles_labels()
    for p in percentiles:
        handles.append(Line2D([], [], color="black", linestyle=style.PERCENTILE_STYLES.get(p, ":")))
        names.append(p)
    ax.legend(handles, names)
    return plotted


def attainment_vs_rate(ax, table: pd.DataFrame, threshold: float = THRESHOLD) -> dict[str, dict]:
    """SLO attainment against rate per label, the threshold line, and each label's goodput
    (testbed.metrics.slo.goodput) marked where the curve crosses it:
    {label: {"rate", "attainment", "goodput"}}."""
    lines = metric_by_label(ax, table, "rate", "slo_attainment")
    plotted = {}
    for label, (rates, attainment) in lines.items():
        value = goodput(rates, attainment, threshold)
        if value > 0:  # 0 means no swept rate meets the threshold: nothing on the curve to mark
            ax.plot([value], [threshold], marker="*", markersize=9, color=style.colour(label), linestyle="none",
                    markeredgecolor="black", markeredgewidth=0.4)
        plotted[label] = {"rate": rates, "attainment": attainment, "goodput": value}
    ax.axhline(threshold, color="black", linewidth=0.7, linestyle=":")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _legend(ax)
    return plotted


def tightest_scale(scales: Sequence[float], attainment: Sequence[float], threshold: float = THRESHOLD) -> float:
    """The smallest SLO scale still meeting the threshold, interpolated like goodput; NaN when no
    scale does. goodput finds the *highest* passing x, so it is given the scales negated."""
    if not np.any(np.asarray(attainment, dtype=float) >= threshold):
        return float("nan")
    return -goodput([-s for s in scales], attainment, threshold)


def attainment_vs_scale(ax, curves: Mapping[str, Mapping], threshold: float = THRESHOLD) -> dict[str, dict]:
    """slo_scale's aggregate curves ({label: {"scales", "attainment"}}): attainment against the
    SLO scale, the threshold line, and the tightest scale meeting it marked."""
    plotted = {}
    for label in style.order(curves):
        scales = np.asarray(curves[label]["scales"], dtype=float)
        attainment = np.asarray(curves[label]["attainment"], dtype=float)
        ax.plot(scales, attainment, **style.line_style(label))
        tightest = tightest_scale(scales, attainment, threshold)
        if np.isfinite(tightest):
            ax.plot([tightest], [threshold], marker="*", markersize=9, color=style.colour(label),
                    linestyle="none", markeredgecolor="black", markeredgewidth=0.4)
        plotted[label] = {"scales": scales, "attainment": attainment, "tightest_scale": tightest}
    ax.axhline(threshold, color="black", linewidth=0.7, linestyle=":")
    ax.set(xlabel="SLO scale (x both SLOs)", ylabel="SLO attainment", ylim=(0, 1.05))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _legend(ax)
    return plotted


def goodput_by_split(ax, goodputs: Mapping[str, Mapping]) -> dict[str, float]:
    """ratio_sweep's headline: goodput per GPU of each P:D split as bars, the colocated and
    chunked baselines as horizontal lines. {label: goodput per GPU as plotted}."""
    splits = [label for label in style.order(goodputs) if style.split_of(label)]
    heights = [float(goodputs[label]["goodput_per_gpu"]) for label in splits]
    ax.bar(range(len(splits)), heights, width=0.6, color=[style.colour(s) for s in splits], edgecolor="black",
           linewidth=0.4)
    ax.set_xticks(range(len(splits)), splits)
    plotted = dict(zip(splits, heights))
    for label in style.order(goodputs):
        if label not in plotted:
            value = float(goodputs[label]["goodput_per_gpu"])
            ax.axhline(value, color=style.colour(label), linestyle="--", label=label)
            plotted[label] = value
    ax.set(xlabel="P:D split", ylabel="goodput per GPU (req/s)")
    _legend(ax)
    return plotted


def itl_inflation(ax, interference: Mapping[str, Mapping]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """interference's aggregate ({label: {prefill_len: {"inflation", ...}}}): p99 ITL of the decode
    background over its decode-only baseline, against the injected prefill length."""
    plotted = {}
    for label in style.order(interference):
        lengths = sorted((int(k) for k in interference[label] if int(k) > 0))
        inflation = np.array([interference[label][str(n)]["inflation"] for n in lengths], dtype=float)
        ax.plot(lengths, inflation, **style.line_style(label))
        plotted[label] = (np.array(lengths, dtype=float), inflation)
    ax.axhline(1.0, color="black", linewidth=0.7, linestyle=":")  # the baseline itself
    ax.set_xscale("log", base=2)
    lengths = sorted({int(n) for x, _ in plotted.values() for n in x})
    ax.set_xticks(lengths, [str(n) for n in lengths])  # the injected lengths, not powers of 2
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="injected prefill length (tokens)", ylabel="p99 ITL inflation (x baseline)")
    _legend(ax)
    return plotted


def ttft_by_bucket(ax, table: pd.DataFrame, percentile: str = "p50") -> dict[str, dict[str, float]]:
    """Grouped bars: TTFT (ms) per input-length bucket and label, from the sweep table's
    ttft_by_bucket_<bucket>_<p> columns; empty buckets are left out. {label: {bucket: ms}}."""
    labels = style.order(table["label"])
    column = lambda b: f"ttft_by_bucket_{b}_{percentile}"  # noqa: E731
    buckets = [b for b in BUCKETS if column(b) in table and table[column(b)].notna().any()]
    width = 0.8 / max(len(labels), 1)
    plotted = {}
    for i, label in enumerate(labels):
        row = table[table["label"] == label].iloc[0]
        heights = [float(row[column(b)]) * MS for b in buckets]
        ax.bar(np.arange(len(buckets)) + (i - (len(labels) - 1) / 2) * width, np.nan_to_num(heights), width,
               color=style.colour(label), label=label, edgecolor="black", linewidth=0.4)
        plotted[label] = dict(zip(buckets, heights))
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set(xlabel="input length (tokens)", ylabel=f"{percentile} TTFT (ms)")
    _legend(ax)
    return plotted


def chunk_tradeoff(ax, table: pd.DataFrame, ttft: str = "ttft_p50") -> dict[str, np.ndarray]:
    """chunk_sweep: TTFT against p99 ITL, one point per chunk size, joined in chunk order and
    labelled by it (Sarathi-Serve's trade-off)."""
    rows = table.sort_values("chunk")
    x, y = rows["itl_p99"].to_numpy(dtype=float) * MS, rows[ttft].to_numpy(dtype=float) * MS
    chunks = rows["chunk"].to_numpy()
    ax.plot(x, y, **style.line_style("chunked"))
    for xi, yi, c in zip(x, y, chunks):
        ax.annotate(f"{int(c)}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6)
    ax.set(xlabel="p99 ITL (ms)", ylabel=f"{ttft.split('_')[-1]} TTFT (ms)")
    return {"chunk": chunks, "itl_p99": x, "ttft": y}


def ttft_by_turn(ax, turns: Mapping[str, Mapping], table: pd.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """multiturn's aggregate: mean TTFT per turn, one line per point (colour: configuration,
    line style: dispatch policy)."""
    knobs = table.set_index("point")
    dashes = {d: s for d, s in zip(sorted(set(table.get("dispatch", []))), ["-", "--", ":", "-."])}
    plotted = {}
    for point, body in turns.items():
        by_turn = body["ttft_mean_by_turn"]
        x = np.array(sorted(int(t) for t in by_turn), dtype=float)
        y = np.array([by_turn[str(int(t))] for t in x], dtype=float) * MS
        label, dispatch = knobs.loc[point, "label"], knobs.loc[point].get("dispatch", "")
        ax.plot(x, y, color=style.colour(label), marker=style.marker(label), linestyle=dashes.get(dispatch, "-"),
                label=f"{label} {dispatch}".strip())
        plotted[point] = (x, y)
    ax.set(xlabel="turn", ylabel="mean TTFT (ms)")
    ax.set_xticks(sorted({int(t) for x, _ in plotted.values() for t in x}))
    _legend(ax)
    return plotted


def sim_vs_real(ax, table: pd.DataFrame, metrics=("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")) -> dict:
    """sim_validate: each point's simulated figure against the real one (ms), per metric, with
    the y = x line: the simulator is right where the markers sit on it. {metric: (real, sim)}."""
    real = table[table["executor"] == "real"].set_index(["label", "rate"])
    sim = table[table["executor"] == "sim"].set_index(["label", "rate"])
    both = real.index.intersection(sim.index)
    plotted = {}
    for marker, metric in zip("osD^", metrics):
        x = real.loc[both, metric].to_numpy(dtype=float) * 1000
        y = sim.loc[both, metric].to_numpy(dtype=float) * 1000
        ax.scatter(x, y, marker=marker, label=metric.replace("_", " "), s=14)
        plotted[metric] = (x, y)
    values = np.concatenate([np.concatenate(v) for v in plotted.values()]) if plotted else np.array([1.0])
    finite = values[np.isfinite(values) & (values > 0)]
    low, high = (finite.min() / 1.5, finite.max() * 1.5) if len(finite) else (0.1, 10.0)
    ax.plot([low, high], [low, high], color="black", linewidth=0.7, linestyle=":")
    ax.set(xscale="log", yscale="log", xlabel="real (ms)", ylabel="simulated (ms)")
    _legend(ax)
    return plotted
