"""One function per figure of the studies. Each takes the data and a matplotlib `ax`, draws, and
returns exactly what it plotted (in the units on the axes), bounds included, so tests can hold
the figure to the saved summaries. Latencies are drawn in milliseconds; rates in requests per
second.

A figure that compares configurations draws each cell's value (a point's repeats together: the
sweep's intervals.parquet, or the aggregate in sweep.json) with its 95% interval: a shaded band
along a line, error bars on bars and markers (analysis.bounds). A bound the results do not have
(a sweep saved without intervals) is NaN in what is returned, and nothing is drawn for it.

Bar figures are in analysis.bars, the interference study's panels in analysis.interference,
figures of one run (request timeline, GPU telemetry, KV bandwidth) in analysis.system; all are
re-exported here, so `analysis.figures` is the one place to look.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.ticker import PercentFormatter

from analysis import style
from analysis.bars import MS, goodput_bars, goodput_by_split, grouped_bars, latency_summary, ttft_by_bucket  # noqa: F401
from analysis.bounds import as_float, band, column_bounds, error_bars
from analysis.interference import decode_step_times, itl_inflation  # noqa: F401  (re-exported)
from analysis.system import gpu_telemetry, kv_bandwidth, request_timeline  # noqa: F401  (re-exported)
from testbed.metrics.slo import goodput

THRESHOLD = 0.9  # SLO attainment that defines goodput (DistServe)


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
    style.legend(ax)
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


def metric_by_label(
    ax, table: pd.DataFrame, x: str, y: str, scale: float = 1.0, linestyle: str = "-", legend: bool = True
) -> dict[str, dict]:
    """One line per label of table[y] * scale against table[x], its interval (`<y>_low`,
    `<y>_high`) shaded: {label: {"x", "y", "low", "high"} as plotted}."""
    plotted = {}
    for label in style.order(table["label"]):
        rows = table[table["label"] == label].sort_values(x)
        xs, ys = rows[x].to_numpy(dtype=float), rows[y].to_numpy(dtype=float) * scale
        low, high = column_bounds(rows, y, scale)
        kwargs = style.line_style(label) | ({} if legend else {"label": "_nolegend_"})
        ax.plot(xs, ys, linestyle=linestyle, **kwargs)
        band(ax, xs, low, high, style.colour(label), f"{label}:{y}")
        plotted[label] = {"x": xs, "y": ys, "low": low, "high": high}
    return plotted


def latency_vs_rate(
    ax,
    cells: pd.DataFrame,
    metric: str = "ttft",
    percentiles=("p50", "p99"),
    x: str = "rate",
    slo_s: float | None = None,
    points: pd.DataFrame | None = None,
    crossings: Mapping[str, float] | None = None,
) -> dict[str, dict]:
    """p50 (solid) and p99 (dashed) of a latency metric against the rate, per label, each with its
    interval; every run at every rate (`points`: a goodput search's rates too) as a dot; each
    label's goodput (`crossings`) as a dotted vertical line; the metric's SLO as a horizontal line
    where given: {percentile: {label: {"x", "y", "low", "high", "runs_x", "runs_y", "crossing"} (ms)}}."""
    plotted = {}
    for i, p in enumerate(percentiles):
        plotted[p] = metric_by_label(
            ax, cells, x, f"{metric}_{p}", MS, style.PERCENTILE_STYLES.get(p, ":"), legend=i == 0
        )
        for label, line in plotted[p].items():
            line.update(_runs_of(ax, points, label, x, f"{metric}_{p}", "o" if i == 0 else "^"))
            line["crossing"] = _crossing(ax, (crossings or {}).get(label), label, first=i == 0)
    if slo_s:
        ax.axhline(slo_s * MS, color="black", linewidth=0.7, linestyle=":")
        ax.annotate(
            f"SLO {slo_s * MS:g} ms", (0.01, slo_s * MS), xycoords=("axes fraction", "data"), fontsize=6, va="bottom"
        )
    ax.set(xlabel="request rate (req/s)" if x == "rate" else x, ylabel=f"{metric.upper()} (ms)")
    ax.set_yscale("log")
    style.plain_ticks(ax.yaxis)
    style.legend(ax, {p: style.PERCENTILE_STYLES.get(p, ":") for p in percentiles})  # colour: config, line: percentile
    return plotted


def _runs_of(ax, points: pd.DataFrame | None, label: str, x: str, y: str, marker: str) -> dict:
    """Each run of `label` as a small dot at its own rate (ms): what the cell lines leave out."""
    if points is None or y not in points or x not in points:
        return {"runs_x": np.array([]), "runs_y": np.array([])}
    rows = points[points["label"] == label]
    xs, ys = rows[x].to_numpy(dtype=float), rows[y].to_numpy(dtype=float) * MS
    ax.scatter(xs, ys, s=6, marker=marker, color=style.colour(label), alpha=0.6, linewidths=0, label="_nolegend_")
    return {"runs_x": xs, "runs_y": ys}


def _crossing(ax, rate: float | None, label: str, first: bool) -> float:
    """The label's goodput as a vertical dotted line (drawn once per axis); NaN where it has none."""
    if rate is None or not np.isfinite(rate) or rate <= 0:
        return np.nan
    if first:
        ax.axvline(rate, color=style.colour(label), linewidth=0.8, linestyle=":", label="_nolegend_")
    return float(rate)


def attainment_vs_rate(
    ax,
    cells: pd.DataFrame,
    goodputs: Mapping[str, Mapping] | None = None,
    threshold: float = THRESHOLD,
    points: pd.DataFrame | None = None,
) -> dict[str, dict]:
    """SLO attainment against rate per label: every point its repeats ran (grid and search:
    `points`, the sweep's finished rows) as a dot, the monotone fit of them all (weighted by
    requests, as each repeat's goodput is read) as the line, the grid cells' 95% intervals
    shaded, the 90% line, and each label's goodput marked at it with its interval across repeats
    (`goodputs`, sweep.json "goodput"; else the crossing of the drawn curve). {label: {"rate",
    "attainment", "low", "high", "points_rate", "points_attainment", "goodput", "goodput_low",
    "goodput_high"}}."""
    lines = _fitted_lines(ax, points) if points is not None and len(points) else {}
    bands = metric_by_label(ax, cells, "rate", "slo_attainment") if not lines else _grid_bars(ax, cells)
    plotted = {}
    for label, band_line in bands.items():
        line = lines.get(label, {"x": band_line["x"], "y": band_line["y"], "dots": (np.array([]), np.array([]))})
        known = (goodputs or {}).get(label)
        value, low, high = (
            (float(known["goodput"]), as_float(known.get("goodput_low")), as_float(known.get("goodput_high")))
            if known is not None
            else (goodput(line["x"], line["y"], threshold), np.nan, np.nan)
        )
        if value > 0:  # 0 means no swept rate meets the threshold: nothing on the curve to mark
            ax.plot(
                [value],
                [threshold],
                marker="*",
                markersize=9,
                color=style.colour(label),
                linestyle="none",
                markeredgecolor="black",
                markeredgewidth=0.4,
                label="_nolegend_",
            )
            error_bars(ax, [threshold], [low], [high], style.colour(label), f"{label}:goodput", horizontal=True)
        plotted[label] = {
            "rate": line["x"],
            "attainment": line["y"],
            "low": band_line["low"],
            "high": band_line["high"],
            "grid_rate": band_line["x"],
            "points_rate": line["dots"][0],
            "points_attainment": line["dots"][1],
            "goodput": value,
            "goodput_low": low,
            "goodput_high": high,
        }
    ax.axhline(threshold, color="black", linewidth=0.7, linestyle=":")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05))
    ax.set_xscale("log")
    style.plain_ticks(ax.xaxis)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    style.legend(ax)
    return plotted


def _grid_bars(ax, cells: pd.DataFrame) -> dict[str, dict]:
    """The grid cells' attainment intervals as error bars at their rates (the line is the fit)."""
    out = {}
    for label in style.order(cells["label"]):
        rows = cells[cells["label"] == label].sort_values("rate")
        xs, ys = rows["rate"].to_numpy(dtype=float), rows["slo_attainment"].to_numpy(dtype=float)
        low, high = column_bounds(rows, "slo_attainment")
        error_bars(ax, xs, low, high, style.colour(label), f"{label}:slo_attainment")
        out[label] = {"x": xs, "y": ys, "low": low, "high": high}
    return out


def _fitted_lines(ax, points: pd.DataFrame) -> dict[str, dict]:
    """Per label: every point as a dot and the monotone fit through all of them as the line."""
    from testbed.metrics.rate_search import monotone_fit

    out = {}
    for label in style.order(points["label"]):
        rows = points[points["label"] == label]
        weights = (
            (rows["num_requests_total"] - rows.get("num_requests_rejected", 0)).to_numpy(float)
            if "num_requests_total" in rows.columns
            else None
        )
        curve = monotone_fit(rows["rate"].to_numpy(float), rows["slo_attainment"].to_numpy(float), weights)
        colour = style.colour(label)
        ax.plot(
            rows["rate"],
            rows["slo_attainment"],
            marker="o",
            markersize=2.5,
            linestyle="none",
            color=colour,
            alpha=0.5,
            label="_nolegend_",
        )
        ax.plot(curve.rates, curve.fitted, **style.line_style(label))
        out[label] = {
            "x": curve.rates,
            "y": curve.fitted,
            "dots": (rows["rate"].to_numpy(float), rows["slo_attainment"].to_numpy(float)),
        }
    return out


def tightest_scale(scales: Sequence[float], attainment: Sequence[float], threshold: float = THRESHOLD) -> float:
    """The smallest SLO scale still meeting the threshold, interpolated like goodput; NaN when no
    scale does. goodput finds the *highest* passing x, so it is given the scales negated."""
    if not np.any(np.asarray(attainment, dtype=float) >= threshold):
        return float("nan")
    return -goodput([-s for s in scales], attainment, threshold)


def attainment_vs_scale(ax, curves: Mapping[str, Mapping], threshold: float = THRESHOLD) -> dict[str, dict]:
    """slo_scale's aggregate curves ({label: {"scales", "attainment", "low", "high"}}): attainment
    against the SLO scale with its interval shaded, the threshold line, and the tightest scale
    meeting it marked. {label: {"scales", "attainment", "low", "high", "tightest_scale"}}."""
    plotted = {}
    for label in style.order(curves):
        curve = curves[label]
        scales = np.asarray(curve["scales"], dtype=float)
        attainment = np.asarray(curve["attainment"], dtype=float)
        low, high = (np.array([as_float(v) for v in curve.get(side, [None] * len(scales))]) for side in ("low", "high"))
        ax.plot(scales, attainment, **style.line_style(label))
        band(ax, scales, low, high, style.colour(label), f"{label}:slo_attainment")
        tightest = tightest_scale(scales, attainment, threshold)
        if np.isfinite(tightest):
            ax.plot(
                [tightest],
                [threshold],
                marker="*",
                markersize=9,
                color=style.colour(label),
                linestyle="none",
                markeredgecolor="black",
                markeredgewidth=0.4,
            )
        plotted[label] = {
            "scales": scales,
            "attainment": attainment,
            "low": low,
            "high": high,
            "tightest_scale": tightest,
        }
    ax.axhline(threshold, color="black", linewidth=0.7, linestyle=":")
    ax.set(xlabel="SLO scale (x both SLOs)", ylabel="SLO attainment", ylim=(0, 1.05))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    style.legend(ax)
    return plotted


def chunk_tradeoff(ax, cells: pd.DataFrame, ttft: str = "ttft_p50") -> dict[str, np.ndarray]:
    """chunk_sweep: TTFT against p99 ITL, one point per chunk size with both intervals as error
    bars, joined in chunk order and labelled by it (Sarathi-Serve's trade-off). ms throughout."""
    rows = cells.sort_values("chunk")
    x, y = rows["itl_p99"].to_numpy(dtype=float) * MS, rows[ttft].to_numpy(dtype=float) * MS
    (x_low, x_high), (y_low, y_high) = column_bounds(rows, "itl_p99", MS), column_bounds(rows, ttft, MS)
    chunks = rows["chunk"].to_numpy()
    colour = style.colour("chunked")
    ax.plot(x, y, **style.line_style("chunked"))
    error_bars(ax, y, x_low, x_high, colour, "chunked:itl_p99", horizontal=True)
    error_bars(ax, x, y_low, y_high, colour, f"chunked:{ttft}")
    for xi, yi, c in zip(x, y, chunks):
        ax.annotate(f"{int(c)}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6)
    ax.set(xlabel="p99 ITL (ms)", ylabel=f"{ttft.split('_')[-1]} TTFT (ms)")
    return {
        "chunk": chunks,
        "itl_p99": x,
        "itl_p99_low": x_low,
        "itl_p99_high": x_high,
        "ttft": y,
        "ttft_low": y_low,
        "ttft_high": y_high,
    }


def ttft_by_turn(ax, turns: Mapping[str, Mapping], cells: pd.DataFrame) -> dict[str, dict]:
    """multiturn's aggregate ({cell: {"ttft_mean_by_turn", "..._low", "..._high"}}): mean TTFT
    per turn with its interval, one line per cell (colour: configuration, line style: dispatch
    policy). {cell: {"turn", "ttft", "low", "high"} (ms)}."""
    return by_turn(ax, turns, cells, "ttft", "mean TTFT (ms)", MS)


def kv_bytes_by_turn(ax, turns: Mapping[str, Mapping], cells: pd.DataFrame) -> dict[str, dict]:
    """The same lines for the mean KV bytes moved per request of each turn (KiB; 0 where none
    moved). {cell: {"turn", "kv_kib", "low", "high"}}."""
    return by_turn(ax, turns, cells, "kv_bytes", "mean KV moved per request (KiB)", 1 / 1024, y="kv_kib")


def by_turn(
    ax, turns: Mapping[str, Mapping], cells: pd.DataFrame, name: str, ylabel: str, scale: float, y: str = ""
) -> dict[str, dict]:
    """`{name}_mean_by_turn` of each cell of multiturn's aggregate with its interval, times `scale`."""
    knobs = cells.set_index("cell")
    dashes = {d: s for d, s in zip(sorted(set(cells.get("dispatch", []))), ["-", "--", ":", "-."])}
    handoffs = {"resend": "o", "incremental": "s", "ppd": "^"}  # one split's hand-offs share its colour
    key, plotted = f"{name}_mean_by_turn", {}
    for cell, body in turns.items():
        if key not in body:
            continue
        turn = np.array(sorted(int(t) for t in body[key]), dtype=float)
        values, low, high = (
            np.array([as_float(body.get(k, {}).get(str(int(t)))) for t in turn]) * scale
            for k in (key, f"{key}_low", f"{key}_high")
        )
        label, dispatch = knobs.loc[cell, "label"], knobs.loc[cell].get("dispatch", "")
        marker = handoffs.get(knobs.loc[cell].get("handoff"), style.marker(label))
        ax.plot(
            turn,
            values,
            color=style.colour(label),
            marker=marker,
            linestyle=dashes.get(dispatch, "-"),
            label=f"{label} {dispatch}".strip(),
        )
        band(ax, turn, low, high, style.colour(label), cell)
        plotted[cell] = {"turn": turn, y or name: values, "low": low, "high": high}
    ax.set(xlabel="turn", ylabel=ylabel)
    ax.set_xticks(sorted({int(t) for line in plotted.values() for t in line["turn"]}))
    style.legend(ax, beside=len(plotted) > 4)
    return plotted


def decode_itl_with_appends(ax, itl: Mapping[str, Mapping], cells: pd.DataFrame) -> dict[str, dict]:
    """multiturn's "decode_itl_p99" ({cell: {"with_appends" | "decode_only": [p99, low, high]}}, s):
    the decode workers' p99 per-token step time with appends beside the decodes and without,
    as bars per cell. {"with appends" | "decode only": {cell label: (ms, low, high)}}."""
    knobs = cells.set_index("cell")
    groups = [f"{knobs.loc[c, 'label']} {knobs.loc[c].get('dispatch', '')}".strip() for c in itl]
    values = {
        kind.replace("_", " "): {
            g: tuple(as_float(v) * MS for v in body.get(kind) or (np.nan,) * 3) for g, body in zip(groups, itl.values())
        }
        for kind in ("with_appends", "decode_only")
    }
    grouped_bars(ax, groups, values)
    ax.set(ylabel="p99 step time per token on D (ms)")
    for tick in ax.get_xticklabels():
        tick.set(rotation=30, horizontalalignment="right")
    style.legend(ax)
    return values


def sim_vs_real(ax, cells: pd.DataFrame, metrics=("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")) -> dict:
    """sim_validate: each cell's simulated figure against the real one (ms), per metric, each
    with its intervals (real: horizontal, simulated: vertical), and the y = x line: the
    simulator is right where the markers sit on it. {metric: {"label", "rate", "real",
    "real_low", "real_high", "sim", "sim_low", "sim_high"}}."""
    real = cells[cells["executor"] == "real"].set_index(["label", "rate"])
    sim = cells[cells["executor"] == "sim"].set_index(["label", "rate"])
    both = real.index.intersection(sim.index)
    plotted = {}
    for marker, metric in zip("osD^", metrics):
        measured, simulated = real.loc[both], sim.loc[both]
        x, y = measured[metric].to_numpy(dtype=float) * MS, simulated[metric].to_numpy(dtype=float) * MS
        (x_low, x_high), (y_low, y_high) = column_bounds(measured, metric, MS), column_bounds(simulated, metric, MS)
        points = ax.scatter(x, y, marker=marker, label=metric.replace("_", " "), s=14)
        colour = points.get_facecolor()[0]
        error_bars(ax, y, x_low, x_high, colour, f"{metric}:real", horizontal=True)
        error_bars(ax, x, y_low, y_high, colour, f"{metric}:sim")
        plotted[metric] = {
            "label": [str(k[0]) for k in both],
            "rate": np.array([k[1] for k in both], dtype=float),
            "real": x,
            "real_low": x_low,
            "real_high": x_high,
            "sim": y,
            "sim_low": y_low,
            "sim_high": y_high,
        }
    values = np.concatenate([np.ones(0), *(np.concatenate([v["real"], v["sim"]]) for v in plotted.values())])
    finite = values[np.isfinite(values) & (values > 0)]
    low, high = (finite.min() / 1.5, finite.max() * 1.5) if len(finite) else (0.1, 10.0)
    ax.plot([low, high], [low, high], color="black", linewidth=0.7, linestyle=":")
    ax.set(xscale="log", yscale="log", xlabel="real (ms)", ylabel="simulated (ms)")
    style.plain_ticks(ax.xaxis)  # 2, 3, 4 rather than overlapping 2x10^0, 3x10^0, ...
    style.plain_ticks(ax.yaxis)
    style.legend(ax)
    return plotted


def placement_goodput(axes, goodputs: Mapping[str, Mapping]) -> dict:
    """The TP placement search as heat maps of goodput per GPU (req/s), one colour scale: left, the
    disaggregated placements by (prefill TP, decode TP), each cell the best over its worker counts,
    annotated with the value and the split (P:D workers); right, colocated and chunked by TP (chunked
    the best over its chunk sizes). An empty cell was not run (pruned, or no split of the devices).
    {"disagg": {"prefill_tp", "decode_tp", "goodput_per_gpu" (rows x cols, NaN empty), "label"},
    "mixed": {"modes", "tp", "goodput_per_gpu", "label"}} as plotted."""
    best: dict = {}
    for label, g in goodputs.items():
        placement = style.placement_of(label)
        value = as_float(g.get("goodput_per_gpu"))
        if placement is None or not np.isfinite(value):
            continue
        mode, _, a, _, b = placement
        key = (mode, a, b if mode == "disagg" else 0)
        if key not in best or value > best[key][0]:
            best[key] = (value, label)
    dis = {k: v for k, v in best.items() if k[0] == "disagg"}
    mix = {k: v for k, v in best.items() if k[0] != "disagg"}
    ptp = sorted({k[1] for k in dis})
    dtp = sorted({k[2] for k in dis})
    modes = [m for m in ("colocated", "chunked") if any(k[0] == m for k in mix)]
    mtp = sorted({k[1] for k in mix})
    grid = lambda rows, cols, key: (  # noqa: E731
        np.array([[best.get(key(r, c), (np.nan, ""))[0] for c in cols] for r in rows], dtype=float).reshape(
            len(rows), len(cols)
        ),
        [[best.get(key(r, c), (np.nan, ""))[1] for c in cols] for r in rows],
    )
    disagg, disagg_labels = grid(ptp, dtp, lambda a, b: ("disagg", a, b))
    mixed, mixed_labels = grid(modes, mtp, lambda m, c: (m, c, 0))
    values = [v[0] for v in best.values()]
    top = max(values) if values else 1.0
    panels = [
        (axes[0], disagg, disagg_labels, ptp, dtp, "decode TP", "prefill TP", "disaggregated"),
        (axes[1], mixed, mixed_labels, modes, mtp, "TP", "", "colocated / chunked"),
    ]
    image = None
    for ax, data, labels, rows, cols, xlabel, ylabel, title in panels:
        if not data.size:
            ax.set_visible(False)
            continue
        image = ax.imshow(np.ma.masked_invalid(data), cmap="viridis", vmin=0, vmax=top or 1.0, aspect="auto")
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(False)
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isfinite(data[i, j]):
                    dark = data[i, j] < 0.6 * (top or 1.0)
                    ax.annotate(
                        "\n".join(filter(None, [f"{data[i, j]:.3g}", placement_text(labels[i][j])])),
                        (j, i),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if dark else "black",
                    )
                else:
                    ax.annotate("-", (j, i), ha="center", va="center", fontsize=7, color="#999999")
    if image is not None:
        image.figure.colorbar(image, ax=list(axes), label="goodput per GPU (req/s)", shrink=0.9)
    return {
        "disagg": {"prefill_tp": ptp, "decode_tp": dtp, "goodput_per_gpu": disagg, "label": disagg_labels},
        "mixed": {"modes": modes, "tp": mtp, "goodput_per_gpu": mixed, "label": mixed_labels},
    }


def placement_text(label: str) -> str:
    """A heat-map cell's second line: the split of workers (2P:1D), or the chunked variant."""
    placement = style.placement_of(label)
    if placement is None or not label:
        return ""
    mode, p, _, d, _ = placement
    if mode == "disagg":
        return f"{p}P:{d}D"
    chunk = label.removeprefix(mode)
    return f"chunk {chunk}" if mode == "chunked" and chunk.isdigit() else ""
