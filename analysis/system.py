"""Figures of what happened inside the system: one run's request timeline across P and D
workers, GPU telemetry over time, and KV-transfer bandwidth against message size. Each takes the
data and an `ax` and returns what it plotted (see analysis.figures)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.ticker import NullLocator

from analysis import style

# A request's phases, as (name, start column, end column) of the requests table. transfer_wait:
# prefill done, KV not yet moving (the connector's queue). The decode queue starts when the KV
# is ready on D: decode_queued_s, else the end of the transfer.
PHASES = [
    ("queue", "arrival_s", "prefill_start_s"),
    ("prefill", "prefill_start_s", "prefill_end_s"),
    ("transfer_wait", "prefill_end_s", "kv_transfer_start_s"),
    ("transfer", "kv_transfer_start_s", "kv_transfer_end_s"),
    ("decode_queue", "decode_ready_s", "decode_start_s"),
    ("decode", "decode_start_s", "finished_s"),
]
TELEMETRY = {
    "util_pct": ("GPU utilization (%)", 1.0),
    "mem_used_bytes": ("memory used (GiB)", 1 / 2**30),
    "power_w": ("power (W)", 1.0),
    "sm_clock_mhz": ("SM clock (MHz)", 1.0),
    "nvlink_tx_bytes_s": ("NVLink TX (GB/s)", 1e-9),
    "nvlink_rx_bytes_s": ("NVLink RX (GB/s)", 1e-9),
}


def phase_segments(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per (request, phase) with a finite, non-negative span: request_id, phase, start_s,
    end_s, worker (the prefill worker for queue/prefill/transfer, the decode worker after)."""
    requests = requests.assign(decode_ready_s=requests["decode_queued_s"].fillna(requests["kv_transfer_end_s"]))
    rows = []
    for name, start, end in PHASES:
        worker = "prefill_worker" if name in ("queue", "prefill", "transfer_wait", "transfer") else "decode_worker"
        part = pd.DataFrame(
            {
                "request_id": requests["request_id"],
                "phase": name,
                "start_s": requests[start],
                "end_s": requests[end],
                "worker": requests[worker],
            }
        )
        rows.append(part[part["start_s"].notna() & part["end_s"].notna() & (part["end_s"] >= part["start_s"])])
    return pd.concat(rows, ignore_index=True)


def _request_label(row) -> str:
    p, d = row.prefill_worker, row.decode_worker
    if pd.isna(d) or p == d:
        return f"#{row.request_id} W{p}"
    return f"#{row.request_id} P{p}\u2192D{d}"


def request_timeline(ax, requests: pd.DataFrame, max_requests: int = 40) -> pd.DataFrame:
    """A Gantt row per request (the first max_requests by arrival): queueing, prefill, KV transfer,
    decode queue and decode, labelled with the workers it ran on. Returns the segments drawn
    (phase_segments plus the row each is on)."""
    shown = requests.sort_values("arrival_s").head(max_requests).reset_index(drop=True)
    rows = {rid: i for i, rid in enumerate(shown["request_id"])}
    segments = phase_segments(shown).assign(row=lambda s: s["request_id"].map(rows))
    for name, _, _ in PHASES:
        part = segments[segments["phase"] == name]
        if len(part):
            ax.barh(
                part["row"],
                part["end_s"] - part["start_s"],
                left=part["start_s"],
                height=0.7,
                color=style.PHASE_COLOURS[name],
                label=name.replace("_", " "),
                linewidth=0,
            )
    ax.set_yticks(range(len(shown)), [_request_label(r) for r in shown.itertuples()], fontsize=5)
    ax.invert_yaxis()  # the first request on top, time reads left to right
    ax.set(xlabel="time since run start (s)")
    ax.grid(axis="y", visible=False)
    if len(segments):
        ax.legend(ncols=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=6, columnspacing=1.0)
    return segments


def gpu_telemetry(ax, telemetry: pd.DataFrame, metric: str = "util_pct") -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """One line per GPU of a telemetry.parquet column against t_s, in the unit on the axis:
    {gpu: (t_s, value)}. Needs a DataFrame; runs without NVML have none (callers skip)."""
    ylabel, scale = TELEMETRY.get(metric, (metric, 1.0))
    plotted = {}
    for gpu, rows in telemetry.sort_values("t_s").groupby("gpu"):
        t, y = rows["t_s"].to_numpy(dtype=float), rows[metric].to_numpy(dtype=float) * scale
        ax.plot(t, y, label=f"GPU {gpu}", linewidth=0.8)
        plotted[int(gpu)] = (t, y)
    ax.set(xlabel="time since run start (s)", ylabel=ylabel)
    if len(plotted) > 1:
        ax.legend(ncols=min(len(plotted), 4))
    return plotted


def kv_bandwidth(
    ax, rows: pd.DataFrame, ceiling_bytes_s: float | None = None, ipc: dict | None = None
) -> dict[str, np.ndarray]:
    """kv_bandwidth's table (bytes, raw_gbps, connector_gbps, ratio): the connector's bandwidth
    and a raw contiguous send (its ceiling on this link) against message size, plus the
    device-to-device copy ceiling on GPUs, and the ipc transport beside a copy of the same bytes
    when measured. {"bytes", "raw_gbps", "connector_gbps"[, "ipc_bytes", "ipc_gbps", "copy_gbps"]}."""
    rows = rows.sort_values("bytes")
    size = rows["bytes"].to_numpy(dtype=float)
    raw, connector = rows["raw_gbps"].to_numpy(dtype=float), rows["connector_gbps"].to_numpy(dtype=float)
    ax.plot(size, raw, color="black", marker="o", linestyle="--", label="raw send (ceiling)")
    ax.plot(size, connector, **style.line_style("disagg") | {"label": "KV connector"})
    plotted = {"bytes": size, "raw_gbps": raw, "connector_gbps": connector}
    if ipc and ipc.get("rows"):
        table = pd.DataFrame(ipc["rows"]).sort_values("bytes")
        plotted |= {
            "ipc_bytes": table["bytes"].to_numpy(dtype=float),
            "ipc_gbps": table["ipc_gbps"].to_numpy(dtype=float),
            "copy_gbps": table["copy_gbps"].to_numpy(dtype=float),
        }
        ax.plot(
            plotted["ipc_bytes"],
            plotted["copy_gbps"],
            color="grey",
            marker="s",
            linestyle="--",
            label=f"{ipc.get('copy', 'copy')}",
        )
        ax.plot(plotted["ipc_bytes"], plotted["ipc_gbps"], color="tab:green", marker="^", label="ipc (into D's blocks)")
        size = np.union1d(size, plotted["ipc_bytes"])
    if ceiling_bytes_s:
        ax.axhline(ceiling_bytes_s / 1e9, color="grey", linestyle=":", label="device copy_ ceiling")
        plotted["ceiling_gbps"] = np.array([ceiling_bytes_s / 1e9])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    style.plain_ticks(ax.yaxis)
    ax.set_xticks(size, [_human(v) for v in size])  # the measured sizes only: powers of 2 crowd
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="message size", ylabel="bandwidth (GB/s)")
    ax.legend()
    return plotted


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def telemetry_metrics(telemetry: pd.DataFrame) -> Sequence[str]:
    """The telemetry columns with at least one value (NVLink counters are NaN without NVLink)."""
    return [m for m in TELEMETRY if m in telemetry.columns and telemetry[m].notna().any()]


def phase_totals(segments: pd.DataFrame) -> Mapping[str, float]:
    """Mean seconds per phase over the requests drawn (for the timeline's caption)."""
    spans = segments.assign(span=segments["end_s"] - segments["start_s"])
    return {
        name: float(spans.loc[spans["phase"] == name, "span"].mean())
        for name, _, _ in PHASES
        if (spans["phase"] == name).any()
    }
