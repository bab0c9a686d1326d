"""Each study's standard figures, from its saved sweep: `study_figures(name, sweep_dir)` writes
<sweep_dir>/figures/<figure>.pdf/.png/.txt (the .txt is the caption, numbers computed from the
plotted data) and returns the PDF and PNG paths. `run_figures(run_dir)` does the same for one run.
`draw(name, sweep)` builds them without saving: (stem, figure, caption, what it plotted) each,
which is what a notebook shows and what the tests hold to the saved summaries.

MAKERS holds one maker per figure, by name; a study's record (testbed/studies/catalog.py,
Study.figures) names the figures it draws.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from analysis import captions, figures, style, system
from analysis.load import Sweep, by_label, load_run, load_sweep, served
from testbed.studies.catalog import BY_NAME
from testbed.studies.study import Curve

Made = list[tuple[str, Figure, str, object]]  # (file stem, figure, caption, what it plotted)
TIMELINE_REQUESTS = 40  # the first requests by arrival: enough to see the pattern, few enough to read


# -- one maker per figure: Sweep -> [(stem, figure, caption, plotted)] -----------------------------
def goodput_per_gpu(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.goodput_by_split(ax, sweep.aggregate["goodput"])
    return [("goodput_per_gpu", fig, captions.goodput_per_gpu(plotted, sweep.aggregate.get("best")), plotted)]


def attainment_vs_rate(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    cells = sweep.cells()
    plotted = figures.attainment_vs_rate(ax, cells, sweep.aggregate.get("goodput"), points=sweep.searched())
    text = captions.attainment_vs_rate(plotted, cells, sweep.aggregate.get("best"))
    return [("attainment_vs_rate", fig, text, plotted)]


def latency_vs_rate(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    slo = sweep.slo()
    goodputs = sweep.aggregate.get("goodput") or {}
    crossings = {label: g["goodput"] for label, g in goodputs.items() if not g.get("goodput_censored")}
    plotted = {
        m: figures.latency_vs_rate(
            ax, sweep.cells(), m, slo_s=slo.get(f"{m}_s"), points=sweep.searched(), crossings=crossings
        )
        for ax, m in zip(axes, ("ttft", "tpot"))
    }
    runs = sweep.finished()
    text = " ".join(captions.latency_vs_rate(v, m, runs) for m, v in plotted.items())
    text += (
        " Lines: the grid rates' cells with their 95% intervals; dots (p50) and triangles (p99): each run at its"
        " own rate, a goodput search's included; dotted verticals: each configuration's goodput."
    )
    return [("latency_vs_rate", fig, text, plotted)]


def latency_cdfs(sweep: Sweep) -> Made:
    """TTFT and ITL distributions per configuration, its repeats pooled."""
    fig, axes = style.figure("double", cols=2)
    ttft = figures.ttft_cdf(axes[0], sweep.requests())
    itl = figures.itl_cdf(axes[1], by_label(sweep.itls(), sweep.finished()))
    text = " ".join([captions.distributions(ttft, "TTFT"), captions.distributions(itl, "ITL")])
    return [("latency_cdf", fig, text, {"ttft": ttft, "itl": itl})]


def latency_summary(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.latency_summary(ax, sweep.cells())
    return [("latency_summary", fig, captions.latency_summary(plotted, sweep.finished()), plotted)]


def timelines(sweep: Sweep) -> Made:
    """The timeline of the first disaggregated point (the one with P and D workers to show)."""
    table = sweep.finished()
    disagg = table[table["mode"] == "disagg"]
    point = (disagg if len(disagg) else table)["point"].iloc[0]
    return run_timeline(sweep.run(point), f"timeline_{point}")


def telemetry(sweep: Sweep) -> Made:
    made = []
    for point in sweep.finished()["point"]:
        made += run_telemetry(sweep.run(point), f"telemetry_{point}")
    return made


def attainment_vs_scale(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.attainment_vs_scale(ax, sweep.aggregate["curves"])
    return [("attainment_vs_slo_scale", fig, captions.attainment_vs_scale(plotted), plotted)]


def _finite(value) -> bool:
    return value is not None and bool(np.isfinite(value))


def itl_inflation(sweep: Sweep) -> Made:
    """Two panels: the ITL view (inflation with its interval) and the step-level view; where no
    step is visible (an engine measured from outside, executor=vllm), the ITL against the
    decode-only baseline run instead."""
    fig, axes = style.figure("double", cols=2)
    agg = sweep.aggregate["interference"]
    # steps are visible wherever a decode step was measured, with or without prefill work alongside (a
    # loaded host may leave no step with both); an engine measured from outside has none at all
    entries = [e for cells in agg.values() for e in cells.values()]
    steps = any(e.get("decode_steps_with_prefill") or _finite(e.get("decode_step_s_without_prefill")) for e in entries)
    plotted = {"inflation": figures.itl_inflation(axes[0], agg)}
    texts = [captions.itl_inflation(plotted["inflation"])]
    if steps:
        plotted["decode_step"] = figures.decode_step_times(axes[1], agg)
        texts.append(captions.decode_steps(plotted["decode_step"]))
    else:
        plotted["vs_baseline"] = figures.itl_inflation(axes[1], agg, against="inflation_vs_baseline")
        texts.append("right: the same p99 over the decode-only baseline run's (no steps are visible from outside)")
    text = " ".join(texts)
    return [("itl_inflation", fig, text, plotted)]


def chunk_tradeoff(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.chunk_tradeoff(ax, sweep.cells())
    return [("chunk_tradeoff", fig, captions.chunk_tradeoff(plotted), plotted)]


def ttft_by_bucket(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    buckets = sweep.ttft_buckets()
    plotted = {p: figures.ttft_by_bucket(ax, buckets, p) for ax, p in zip(axes, ("p50", "p99"))}
    return [("ttft_by_bucket", fig, " ".join(captions.ttft_by_bucket(v, p) for p, v in plotted.items()), plotted)]


def burstiness(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    cells = sweep.cells()
    attainment = figures.metric_by_label(axes[0], cells, "burstiness", "slo_attainment")
    axes[0].set(xlabel="burstiness (gamma shape; 1 = Poisson)", ylabel="SLO attainment", ylim=(0, 1.05))
    ttft = figures.latency_vs_rate(axes[1], cells, "ttft", x="burstiness")
    for ax in axes:
        ax.set_xscale("log", base=2)
    axes[1].set_xlabel("burstiness (gamma shape; 1 = Poisson)")
    text = " ".join(
        [
            captions.by_knob(attainment, "SLO attainment", "burstiness", better="higher"),
            captions.by_knob(ttft["p99"], "p99 TTFT (ms)", "burstiness", better="lower"),
        ]
    )
    return [("burstiness", fig, text, {"attainment": attainment, "ttft": ttft})]


def latency_vs_concurrency(sweep: Sweep) -> Made:
    """A closed loop's throughput and latency against its users (the requests in flight at most)."""
    fig, axes = style.figure("double", cols=3)
    cells = sweep.cells()
    throughput = figures.metric_by_label(axes[0], cells, "concurrency", "throughput_requests_per_s")
    axes[0].set(xlabel="users (closed loop)", ylabel="throughput (req/s)")
    plotted = {"throughput": throughput}
    for ax, metric in zip(axes[1:], ("ttft", "tpot")):
        plotted[metric] = figures.latency_vs_rate(ax, cells, metric, x="concurrency")
        ax.set_xlabel("users (closed loop)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        style.plain_ticks(ax.xaxis)
    text = " ".join(
        [
            captions.by_knob(throughput, "throughput (req/s)", "users", better="higher"),
            captions.by_knob(plotted["ttft"]["p99"], "p99 TTFT (ms)", "users", better="lower"),
        ]
    )
    return [("latency_vs_concurrency", fig, text, plotted)]


def ttft_by_turn(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.ttft_by_turn(ax, sweep.aggregate["turns"], sweep.cells())
    return [("ttft_by_turn", fig, captions.by_knob(plotted, "mean TTFT (ms)", "turn", x="turn", y="ttft"), plotted)]


def kv_bytes_by_turn(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.kv_bytes_by_turn(ax, sweep.aggregate["turns"], sweep.cells())
    return [
        (
            "kv_bytes_by_turn",
            fig,
            captions.by_knob(plotted, "mean KV moved per request (KiB)", "turn", x="turn", y="kv_kib"),
            plotted,
        )
    ]


def decode_itl_with_appends(sweep: Sweep) -> Made:
    itl = sweep.aggregate.get("decode_itl_p99") or {}
    if not itl:
        return []  # no disaggregated cell
    fig, ax = style.figure()
    plotted = figures.decode_itl_with_appends(ax, itl, sweep.cells())
    text = " ".join(captions.by_group(v, f"{kind}: p99 step time per token (ms)") for kind, v in plotted.items())
    return [("decode_itl_with_appends", fig, text, plotted)]


def kv_bandwidth(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.kv_bandwidth(ax, sweep.table, sweep.aggregate.get("ceiling"), sweep.aggregate.get("ipc"))
    return [("kv_bandwidth", fig, captions.kv_bandwidth(plotted, sweep.aggregate.get("backend", "?")), plotted)]


def plan_goodput(sweep: Sweep) -> Made:
    """The simulated search of `plan`: goodput per GPU per split, the baselines as lines."""
    fig, ax = style.figure()
    simulated = sweep.aggregate["simulated"]
    plotted = figures.goodput_bars(ax, simulated["goodput"])
    analytical = (sweep.aggregate.get("analytical") or {}).get("split", "none (no split fits the devices)")
    text = f"{captions.goodput_per_gpu(plotted, simulated.get('best'))} First-order analytical split: {analytical}."
    return [("plan_goodput_per_gpu", fig, text, plotted)]


def placement_goodput(sweep: Sweep) -> Made:
    """The TP placement search (`plan` with experiment.own.tp_degrees, or ratio_sweep of a model one
    device cannot hold) as heat maps of goodput per GPU; nothing where every placement is TP1."""
    simulated = sweep.aggregate.get("simulated")
    goodputs = (simulated or {}).get("goodput") if simulated else sweep.aggregate.get("goodput")
    placed = {label: style.placement_of(label) for label in goodputs or {}}
    if not any(p and max(p[2], p[4]) > 1 for p in placed.values()):
        return []
    fig, axes = style.figure("double", cols=2)
    plotted = figures.placement_goodput(axes, goodputs)
    best = (simulated or sweep.aggregate).get("best")
    return [("placement_goodput", fig, captions.placement_goodput(plotted, best), plotted)]


def sim_vs_real(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.sim_vs_real(ax, sweep.cells())
    worst = ", ".join(f"{k} {v:.0%}" for k, v in sweep.aggregate["worst_abs_error"].items() if v is not None and v == v)
    text = (
        f"Simulated against measured latency per cell, error bars: 95% intervals; worst relative error: "
        f"{worst or 'n/a'}."
    )
    return [("sim_vs_real", fig, text, plotted)]


MAKERS: dict[str, Callable[[Sweep], Made]] = {
    make.__name__: make
    for make in (
        goodput_per_gpu,
        attainment_vs_rate,
        latency_vs_rate,
        latency_cdfs,
        latency_summary,
        timelines,
        telemetry,
        attainment_vs_scale,
        itl_inflation,
        chunk_tradeoff,
        ttft_by_bucket,
        burstiness,
        latency_vs_concurrency,
        ttft_by_turn,
        kv_bytes_by_turn,
        decode_itl_with_appends,
        kv_bandwidth,
        plan_goodput,
        placement_goodput,
        sim_vs_real,
    )
}


def curve(sweep: Sweep, spec: Curve) -> Made:
    """A figure a study declares as data (testbed/studies/study.py Curve): `spec.y` against the
    knob `spec.x`, one line per configuration, each cell's interval shaded."""
    fig, ax = style.figure()
    plotted = figures.metric_by_label(ax, sweep.cells(), spec.x, spec.y)
    ax.set(xlabel=spec.xlabel or spec.x, ylabel=spec.ylabel or spec.y)
    if spec.log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for line in plotted.values() for x in line["x"]}))  # each value tried, labelled
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    style.legend(ax)
    text = captions.by_knob(plotted, spec.ylabel or spec.y, spec.x, better=spec.better)
    return [(spec.stem, fig, text, plotted)]


def makers(name: str) -> list[Callable[[Sweep], Made]]:
    """The makers of the figures the study's record names ([] for a study without figures): a
    maker of MAKERS by name, or `curve` for a declared Curve."""
    study = BY_NAME.get(name)
    if study is None:
        return []
    return [MAKERS[f] if isinstance(f, str) else declared(f) for f in study.figures]


def declared(spec: Curve) -> Callable[[Sweep], Made]:
    def make(sweep: Sweep) -> Made:
        return curve(sweep, spec)

    make.__name__ = spec.stem  # what leaving_out and the figure checks name it by
    return make


def draw(name: str, sweep: Sweep) -> Made:
    """Every standard figure of a study, built but not saved (notebooks display them)."""
    return [made for make in makers(name) for made in make(sweep)]


# -- one run ---------------------------------------------------------------------------------------
def run_timeline(run: dict, stem: str = "timeline") -> Made:
    shown = min(len(run["requests"]), TIMELINE_REQUESTS)
    fig, ax = style.figure("double", height_in=0.9 + 0.1 * shown)  # a readable row per request
    segments = system.request_timeline(ax, run["requests"], TIMELINE_REQUESTS)
    return [(stem, fig, captions.timeline(segments, system.phase_totals(segments), run["label"]), segments)]


def run_telemetry(run: dict, stem: str = "telemetry") -> Made:
    """GPU telemetry panels; nothing at all for a run without NVML (CPU runs)."""
    data = run.get("telemetry")
    metrics = system.telemetry_metrics(data) if data is not None and len(data) else []
    if not metrics:
        return []
    fig, axes = style.figure("double", rows=-(-len(metrics) // 2), cols=2)
    plotted = {metric: system.gpu_telemetry(ax, data, metric) for ax, metric in zip(axes, metrics)}
    text = [captions.telemetry(v, system.TELEMETRY[m][0]) for m, v in plotted.items()]
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    return [(stem, fig, " ".join(text), plotted)]


def run_cdfs(run: dict) -> Made:
    from testbed.metrics.latency import pooled_itl

    requests = served(run["requests"], run["config"]).assign(label=run["label"])
    fig, axes = style.figure("double", cols=2)
    ttft = figures.ttft_cdf(axes[0], requests)
    itl = figures.itl_cdf(axes[1], {run["label"]: pooled_itl(requests)})
    text = " ".join([captions.distributions(ttft, "TTFT"), captions.distributions(itl, "ITL")])
    return [("latency_cdf", fig, text, {"ttft": ttft, "itl": itl})]


# -- writing ---------------------------------------------------------------------------------------
def _write(makers, source, out: Path, strict: bool) -> list[Path]:
    """Build and save each maker's figures. Unless strict, a figure that fails is reported and
    skipped: the results are already saved, and `python -m analysis DIR` can redo it."""
    paths = []
    with style.paper():
        for make in makers:
            try:
                for stem, fig, caption, _ in make(source):
                    paths += style.save(fig, out / stem, caption)
            except Exception:
                if strict:
                    raise
                print(
                    f"figure {make.__name__} failed (results are saved; rerun python -m analysis {out.parent}):\n"
                    f"{traceback.format_exc()}",
                    file=sys.stderr,
                )
    return paths


# figures drawn from requests or SLO attainment, which a summary-only import (a vLLM or SGLang result
# file without per-request lists) does not have: they leave such points out and say so in the caption
NEEDS_REQUESTS = {
    "goodput_per_gpu",
    "attainment_vs_rate",
    "latency_summary",
    "latency_cdfs",
    "timelines",
    "telemetry",
    "attainment_vs_scale",
    "ttft_by_bucket",
}


@dataclass(frozen=True)
class RequestsOnly(Sweep):
    """The sweep less its summary-only points (cells and rows), for figures that need requests."""

    left_out: tuple = ()

    def cells(self) -> pd.DataFrame:
        cells = super().cells()
        return cells[~cells["cell"].isin(self.left_out)] if "cell" in cells.columns else cells


def summary_only_cells(sweep: Sweep) -> tuple:
    table = sweep.table
    if "summary_only" not in table.columns:
        return ()
    rows = table[table["summary_only"].fillna(0).astype(float) > 0]
    return tuple(sorted(rows["cell"] if "cell" in rows.columns else rows["point"]))


def leaving_out(make: Callable, sweep: Sweep) -> Callable:
    """`make` on the sweep less its summary-only points when it needs requests, its captions naming them."""
    left = summary_only_cells(sweep) if make.__name__ in NEEDS_REQUESTS else ()
    if not left:
        return make
    kept = RequestsOnly(
        sweep.dir,
        sweep.experiment,
        sweep.table[~sweep.table["cell" if "cell" in sweep.table.columns else "point"].isin(left)],
        sweep.aggregate,
        left,
    )
    note = (
        f" Left out: {', '.join(left)} (summary-only imports: the result file has no per-request lists, "
        f"so no SLO attainment or distribution to draw)."
    )

    def made(_source):
        return [(stem, fig, caption + note, plotted) for stem, fig, caption, plotted in make(kept)]

    made.__name__ = make.__name__
    return made


def study_figures(name: str, sweep_dir, strict: bool = False) -> list[Path]:
    """Write a study's standard figures into <sweep_dir>/figures/; returns the PDF and PNG paths
    (none for a study without figures, or without finished points)."""
    if not makers(name):  # the runner calls this after every sweep
        print(f"{name}: no standard figures defined (Study.figures in testbed/studies/catalog.py)", file=sys.stderr)
        return []
    sweep = load_sweep(sweep_dir)
    if sweep.finished().empty:
        print(f"{name}: no finished points in {sweep_dir}, no figures", file=sys.stderr)
        return []
    return _write([leaving_out(make, sweep) for make in makers(name)], sweep, Path(sweep_dir) / "figures", strict)


def run_figures(run_dir, strict: bool = False) -> list[Path]:
    """One run's figures (latency CDFs, request timeline, telemetry when recorded) into
    <run_dir>/figures/; returns the PDF and PNG paths."""
    return _write([run_cdfs, run_timeline, run_telemetry], load_run(run_dir), Path(run_dir) / "figures", strict)
