"""Interference, measured inside one run: the decode background's ITL gaps that overlap an
injected prefill against the gaps that do not (DistServe section 2, Sarathi-Serve).

A background gap is the interval between two tokens of a background request, as stamped on its
decode worker (the device's cadence: the router's own delays, which on a CPU box include sharing
cores with the workers, stay out); it is *exposed* when an injected request's prefill ran during
it on the same worker or, for a decode-only worker (disaggregation), on any prefill worker: what
a decode suffers from sharing compute, or from a neighbour on a shared host. Gaps before every
background request has produced its first token (the background's own prefills) are left out.

Pure functions over requests.parquet and steps.parquet.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.metrics.latency import as_times

BACKGROUND = "background"
DECODE_ONLY = "decode_only"


def prefill_windows(requests: pd.DataFrame) -> pd.DataFrame:
    """(worker, start, end) of every injected (non-background) request's prefill."""
    injected = requests[
        (requests["tenant"] != BACKGROUND) & requests["prefill_start_s"].notna() & requests["prefill_end_s"].notna()
    ]
    return pd.DataFrame(
        {
            "worker": injected["prefill_worker"].astype("float64").to_numpy(),
            "start": injected["prefill_start_s"].to_numpy(np.float64),
            "end": injected["prefill_end_s"].to_numpy(np.float64),
        }
    )


def worker_roles(steps: pd.DataFrame, requests: pd.DataFrame | None = None) -> dict[int, str]:
    """Each worker's role, from its steps; a run whose steps are not visible (an engine measured from
    outside) names as decode-only the workers that decoded requests and prefilled none."""
    if steps is not None and not steps.empty:
        return {int(w): str(r) for w, r in steps.groupby("worker")["role"].first().items()}
    if requests is None or requests.empty:
        return {}
    decoded = set(requests["decode_worker"].dropna().astype(int)) - set(requests["prefill_worker"].dropna().astype(int))
    return {w: DECODE_ONLY for w in decoded}


def _overlaps(lo: np.ndarray, hi: np.ndarray, windows: pd.DataFrame) -> np.ndarray:
    """Per interval (lo, hi]: does any window [start, end] overlap it?"""
    if windows.empty or lo.size == 0:
        return np.zeros(lo.size, dtype=bool)
    start, end = windows["start"].to_numpy(), windows["end"].to_numpy()
    return ((end[None, :] > lo[:, None]) & (start[None, :] < hi[:, None])).any(axis=1)


def _windows_for(worker: int, roles: dict[int, str], windows: pd.DataFrame) -> pd.DataFrame:
    if roles.get(worker) == DECODE_ONLY:
        return windows  # a decode worker: every prefill of the cluster is its neighbour
    return windows[windows["worker"] == worker]


def injection_window(requests: pd.DataFrame) -> tuple[float, float] | None:
    """From the first injected arrival to the last injected prefill's end; None without injections."""
    injected = requests[requests["tenant"] != BACKGROUND]
    if injected.empty or injected["prefill_end_s"].isna().all():
        return None
    return float(injected["arrival_s"].min()), float(injected["prefill_end_s"].max())


def background_gaps(
    requests: pd.DataFrame, steps: pd.DataFrame, window: tuple[float, float] | None = None
) -> pd.DataFrame:
    """One row per background ITL gap after the background's start-up, and starting inside
    `window` when given (the injections' window: gaps of the same period, whose context has
    grown alike): `itl` (as the decode worker stamped it), `worker`, and `exposed` (an injected
    prefill overlapped it; see the module docstring)."""
    background = requests[(requests["tenant"] == BACKGROUND) & (requests["status"] == "ok")]
    if background.empty:
        return pd.DataFrame({"itl": [], "worker": [], "exposed": []})
    settled = max(as_times(t)[0] for t in background["token_worker_times"] if as_times(t).size)
    windows, roles = prefill_windows(requests), worker_roles(steps, requests)
    frames = []
    for row in background.itertuples():
        stamped = as_times(row.token_worker_times)
        if stamped.size < 2:
            continue
        worker = int(row.decode_worker) if not pd.isna(row.decode_worker) else int(row.prefill_worker)
        lo, hi, itl = stamped[:-1], stamped[1:], np.diff(stamped)
        keep = lo >= settled
        if window is not None:
            keep &= (lo >= window[0]) & (lo <= window[1])
        exposed = _overlaps(lo[keep], hi[keep], _windows_for(worker, roles, windows))
        frames.append(pd.DataFrame({"itl": itl[keep], "worker": worker, "exposed": exposed}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"itl": [], "worker": [], "exposed": []})


def decode_steps(
    requests: pd.DataFrame, steps: pd.DataFrame, window: tuple[float, float] | None = None
) -> pd.DataFrame:
    """The background workers' decode steps (starting inside `window` when given): `seconds` and
    `with_prefill` (prefill tokens in the batch, or, on a decode-only worker, an injected prefill
    running elsewhere meanwhile)."""
    background = requests[(requests["tenant"] == BACKGROUND) & (requests["status"] == "ok")]
    workers = set(background["decode_worker"].dropna().astype(int)) | set(
        background.loc[background["decode_worker"].isna(), "prefill_worker"].dropna().astype(int)
    )
    rows = steps[(steps["decode_seqs"] > 0) & steps["worker"].isin(workers)] if len(steps) else steps
    if window is not None and len(rows):
        rows = rows[(rows["start_s"] >= window[0]) & (rows["start_s"] <= window[1])]
    if rows is None or rows.empty:
        return pd.DataFrame({"seconds": [], "with_prefill": []})
    windows, roles = prefill_windows(requests), worker_roles(steps, requests)
    with_prefill = (rows["prefill_tokens"] > 0).to_numpy().copy()
    for worker, group in rows.groupby("worker"):
        if roles.get(int(worker)) == DECODE_ONLY:
            mask = (rows["worker"] == worker).to_numpy()
            with_prefill[mask] = _overlaps(group["start_s"].to_numpy(), group["end_s"].to_numpy(), windows)
    return pd.DataFrame(
        {"seconds": (rows["end_s"] - rows["start_s"]).to_numpy(np.float64), "with_prefill": with_prefill}
    )
