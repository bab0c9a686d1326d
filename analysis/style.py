"""One paper style for every figure: sizes for single- and double-column figures, one colour and
marker per serving configuration, and `save` (PDF for the paper, PNG for a quick look).

Figures are built on `matplotlib.figure.Figure` with an Agg canvas attached (no pyplot): nothing
is shown, no display is needed, and no global figure registry keeps them alive. The rc settings
apply only inside `paper()`, so importing this module changes nothing for anyone else (a
notebook keeps its own backend).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Iterator

from matplotlib import colors as mcolors
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter

# Widths of a two-column systems paper (ACM / USENIX templates), in inches.
SINGLE_COLUMN_IN = 3.33
DOUBLE_COLUMN_IN = 7.0
ASPECT = 0.62  # height / width of one panel row

RC = {
    "font.family": "serif",
    "font.serif": ["Times New Roman", "Times", "Nimbus Roman", "DejaVu Serif"],
    "mathtext.fontset": "dejavuserif",
    "font.size": 8,
    "axes.labelsize": 8,
    "axes.titlesize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "lines.linewidth": 1.2,
    "lines.markersize": 4,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.02,
    "pdf.fonttype": 42,  # TrueType in the PDF: venues reject Type 3 fonts
    "ps.fonttype": 42,
}

# Okabe-Ito, a palette readable by colour-blind readers and in greyscale print.
MODE_COLOURS = {"colocated": "#E69F00", "chunked": "#56B4E9", "disagg": "#009E73"}
MODE_MARKERS = {"colocated": "o", "chunked": "s", "disagg": "^"}
SPLIT_MARKERS = ["^", "v", "D", "P", "X", "*", "h"]  # by the number of prefill workers
PERCENTILE_STYLES = {"p50": "-", "p90": "-.", "p99": "--"}
PHASE_COLOURS = {
    "queue": "#BBBBBB",
    "prefill": "#E69F00",
    "transfer_wait": "#F2C6DE",
    "transfer": "#CC79A7",
    "decode_queue": "#F0E442",
    "decode": "#0072B2",
}
# Other labels (an imported engine, a dispatch policy, a tenant): colours no mode or split takes.
FALLBACK = ["#D55E00", "#000000", "#0072B2", "#999999", "#F0E442"]
SPLIT = re.compile(r"^(\d+)P(\d+)D$")


def split_of(label: str) -> tuple[int, int] | None:
    """(P, D) of a disaggregated label such as "3P1D"; None for anything else."""
    match = SPLIT.match(label)
    return (int(match.group(1)), int(match.group(2))) if match else None


PLACEMENT = re.compile(r"^(\d+)xTP(\d+)P-(\d+)xTP(\d+)D$")
MIXED_TP = re.compile(r"^(colocated|chunked)(?:-TP(\d+)|\d*)$")


def placement_of(label: str) -> tuple[str, int, int, int, int] | None:
    """(mode, workers or P, TP, D, decode TP) of a placement label: "2xTP2P-1xTP4D", "3P1D" (TP1),
    "colocated-TP4", "chunked" or "chunked512" (TP1); None for anything else."""
    if split := split_of(label):
        return ("disagg", split[0], 1, split[1], 1)
    if match := PLACEMENT.match(label):
        p, a, d, b = map(int, match.groups())
        return ("disagg", p, a, d, b)
    if match := MIXED_TP.match(label):
        return (match.group(1), 0, int(match.group(2) or 1), 0, 0)
    return None


def colour(label: str) -> str:
    """The colour of a configuration label, the same in every figure and every study.

    A split pPdD takes a shade from green (few prefill workers) through pink to purple (many) by
    its prefill share, so the shade reads as the ratio whatever the GPU count, and no split
    looks like the colocated (orange) or chunked (sky blue) baselines."""
    if label in MODE_COLOURS:
        return MODE_COLOURS[label]
    split = split_of(label)
    if split:
        share = split[0] / sum(split)
        ramp = mcolors.LinearSegmentedColormap.from_list("pd", ["#009E73", "#CC79A7", "#5E3C99"])
        return mcolors.to_hex(ramp(share))
    # Anything else (a dispatch policy, a tenant): a stable pick from the label's characters.
    return FALLBACK[sum(map(ord, label)) % len(FALLBACK)]


def marker(label: str) -> str:
    if label in MODE_MARKERS:
        return MODE_MARKERS[label]
    split = split_of(label)
    return SPLIT_MARKERS[(split[0] - 1) % len(SPLIT_MARKERS)] if split else "o"


def line_style(label: str) -> dict:
    """kwargs for ax.plot / ax.scatter: colour, marker and the label itself."""
    return {"color": colour(label), "marker": marker(label), "label": label}


def order(labels) -> list[str]:
    """Baselines first, then splits by prefill share: the reading order of every legend."""

    def key(label: str):
        split = split_of(label)
        if label in MODE_COLOURS and not split:
            return (0, list(MODE_COLOURS).index(label), 0)
        if split:
            return (1, split[0] / sum(split), split[0])
        return (2, 0, label)

    return sorted(set(labels), key=key)


def legend(ax, styles: dict[str, str] | None = None, above: bool = False, beside: bool = False) -> None:
    """A legend of the labelled artists, if any. styles: one black entry per line style as well
    (p50 solid, p99 dashed); above: in a row over the axes, clear of the bars; beside: to the
    right of the axes, clear of many lines."""
    handles, names = ax.get_legend_handles_labels()
    for name, linestyle in (styles or {}).items():
        handles.append(Line2D([], [], color="black", linestyle=linestyle))
        names.append(name)
    if handles and above:
        # at most four to a row: five or more in one row squeeze the axes to a sliver
        ax.legend(handles, names, ncols=min(len(handles), 4), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    elif handles and beside:
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    elif handles:
        ax.legend(handles, names)


class PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks to label, written as 0.5 rather than 5e-01."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_ticks(axis) -> None:
    """Tick labels as plain numbers (5, 10, 20) instead of 5x10^0 on a log axis."""
    # Minor ticks get labels too when the axis spans under two decades, so a short log axis
    # still has numbers on it.
    axis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


@contextlib.contextmanager
def paper() -> Iterator[None]:
    """The paper's rc settings, for building and saving figures inside this block only."""
    with rc_context(RC):
        yield


def figure(width: str = "single", rows: int = 1, cols: int = 1, height_in: float | None = None):
    """(Figure, ax) for one panel, (Figure, flat array of axes) for several. width: "single"
    (one column of the paper) or "double" (spanning both). Call inside `paper()` so the figure
    takes its fonts."""
    if width not in ("single", "double"):
        raise ValueError(f"width must be 'single' or 'double', not {width!r}")
    inches = SINGLE_COLUMN_IN if width == "single" else DOUBLE_COLUMN_IN
    height = height_in or inches / cols * ASPECT * rows * (1.15 if cols > 1 else 1.0)
    fig = Figure(figsize=(inches, height), layout="constrained")
    FigureCanvasAgg(fig)  # renders off screen, whatever backend the process has chosen
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, (axes[0, 0] if rows * cols == 1 else axes.ravel())


def png(fig: Figure, dpi: int = 150) -> bytes:
    """The figure as PNG bytes (for IPython.display.Image in notebooks)."""
    buffer = io.BytesIO()
    with paper():
        fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def save(fig: Figure, path_without_suffix, caption: str | None = None) -> list[Path]:
    """Write fig as PDF and PNG (and the caption, computed from the data, as .txt beside them);
    returns [pdf, png]."""
    base = Path(path_without_suffix)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_suffix(".pdf"), base.with_suffix(".png")]
    with paper():
        fig.savefig(paths[0])
        fig.savefig(paths[1], dpi=200)
    if caption is not None:
        base.with_suffix(".txt").write_text(caption.rstrip() + "\n")
    return paths
