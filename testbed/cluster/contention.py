"""Whether the host was contended while a run measured it.

On CPU a worker's step is the host's time: a host busy with other work stretches every step, and
the run measures the host as much as the system. The reference is each process's own CPU time, so
it holds however busy the host was from the start: Linux counts, per thread, the time it ran on a
core and the time it waited, runnable, for one (/proc/<pid>/schedstat: on-CPU ns, run-queue wait
ns, time slices). Sampled for the router's and every local worker's main thread (the engine loop)
from the run's start to its end:

    stretch = (on-CPU + run-queue wait) / on-CPU,   pooled over the processes (CPU-weighted)

1.0 is a host that gave the run a core whenever it could run; 2.0 means the run's processes waited
for a core as long as they ran. Time blocked on I/O, on a device or on a peer is neither, so GPU
steps and tensor-parallel waits do not count as contention. Above `threshold` (metrics.
contended_stretch) the run is marked contended: summary.json's `host` section, the printed summary,
and a study's verdict, which names no winner from contended points.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

REFERENCE = (
    "each process's own CPU time: (on-CPU + run-queue wait) / on-CPU of the router's and every local "
    "worker's main thread over the run, from /proc/<pid>/schedstat"
)
UNMEASURED = "not measured: this platform has no /proc/<pid>/schedstat"


def schedstat(pid: int) -> Optional[tuple[float, float]]:
    """(seconds on a core, seconds waiting for one) of the process's main thread; None where the
    platform has no such counters or the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def load_1m() -> float:
    """The host's one-minute load average (NaN where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return math.nan


def host_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ContentionSampler:
    """The run's processes' CPU and run-queue counters, first and last sample each (a worker that
    died keeps its last), and the load average at the first and last sample."""

    def __init__(self, worker_pids: dict[str, int]):
        self.pids = {"router": os.getpid(), **worker_pids}
        self.first: dict[str, tuple[float, float]] = {}
        self.last: dict[str, tuple[float, float]] = {}
        self.load_first = self.load_last = math.nan
        self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            counters = schedstat(pid)
            if counters is not None:
                self.first.setdefault(name, counters)
                self.last[name] = counters
        self.load_last = load_1m()
        if math.isnan(self.load_first):
            self.load_first = self.load_last

    def spans(self) -> dict[str, tuple[float, float]]:
        """(on-CPU s, run-queue wait s) of each process between its first and last sample."""
        return {name: (self.last[name][0] - c0, self.last[name][1] - w0) for name, (c0, w0) in self.first.items()}

    def summary(self, threshold: float) -> dict:
        return host_summary(self.spans(), threshold, self.load_first, self.load_last, host_cores())


def stretch_of(cpu_s: float, wait_s: float) -> float:
    return (cpu_s + wait_s) / cpu_s if cpu_s > 0 else math.nan


def host_summary(
    spans: dict[str, tuple[float, float]], threshold: float, load_start: float, load_end: float, cores: int
) -> dict:
    """summary.json's `host`: contended when the pooled stretch exceeds `threshold`; the load
    average at the run's start (`load_1m`, as a sweep row's host_load_1m) and end; each process's
    figures as a list (a sweep's table leaves lists out: a row keeps the pooled figures)."""
    cpu = sum(c for c, _ in spans.values())
    wait = sum(w for _, w in spans.values())
    stretch = stretch_of(cpu, wait)
    measured = not math.isnan(stretch)
    return {
        "contended": bool(measured and stretch > threshold),
        "stretch": stretch,
        "threshold": threshold,
        "load_1m": load_start,
        "load_1m_end": load_end,
        "cores": cores,
        "reference": REFERENCE if measured else UNMEASURED,
        "processes": [
            {"process": name, "cpu_s": c, "wait_s": w, "stretch": stretch_of(c, w)} for name, (c, w) in spans.items()
        ],
    }
