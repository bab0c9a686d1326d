"""Each study's standard figures, from its saved sweep: `study_figures(name, sweep_dir)` writes
<sweep_dir>/figures/<figure>.pdf/.png/.txt (the .txt is the caption, numbers computed from the
plotted data) and returns the PDF and PNG paths. `run_figures(run_dir)` does the same for one run.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Callable

from matplotlib.figure import Figure

from analysis import captions, figures, style, system
from analysis.load import Sweep, by_label, load_run, load_sweep, served

Made = list[tuple[str, Figure, str]]  # (file stem, figure, caption)
TIMELINE_REQUESTS = 40  # the first requests by arrival: enough to see the pattern, few enough to read


# -- one maker per figure: Sweep -> [(stem, figure, caption)] -------------------------------------
def goodput_per_gpu(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.goodput_by_split(ax, sweep.aggregate["goodput"])
    return [("goodput_per_gpu", fig, captions.goodput_per_gpu(plotted))]


def attainment_vs_rate(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, sweep.finished())
    return [("attainment_vs_rate", fig, captions.attainment_vs_rate(plotted, sweep.finished()))]


def latency_vs_rate(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    ttft = figures.latency_vs_rate(axes[0], sweep.finished(), "ttft")
    tpot = figures.latency_vs_rate(axes[1], sweep.finished(), "tpot")
    return [("latency_vs_rate", fig, " ".join([captions.latency_vs_rate(ttft, "ttft"),
                                               captions.latency_vs_rate(tpot, "tpot")]))]


def latency_cdfs(sweep: Sweep) -> Made:
    table = sweep.finished()
    fig, axes = style.figure("double", cols=2)
    ttft = figures.ttft_cdf(axes[0], sweep.requests())
    itl = figures.itl_cdf(axes[1], by_label(sweep.itls(), table))
    return [("latency_cdf", fig, " ".join([captions.distributions(ttft, "TTFT"), captions.distributions(itl, "ITL")]))]


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
    return [("attainment_vs_slo_scale", fig, captions.attainment_vs_scale(plotted))]


def itl_inflation(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.itl_inflation(ax, sweep.aggregate["interference"])
    return [("itl_inflation", fig, captions.itl_inflation(plotted))]


def chunk_tradeoff(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.chunk_tradeoff(ax, sweep.finished())
    return [("chunk_tradeoff", fig, captions.chunk_tradeoff(plotted))]


def ttft_by_bucket(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    p50 = figures.ttft_by_bucket(axes[0], sweep.finished(), "p50")
    p99 = figures.ttft_by_bucket(axes[1], sweep.finished(), "p99")
    text = " ".join([captions.ttft_by_bucket(p50, "p50"), captions.ttft_by_bucket(p99, "p99")])
    return [("ttft_by_bucket", fig, text)]


def burstiness(sweep: Sweep) -> Made:
    fig, axes = style.figure("double", cols=2)
    table = sweep.finished()
    attainment = figures.metric_by_label(axes[0], table, "burstiness", "slo_attainment")
    axes[0].set(xlabel="burstiness (gamma shape; 1 = Poisson)", ylabel="SLO attainment", ylim=(0, 1.05))
    ttft = figures.latency_vs_rate(axes[1], table, "ttft", x="burstiness")
    for ax in axes:
        ax.set_xscale("log", base=2)
    axes[1].set_xlabel("burstiness (gamma shape; 1 = Poisson)")
    text = " ".join([captions.by_knob(attainment, "SLO attainment", "burstiness"),
                     captions.by_knob(ttft["p99"], "p99 TTFT (ms)", "burstiness")])
    return [("burstiness", fig, text)]


def ttft_by_turn(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.ttft_by_turn(ax, sweep.aggregate["turns"], sweep.finished())
    return [("ttft_by_turn", fig, captions.by_knob(plotted, "mean TTFT (ms)", "turn"))]


def kv_bandwidth(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    plotted = figures.kv_bandwidth(ax, sweep.table, sweep.aggregate.get("ceiling"))
    return [("kv_bandwidth", fig, captions.kv_bandwidth(plotted, sweep.aggregate.get("backend", "?")))]


def plan_goodput(sweep: Sweep) -> Made:
    """The simulated search of `plan`: goodput per GPU per split, the baselines as lines."""
    fig, ax = style.figure()
    plotted = figures.goodput_by_split(ax, sweep.aggregate["simulated"]["goodput"])
    analytical = sweep.aggregate["analytical"]["split"]
    text = f"{captions.goodput_per_gpu(plotted)} First-order analytical split: {analytical}."
    return [("plan_goodput_per_gpu", fig, text)]


def sim_vs_real(sweep: Sweep) -> Made:
    fig, ax = style.figure()
    figures.sim_vs_real(ax, sweep.finished())
    worst = ", ".join(f"{k} {v:.0%}" for k, v in sweep.aggregate["worst_abs_error"].items() if v == v)
    return [("sim_vs_real", fig, f"Simulated against measured latency per point; worst relative error: {worst}.")]


FIGURES: dict[str, list[Callable[[Sweep], Made]]] = {
    "ratio_sweep": [goodput_per_gpu, attainment_vs_rate, latency_vs_rate],
    "rate_sweep": [attainment_vs_rate, latency_vs_rate],
    "mode_compare": [latency_cdfs, timelines, telemetry],
    "slo_scale": [attainment_vs_scale, latency_cdfs],
    "interference": [itl_inflation],
    "chunk_sweep": [chunk_tradeoff],
    "input_buckets": [ttft_by_bucket],
    "burstiness": [burstiness],
    "multiturn": [ttft_by_turn],
    "kv_bandwidth": [kv_bandwidth],
    "plan": [plan_goodput],
    "sim_validate": [sim_vs_real],
}


def draw(name: str, sweep: Sweep) -> Made:
    """Every standard figure of a study, built but not saved (notebooks display them)."""
    return [made for make in FIGURES[name] for made in make(sweep)]


# -- one run ---------------------------------------------------------------------------------------
def run_timeline(run: dict, stem: str = "timeline") -> Made:
    shown = min(len(run["requests"]), TIMELINE_REQUESTS)
    fig, ax = style.figure("double", height_in=0.9 + 0.1 * shown)  # a readable row per request
    segments = system.request_timeline(ax, run["requests"], TIMELINE_REQUESTS)
    return [(stem, fig, captions.timeline(segments, system.phase_totals(segments), run["label"]))]


def run_telemetry(run: dict, stem: str = "telemetry") -> Made:
    """GPU telemetry panels; nothing at all for a run without NVML (CPU runs)."""
    data = run.get("telemetry")
    metrics = system.telemetry_metrics(data) if data is not None and len(data) else []
    if not metrics:
        return []
    fig, axes = style.figure("double", rows=-(-len(metrics) // 2), cols=2)
    text = []
    for ax, metric in zip(axes, metrics):
        plotted = system.gpu_telemetry(ax, data, metric)
        text.append(captions.telemetry(plotted, system.TELEMETRY[metric][0]))
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    return [(stem, fig, " ".join(text))]


def run_cdfs(run: dict) -> Made:
    from testbed.metrics.latency import pooled_itl

    requests = served(run["requests"], run["config"]).assign(label=run["label"])
    fig, axes = style.figure("double", cols=2)
    ttft = figures.ttft_cdf(axes[0], requests)
    itl = figures.itl_cdf(axes[1], {run["label"]: pooled_itl(requests)})
    return [("latency_cdf", fig, " ".join([captions.distributions(ttft, "TTFT"), captions.distributions(itl, "ITL")]))]


# -- writing ---------------------------------------------------------------------------------------
def _write(makers, source, out: Path, strict: bool) -> list[Path]:
    """Build and save each maker's figures. Unless strict, a figure that fails is reported and
    skipped: the results are already saved, and `python -m analysis DIR` can redo it."""
    paths = []
    with style.paper():
        for make in makers:
            try:
                for stem, fig, caption in make(source):
                    paths += style.save(fig, out / stem, caption)
            except Exception:
                if strict:
                    raise
                print(f"figure {make.__name__} failed (results are saved; rerun python -m analysis {out.parent}):\n"
                      f"{traceback.format_exc()}", file=sys.stderr)
    return paths


def study_figures(name: str, sweep_dir, strict: bool = False) -> list[Path]:
    """Write a study's standard figures into <sweep_dir>/figures/; returns the PDF and PNG paths
    (none for a study without figures in FIGURES, or without finished points)."""
    if name not in FIGURES:  # a study added since (the runner calls this after every sweep)
        print(f"{name}: no standard figures defined (analysis.studies.FIGURES)", file=sys.stderr)
        return []
    sweep = load_sweep(sweep_dir)
    if sweep.finished().empty:
        print(f"{name}: no finished points in {sweep_dir}, no figures", file=sys.stderr)
        return []
    return _write(FIGURES[name], sweep, Path(sweep_dir) / "figures", strict)


def run_figures(run_dir, strict: bool = False) -> list[Path]:
    """One run's figures (latency CDFs, request timeline, telemetry when recorded) into
    <run_dir>/figures/; returns the PDF and PNG paths."""
    return _write([run_cdfs, run_timeline, run_telemetry], load_run(run_dir), Path(run_dir) / "figures", strict)
