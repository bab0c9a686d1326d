"""The interference study's figure, two panels from its aggregate (sweep.json "interference":
{label: {prefill_len: {...}}}, length 0 the decode-only baseline): the ITL view, inflation with its
95% interval against the injected prefill length, and the step-level view, mean decode step time
with and without prefill work alongside. Each draws on an `ax` and returns what it plotted;
re-exported by analysis.figures."""

from __future__ import annotations

from typing import Mapping

import numpy as np
from matplotlib.ticker import NullLocator

from analysis import style
from analysis.bars import MS
from analysis.bounds import as_float, error_bars


def _injected(interference: Mapping[str, Mapping], label: str) -> tuple[np.ndarray, list[Mapping]]:
    """The injected lengths of one mode (the decode-only baseline, length 0, left out) and their entries."""
    lengths = sorted(int(k) for k in interference[label] if int(k) > 0)
    return np.array(lengths, dtype=float), [interference[label][str(n)] for n in lengths]


def _length_axis(ax, plotted: Mapping[str, Mapping]) -> None:
    ax.set_xscale("log", base=2)
    lengths = sorted({int(n) for line in plotted.values() for n in line["prefill_len"]})
    ax.set_xticks(lengths, [str(n) for n in lengths])  # the injected lengths, not powers of 2
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("injected prefill length (tokens)")


def itl_inflation(ax, interference: Mapping[str, Mapping], against: str = "inflation") -> dict[str, dict]:
    """interference's aggregate ({label: {prefill_len: {"inflation", "inflation_low", ...}}}):
    p99 of the decode background's ITL gaps that overlap an injected prefill over p99 of those
    that do not (same run), with its 95% interval, against the injected length; with
    against="inflation_vs_baseline", over p99 of the decode-only baseline run's gaps instead.
    {label: {"prefill_len", "inflation", "low", "high"}}."""
    plotted = {}
    for label in style.order(interference):
        lengths, entries = _injected(interference, label)
        inflation, low, high = (
            np.array([as_float(e.get(key)) for e in entries]) for key in (against, f"{against}_low", f"{against}_high")
        )
        ax.plot(lengths, inflation, **style.line_style(label))
        error_bars(ax, lengths, low, high, style.colour(label), f"{label}:inflation")
        plotted[label] = {"prefill_len": lengths, "inflation": inflation, "low": low, "high": high}
    ax.axhline(1.0, color="black", linewidth=0.7, linestyle=":")  # no interference
    _length_axis(ax, plotted)
    ax.set_ylabel("p99 ITL, with / without prefill" if against == "inflation" else "p99 ITL, with prefill / baseline")
    style.legend(ax)
    return plotted


def decode_step_times(ax, interference: Mapping[str, Mapping]) -> dict[str, dict]:
    """The step-level view of interference: mean decode step time of the background's workers
    with prefill work alongside (solid) and without (dashed), per mode and injected length.
    {label: {"prefill_len", "with_prefill_ms", "without_prefill_ms"}}."""
    plotted = {}
    for label in style.order(interference):
        lengths, entries = _injected(interference, label)
        with_prefill, without = (
            np.array([as_float(e.get(key)) for e in entries]) * MS
            for key in ("decode_step_s_with_prefill", "decode_step_s_without_prefill")
        )
        ax.plot(lengths, with_prefill, **style.line_style(label))
        ax.plot(
            lengths,
            without,
            color=style.colour(label),
            marker=style.marker(label),
            markerfacecolor="none",
            linestyle="--",
            label="_nolegend_",
        )
        plotted[label] = {"prefill_len": lengths, "with_prefill_ms": with_prefill, "without_prefill_ms": without}
    _length_axis(ax, plotted)
    ax.set_ylabel("mean decode step (ms)")
    style.legend(ax, {"with prefill": "-", "without": "--"})
    return plotted
