"""Bar figures that compare configurations: goodput per GPU by P:D split, TTFT per input-length
bucket, and a mode's latency percentiles side by side. Each bar carries its 95% interval as an
error bar; each function draws on an `ax` and returns what it plotted, bounds included (NaN
where the results have none). Re-exported by analysis.figures."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis import style
from analysis.bounds import as_float, column_bounds, error_bars, span
from testbed.metrics.latency import BUCKETS

MS = 1e3  # seconds -> milliseconds on every latency axis
NAN3 = (np.nan, np.nan, np.nan)
BAR = {"edgecolor": "black", "linewidth": 0.4}


def grouped_bars(ax, groups: Sequence[str], values: Mapping[str, Mapping[str, tuple]]) -> None:
    """One group of bars per entry of `groups`, one bar per label (its colour), each with its
    interval as an error bar. values: {label: {group: (height, low, high)}}; a missing or NaN
    height leaves a gap."""
    labels = list(values)
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        at = np.arange(len(groups)) + (i - (len(labels) - 1) / 2) * width
        heights, low, high = (np.array([values[label].get(g, NAN3)[k] for g in groups], dtype=float) for k in range(3))
        ax.bar(at, np.nan_to_num(heights), width, color=style.colour(label), label=label, **BAR)
        error_bars(ax, at, low, high, "black", label)
    ax.set_xticks(range(len(groups)), list(groups))


def goodput_by_split(ax, goodputs: Mapping[str, Mapping]) -> dict[str, dict]:
    """ratio_sweep's headline (sweep.json "goodput"): goodput per GPU of each P:D split as bars
    with its interval across repeats, the colocated and chunked baselines as horizontal lines
    with theirs shaded. A censored goodput (a bound) is drawn hatched with its ">=" or "<" written
    over it, never as a value. {label: {"goodput_per_gpu", "low", "high", "censored"} as plotted}."""
    plotted = {
        label: {
            "goodput_per_gpu": float(g["goodput_per_gpu"]),
            "low": as_float(g.get("goodput_per_gpu_low")),
            "high": as_float(g.get("goodput_per_gpu_high")),
            "censored": g.get("goodput_censored") or "",
        }
        for label, g in goodputs.items()
    }
    splits = [label for label in style.order(goodputs) if style.split_of(label)]
    at = np.arange(len(splits))
    ax.bar(
        at, [plotted[s]["goodput_per_gpu"] for s in splits], width=0.6, color=[style.colour(s) for s in splits], **BAR
    )
    for x, label in zip(at, splits):
        error_bars(ax, [x], [plotted[label]["low"]], [plotted[label]["high"]], "black", label)
        if plotted[label]["censored"]:
            ax.patches[list(splits).index(label)].set_hatch("//")
            ax.annotate(
                bound_text(plotted[label]), (x, plotted[label]["goodput_per_gpu"]), ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(at, splits)
    for label in style.order(goodputs):
        if label not in splits:
            line = plotted[label]
            censored = line["censored"]
            ax.axhline(
                line["goodput_per_gpu"],
                color=style.colour(label),
                linestyle=":" if censored else "--",
                label=f"{label} ({bound_text(line)})" if censored else label,
            )
            span(ax, line["low"], line["high"], style.colour(label), label)
    ax.set(xlabel="P:D split", ylabel="goodput per GPU (req/s)")
    style.legend(ax)
    return {label: plotted[label] for label in style.order(goodputs)}


def goodput_bars(ax, goodputs: Mapping[str, Mapping]) -> dict[str, dict]:
    """The planner's search: one bar per configuration (splits, TP placements and baselines alike),
    its interval as an error bar, a bound hatched with its ">=" or "<" over it.
    {label: {"goodput_per_gpu", "low", "high", "censored"} as plotted}."""
    labels = style.order(goodputs)
    plotted = {
        label: {
            "goodput_per_gpu": float(goodputs[label]["goodput_per_gpu"]),
            "low": as_float(goodputs[label].get("goodput_per_gpu_low")),
            "high": as_float(goodputs[label].get("goodput_per_gpu_high")),
            "censored": goodputs[label].get("goodput_censored") or "",
        }
        for label in labels
    }
    at = np.arange(len(labels))
    bars = ax.bar(
        at, [plotted[k]["goodput_per_gpu"] for k in labels], 0.6, color=[style.colour(k) for k in labels], **BAR
    )
    for x, label, bar in zip(at, labels, bars):
        error_bars(ax, [x], [plotted[label]["low"]], [plotted[label]["high"]], "black", label)
        if plotted[label]["censored"]:
            bar.set_hatch("//")
            ax.annotate(
                bound_text(plotted[label]), (x, plotted[label]["goodput_per_gpu"]), ha="center", va="bottom", fontsize=7
            )
    ax.set_xticks(at, labels, rotation=30, ha="right", fontsize=7)
    ax.set(xlabel="configuration", ylabel="goodput per GPU (req/s)")
    return plotted


def bound_text(line: Mapping) -> str:
    return f"{'>=' if line['censored'] == 'above' else '<'} {line['goodput_per_gpu']:.3g}"


def ttft_by_bucket(ax, buckets: pd.DataFrame, percentile: str = "p50") -> dict[str, dict]:
    """Grouped bars: TTFT (ms) per input-length bucket and label with its interval, from
    Sweep.ttft_buckets() (one cell per label); empty buckets are left out.
    {label: {bucket: {"ms", "low", "high", "count"}}}."""
    names = [b for b in BUCKETS if b in set(buckets["bucket"])]
    plotted: dict[str, dict] = {}
    for label in style.order(buckets["label"]):
        rows = buckets[buckets["label"] == label]
        low, high = column_bounds(rows, percentile, MS)
        plotted[label] = {
            row["bucket"]: {"ms": float(row[percentile]) * MS, "low": lo, "high": hi, "count": int(row["count"])}
            for row, lo, hi in zip(rows.to_dict("records"), low, high)
        }
    grouped_bars(
        ax,
        names,
        {
            label: {b: (v["ms"], v["low"], v["high"]) for b, v in by_bucket.items()}
            for label, by_bucket in plotted.items()
        },
    )
    ax.set(xlabel="input length (tokens)", ylabel=f"{percentile} TTFT (ms)")
    style.legend(ax, above=True)
    return plotted


SUMMARY_METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def metric_name(metric: str) -> str:
    """ "ttft_p99" -> "TTFT p99"."""
    what, _, stat = metric.rpartition("_")
    return f"{what.upper()} {stat}"


def latency_summary(ax, cells: pd.DataFrame, metrics: Sequence[str] = SUMMARY_METRICS) -> dict[str, dict]:
    """mode_compare's figures side by side: per latency percentile, one bar per label (one cell
    each) with its interval, on a log axis. {label: {metric: {"ms", "low", "high"}}}."""
    plotted: dict[str, dict] = {}
    for label in style.order(cells["label"]):
        row = cells[cells["label"] == label].iloc[:1]
        plotted[label] = {}
        for metric in metrics:
            (low,), (high,) = column_bounds(row, metric, MS)
            plotted[label][metric] = {"ms": float(row[metric].iloc[0]) * MS, "low": float(low), "high": float(high)}
    names = {m: metric_name(m) for m in metrics}
    bars = {
        label: {names[m]: (v["ms"], v["low"], v["high"]) for m, v in by_metric.items()}
        for label, by_metric in plotted.items()
    }
    grouped_bars(ax, list(names.values()), bars)
    ax.set_yscale("log")
    style.plain_ticks(ax.yaxis)
    ax.set(ylabel="latency (ms)")
    style.legend(ax, above=True)
    return plotted
