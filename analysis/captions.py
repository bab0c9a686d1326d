"""Captions whose numbers come from what a figure plotted (the dicts the figure functions
return), so the text under a figure can never disagree with it."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from analysis import style


def ms(value: float) -> str:
    """A latency already in ms, to three significant figures (in seconds from 1000 ms on)."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.3g} ms" if abs(value) < 1000 else f"{value / 1000:.3g} s"


def rate(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3g} req/s"


def slo_text(table: pd.DataFrame) -> str:
    """"TTFT <= 500 ms, TPOT <= 50 ms" from the sweep table's slo_* columns (one SLO per study)."""
    if not {"slo_ttft_s", "slo_tpot_s"} <= set(table.columns) or table.empty:
        return "the run's SLOs"
    ttft, tpot = table["slo_ttft_s"].iloc[0] * 1e3, table["slo_tpot_s"].iloc[0] * 1e3
    return f"TTFT \u2264 {ttft:.3g} ms, TPOT \u2264 {tpot:.3g} ms"


def best(values: Mapping[str, float]) -> str:
    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    if not finite:
        return "none"
    top = max(finite.values())
    winners = [k for k in style.order(finite) if finite[k] == top]
    return winners[0] if len(winners) == 1 else " = ".join(winners) + " (tie)"


def goodput_per_gpu(plotted: Mapping[str, float]) -> str:
    parts = [f"{label} {rate(plotted[label])}" for label in style.order(plotted)]
    return f"goodput per GPU (90% SLO attainment): {', '.join(parts)}; best: {best(plotted)}."


def attainment_vs_rate(plotted: Mapping[str, dict], table: pd.DataFrame) -> str:
    parts = []
    for label in style.order(plotted):
        line = plotted[label]
        passing = np.asarray(line["attainment"]) >= 0.9
        note = (" (every swept rate passes: a lower bound)" if passing.all()
                else " (no swept rate meets 90%)" if not passing.any() else "")
        parts.append(f"{label} {rate(line['goodput'])}{note}")
    return f"SLO attainment ({slo_text(table)}) against rate; goodput at 90%: {', '.join(parts)}."


def attainment_vs_scale(plotted: Mapping[str, dict]) -> str:
    parts = []
    for label in style.order(plotted):
        s = plotted[label]["tightest_scale"]
        parts.append(f"{label} {s:.3g}x" if math.isfinite(s) else f"{label} none")
    return f"tightest SLO scale with 90% attainment: {', '.join(parts)}."


def distributions(plotted: Mapping[str, tuple], what: str) -> str:
    """p50 / p99 of the values behind a CDF, per label."""
    parts = [f"{label} {ms(float(np.percentile(x, 50)))} / {ms(float(np.percentile(x, 99)))}"
             for label, (x, _) in plotted.items()]
    return f"{what} p50 / p99: {', '.join(parts)}."


def latency_vs_rate(plotted: Mapping[str, Mapping[str, tuple]], metric: str) -> str:
    parts = []
    for label, (x, y) in plotted.get("p99", {}).items():
        if len(x):
            parts.append(f"{label} {ms(y[-1])} at {rate(x[-1])}")
    return f"p99 {metric.upper()} at the highest rate: {', '.join(parts)}."


def itl_inflation(plotted: Mapping[str, tuple]) -> str:
    parts = [f"{label} {y[-1]:.3g}x at {int(x[-1])} tokens" for label, (x, y) in plotted.items() if len(x)]
    return f"p99 ITL of the decode background over its decode-only baseline: {', '.join(parts)}."


def ttft_by_bucket(plotted: Mapping[str, Mapping[str, float]], percentile: str) -> str:
    parts = [f"{label}: " + ", ".join(f"{b} {ms(v)}" for b, v in buckets.items()) for label, buckets in plotted.items()]
    return f"{percentile} TTFT by input length; {'; '.join(parts)}."


def chunk_tradeoff(plotted: Mapping[str, np.ndarray]) -> str:
    parts = [f"{int(c)}: TTFT {ms(t)}, p99 ITL {ms(i)}"
             for c, t, i in zip(plotted["chunk"], plotted["ttft"], plotted["itl_p99"])]
    return f"chunk size trade-off; {'; '.join(parts)}."


def kv_bandwidth(plotted: Mapping[str, np.ndarray], backend: str) -> str:
    size, raw, conn = plotted["bytes"][-1], plotted["raw_gbps"][-1], plotted["connector_gbps"][-1]
    return (f"KV transfer over {backend}: at {size / 2**20:.3g} MiB the connector reaches {conn:.3g} GB/s, "
            f"{conn / raw:.0%} of a raw send ({raw:.3g} GB/s).")


def timeline(segments: pd.DataFrame, means: Mapping[str, float], point: str) -> str:
    parts = [f"{name.replace('_', ' ')} {ms(v * 1e3)}" for name, v in means.items()]
    return f"{point}: first {segments['request_id'].nunique()} requests; mean per request: {', '.join(parts)}."


def telemetry(plotted: Mapping[int, tuple], what: str) -> str:
    parts = [f"GPU {gpu} {np.nanmean(y):.3g}" for gpu, (_, y) in plotted.items() if len(y)]
    return f"mean {what}: {', '.join(parts)}."


def by_knob(plotted: Mapping[str, tuple], what: str, knob: str) -> str:
    parts = [f"{label} " + ", ".join(f"{x:g}: {y:.3g}" for x, y in zip(xs, ys)) for label, (xs, ys) in plotted.items()]
    return f"{what} by {knob}; {'; '.join(parts)}."
