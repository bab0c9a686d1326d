"""Captions whose numbers come from what a figure plotted (the dicts the figure functions
return), so the text under a figure can never disagree with it. A figure's value comes with its
95% interval in brackets. A caption names a leader from the paired verdict only (per-seed
differences, as the study's own verdict: paired_leader), never from overlapping unpaired
intervals; where the results hold no per-seed figure it orders by the unpaired intervals and
says so (leader)."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from analysis import style
from testbed.metrics.uncertainty import overlaps


def ms(value: float) -> str:
    """A latency already in ms, to three significant figures (in seconds from 1000 ms on)."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.3g} ms" if abs(value) < 1000 else f"{value / 1000:.3g} s"


def rate(value: float, low: float = math.nan, high: float = math.nan) -> str:
    """A rate with its interval when known: "8 [0, 110] req/s"."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3g}{bracket(low, high)} req/s"


def slo_text(table: pd.DataFrame) -> str:
    """ "TTFT <= 500 ms, TPOT <= 50 ms" from the sweep table's slo_* columns (one SLO per study)."""
    if not {"slo_ttft_s", "slo_tpot_s"} <= set(table.columns) or table.empty:
        return "the run's SLOs"
    ttft, tpot = table["slo_ttft_s"].iloc[0] * 1e3, table["slo_tpot_s"].iloc[0] * 1e3
    return f"TTFT \u2264 {ttft:.3g} ms, TPOT \u2264 {tpot:.3g} ms"


def num(value: float) -> str:
    """Three significant figures, without an exponent for numbers up to 10^6."""
    return f"{value:.3g}" if abs(value) < 1000 or abs(value) >= 1e6 else f"{value:.0f}"


def bracket(low: float, high: float) -> str:
    """ " [low, high]", or nothing when the interval is unknown."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    return f" [{num(low)}, {num(high)}]"


def ms_interval(value: float, low: float = math.nan, high: float = math.nan) -> str:
    """A latency in ms with its interval: "12.3 [10.1, 14.2] ms" (seconds from 1000 ms on)."""
    if value is None or not math.isfinite(value):
        return "n/a"
    scale, unit = (1.0, "ms") if abs(value) < 1000 else (1e-3, "s")
    return f"{num(value * scale)}{bracket(low * scale, high * scale)} {unit}"


def paired_leader(runs: pd.DataFrame | None, column: str, what: str, lower: bool = False) -> str:
    """Who leads on `column` by the paired verdict over the seeds the labels share (`runs`: one
    row per point with "label", "seed" and the figure; lower or higher is better); empty where
    fewer than two labels or no shared seeds have it."""
    from testbed.metrics.comparisons import verdict
    from testbed.metrics.rate_search import Goodput

    if runs is None or column not in runs.columns or "seed" not in runs.columns:
        return ""
    sign = -1.0 if lower else 1.0
    values = {
        label: {
            int(r.seed): Goodput(sign * float(getattr(r, column)))
            for r in rows.itertuples()
            if math.isfinite(float(getattr(r, column)))
        }
        for label, rows in runs.groupby("label", sort=False)
    }
    values = {k: v for k, v in values.items() if v}
    if len(values) < 2:
        return ""
    chosen = verdict(values, unit="")
    word = "lowest" if lower else "highest"
    first = chosen["comparisons"][0]
    if chosen["separated"]:
        return (
            f"{word} {what}: {chosen['label']}, ahead of {first['other']} by "
            f"{abs(first['difference']):.3g} [{abs(first['difference_low']):.3g}, "
            f"{abs(first['difference_high']):.3g}] (paired over {first['seeds']} seeds)"
            if not lower
            else f"{word} {what}: {chosen['label']}, separated from every other seed by seed "
            f"(paired over {first['seeds']} seeds)"
        )
    tied = [c["other"] for c in chosen["comparisons"] if not c["separated"]]
    return f"{word} {what}: leaders not separated seed by seed ({chosen['label']}, {', '.join(tied)})"


def leader(estimates: Mapping[str, tuple], what: str, lower: bool = False) -> str:
    """Who leads on `what` ({label: (value, low, high)}; lower or higher is better) where no
    per-seed figure is at hand: named only when its unpaired interval clears every other's (and
    labelled unpaired); empty with fewer than two finite values."""
    finite = {k: tuple(float(x) for x in v) for k, v in estimates.items() if math.isfinite(float(v[0]))}
    if len(finite) < 2:
        return ""
    ranked = sorted(style.order(finite), key=lambda k: finite[k][0], reverse=not lower)
    top, word = ranked[0], "lowest" if lower else "highest"
    tied = [k for k in ranked if k == top or overlaps(finite[top][1:], finite[k][1:])]
    if len(tied) == 1:
        return f"{word} {what}: {top}, clear of {ranked[1]} (unpaired intervals)"
    known = all(math.isfinite(b) for k in tied for b in finite[k][1:])
    why = "95% intervals overlap" if known else "no interval to tell them apart"
    return f"{word} {what}: leaders not separated ({', '.join(tied)}: {why})"


def sentence(*parts: str) -> str:
    """Parts joined by "; " (empty ones left out), ending with a full stop."""
    return "; ".join(p for p in parts if p) + "."


def goodput_per_gpu(plotted: Mapping[str, Mapping], best: Mapping | None = None) -> str:
    """best: the aggregate's verdict (sweep.json "best"); its line says whether the leader is
    separated. Without it the plotted intervals decide."""
    parts = [f"{label} {rate(g['goodput_per_gpu'], g['low'], g['high'])}" for label, g in plotted.items()]
    verdict = (best or {}).get("line") or "no paired verdict in these results"
    return sentence(f"goodput per GPU (90% SLO attainment), 95% intervals across repeats: {', '.join(parts)}", verdict)


def attainment_vs_rate(plotted: Mapping[str, dict], table: pd.DataFrame, best: Mapping | None = None) -> str:
    parts = []
    for label in style.order(plotted):
        line = plotted[label]
        # from the goodput itself: with repeats it is a mean over them, the curve a pooled estimate
        note = (
            " (no swept rate meets 90%)"
            if line["goodput"] <= 0
            else " (the highest swept rate passes: a lower bound)"
            if line["goodput"] >= max(line["rate"])
            else ""
        )
        parts.append(f"{label} {rate(line['goodput'], line['goodput_low'], line['goodput_high'])}{note}")
    return sentence(
        f"SLO attainment ({slo_text(table)}) against rate, shaded: 95% intervals; goodput at 90%: {', '.join(parts)}",
        (best or {}).get("line", ""),
    )


def attainment_vs_scale(plotted: Mapping[str, dict]) -> str:
    parts = []
    for label in style.order(plotted):
        s = plotted[label]["tightest_scale"]
        parts.append(f"{label} {s:.3g}x" if math.isfinite(s) else f"{label} none")
    return f"tightest SLO scale with 90% attainment: {', '.join(parts)}; shaded: 95% bootstrap intervals of attainment."


def distributions(plotted: Mapping[str, tuple], what: str) -> str:
    """p50 / p99 of the values behind a CDF, per label."""
    parts = [
        f"{label} {ms(float(np.percentile(x, 50)))} / {ms(float(np.percentile(x, 99)))}"
        for label, (x, _) in plotted.items()
    ]
    return f"{what} p50 / p99: {', '.join(parts)}."


def _at_highest(lines: Mapping[str, Mapping]) -> dict[str, tuple]:
    """{label: (y, low, high, x)} at each line's highest x."""
    out = {}
    for label, line in lines.items():
        if len(line["x"]):
            i = int(np.argmax(line["x"]))
            out[label] = (line["y"][i], line["low"][i], line["high"][i], line["x"][i])
    return out


def latency_vs_rate(plotted: Mapping[str, Mapping[str, Mapping]], metric: str, runs: pd.DataFrame | None = None) -> str:
    """`runs`: the grid's points (label, seed, rate, figures): the leader at the highest rate is
    named from their paired per-seed differences."""
    last = _at_highest(plotted.get("p99", {}))
    parts = [f"{label} {ms_interval(*v[:3])} at {rate(v[3])}" for label, v in last.items()]
    top = max((v[3] for v in last.values()), default=math.nan)
    at_top = runs[runs["rate"] == top] if runs is not None and "rate" in runs.columns else None
    return sentence(
        f"p99 {metric.upper()} at the highest rate (95% intervals): {', '.join(parts)}",
        paired_leader(at_top, f"{metric}_p99", f"p99 {metric.upper()} at {rate(top)}", lower=True),
    )


INFLATION = (
    "inflation: p99 of the decode background's inter-token gaps that overlap an injected prefill over "
    "p99 of the gaps that do not, in the same run (1 = no interference)"
)


def itl_inflation(plotted: Mapping[str, Mapping]) -> str:
    last = {
        label: (line["inflation"][-1], line["low"][-1], line["high"][-1], line["prefill_len"][-1])
        for label, line in plotted.items()
        if len(line["prefill_len"])
    }
    parts = [f"{label} {v[0]:.3g}x{bracket(v[1], v[2])} at {int(v[3])} tokens" for label, v in last.items()]
    longest = max((v[3] for v in last.values()), default=math.nan)
    same = {k: v[:3] for k, v in last.items() if v[3] == longest}
    return sentence(
        f"{INFLATION}; 95% bootstrap intervals: {', '.join(parts)}",
        leader(same, "inflation at the longest prefill", lower=True),
    )


def decode_steps(plotted: Mapping[str, Mapping]) -> str:
    parts = [
        f"{label} {ms(line['with_prefill_ms'][-1])} / {ms(line['without_prefill_ms'][-1])} at "
        f"{int(line['prefill_len'][-1])} tokens"
        for label, line in plotted.items()
        if len(line["prefill_len"])
    ]
    return sentence(
        f"mean decode step of the background's workers with / without prefill work alongside: {', '.join(parts)}"
    )


def ttft_by_bucket(plotted: Mapping[str, Mapping[str, Mapping]], percentile: str) -> str:
    parts = [
        f"{label}: "
        + ", ".join(f"{b} {ms_interval(v['ms'], v['low'], v['high'])} (n={v['count']})" for b, v in buckets.items())
        for label, buckets in plotted.items()
    ]
    return sentence(f"{percentile} TTFT by input length, 95% intervals; {'; '.join(parts)}")


def chunk_tradeoff(plotted: Mapping[str, np.ndarray]) -> str:
    p = plotted
    parts = [
        f"{int(c)}: TTFT {ms_interval(p['ttft'][i], p['ttft_low'][i], p['ttft_high'][i])}, p99 ITL "
        f"{ms_interval(p['itl_p99'][i], p['itl_p99_low'][i], p['itl_p99_high'][i])}"
        for i, c in enumerate(p["chunk"])
    ]
    return sentence(f"chunk size trade-off, 95% intervals; {'; '.join(parts)}")


def latency_summary(plotted: Mapping[str, Mapping[str, Mapping]], runs: pd.DataFrame | None = None) -> str:
    """`runs`: the points (label, seed, figures): leaders from their paired per-seed differences;
    without them, from the unpaired intervals (said)."""
    metrics = list(next(iter(plotted.values()), {}))
    parts = [
        f"{label} "
        + ", ".join(f"{m.replace('_', ' ')} {ms_interval(v['ms'], v['low'], v['high'])}" for m, v in by_metric.items())
        for label, by_metric in plotted.items()
    ]
    verdicts = [
        paired_leader(runs, m, m.replace("_", " "), lower=True)
        or leader(
            {k: (v[m]["ms"], v[m]["low"], v[m]["high"]) for k, v in plotted.items()}, m.replace("_", " "), lower=True
        )
        for m in metrics
    ]
    return sentence(f"latency per configuration, 95% intervals: {'; '.join(parts)}", *verdicts)


def kv_bandwidth(plotted: Mapping[str, np.ndarray], backend: str) -> str:
    size, raw, conn = plotted["bytes"][-1], plotted["raw_gbps"][-1], plotted["connector_gbps"][-1]
    text = (
        f"KV transfer over {backend}: at {size / 2**20:.3g} MiB the connector reaches {conn:.3g} GB/s, "
        f"{conn / raw:.0%} of a raw send ({raw:.3g} GB/s)."
    )
    if "ipc_gbps" in plotted:
        at, ipc, copy = plotted["ipc_bytes"][-1], plotted["ipc_gbps"][-1], plotted["copy_gbps"][-1]
        text += f" ipc at {at / 2**20:.3g} MiB: {ipc:.3g} GB/s, {ipc / copy:.0%} of a copy of the same bytes."
    return text


def timeline(segments: pd.DataFrame, means: Mapping[str, float], point: str) -> str:
    parts = [f"{name.replace('_', ' ')} {ms(v * 1e3)}" for name, v in means.items()]
    return f"{point}: first {segments['request_id'].nunique()} requests; mean per request: {', '.join(parts)}."


def telemetry(plotted: Mapping[int, tuple], what: str) -> str:
    parts = [f"GPU {gpu} {np.nanmean(y):.3g}" for gpu, (_, y) in plotted.items() if len(y)]
    return f"mean {what}: {', '.join(parts)}."


def by_knob(plotted: Mapping[str, Mapping], what: str, knob: str, x: str = "x", y: str = "y", better: str = "") -> str:
    """Each line's values with their intervals; better ("lower" / "higher"): also who leads at
    the last value of the knob."""
    parts = [
        f"{label} "
        + ", ".join(
            f"{xi:g}: {yi:.3g}{bracket(lo, hi)}" for xi, yi, lo, hi in zip(line[x], line[y], line["low"], line["high"])
        )
        for label, line in plotted.items()
    ]
    verdict = ""
    if better:
        last = {
            label: (line[y][-1], line["low"][-1], line["high"][-1]) for label, line in plotted.items() if len(line[x])
        }
        verdict = leader(last, f"{what} at the largest {knob}", lower=better == "lower")
    return sentence(f"{what} by {knob}, 95% intervals; {'; '.join(parts)}", verdict)


def by_group(values: Mapping[str, tuple], what: str) -> str:
    """One value per group ({group: (value, low, high)}), each with its interval; n/a where none."""
    parts = [
        f"{group} {num(v[0])}{bracket(v[1], v[2])}" if math.isfinite(v[0]) else f"{group} n/a"
        for group, v in values.items()
    ]
    return sentence(f"{what}, 95% intervals; {', '.join(parts)}")


def placement_goodput(plotted: Mapping[str, Mapping], best: Mapping | None = None) -> str:
    """The placement heat maps' caption: each cell's value and placement, read from what was drawn."""

    def cells(panel: Mapping, rows: str, cols: str, name) -> list[str]:
        out = []
        for i, r in enumerate(panel[rows]):
            for j, c in enumerate(panel[cols]):
                value = float(panel["goodput_per_gpu"][i][j])
                if math.isfinite(value):
                    out.append(f"{name(r, c)} {value:.3g} ({panel['label'][i][j]})")
        return out

    disagg = cells(plotted["disagg"], "prefill_tp", "decode_tp", lambda a, b: f"P TP{a} / D TP{b}")
    mixed = cells(plotted["mixed"], "modes", "tp", lambda m, c: f"{m} TP{c}")
    return sentence(
        "Goodput per GPU (req/s, 90% SLO attainment) of each tensor-parallel placement; disaggregated by "
        f"(prefill TP, decode TP), the best over worker counts per cell: {', '.join(disagg) or 'none ran'}",
        f"colocated and chunked by TP: {', '.join(mixed) or 'none ran'}",
        (best or {}).get("line", ""),
    )
