"""Resident memory of the run's processes over time (Linux /proc), to show a run does not grow."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def rss_bytes(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or the process is gone
    return None


class RssSampler:
    """Samples the router and every worker; `summary()` gives first, last and max in MiB."""

    def __init__(self, worker_pids: dict[str, int]):
        self.pids = {"router": os.getpid(), **worker_pids}
        self.samples: dict[str, list[int]] = {name: [] for name in self.pids}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            value = rss_bytes(pid)
            if value is not None:
                self.samples[name].append(value)

    def summary(self) -> dict:
        mib = 1 << 20
        return {name: {"first_mib": v[0] / mib, "last_mib": v[-1] / mib, "max_mib": max(v) / mib, "samples": len(v)}
                for name, v in self.samples.items() if v}
