"""A run's metadata (meta.json): the seed, the host, Python, torch and its CUDA/NCCL, the
installed inference libraries, the GPUs and the checkout's git state."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pyarrow as pa

from testbed.metrics.summary import json_safe
from testbed.tracking.nvml import gpu_inventory

CHECKOUT = Path(__file__).resolve().parents[2]


def collect_meta(seed: int, extra: Optional[dict] = None) -> dict[str, Any]:
    """Versions, host, devices, git commit and seed of a run (for meta.json)."""

    meta: dict[str, Any] = {
        "seed": int(seed),
        "time_unix": time.time(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "pyarrow": pa.__version__,
    }
    meta.update(_torch_meta())
    meta.update(_git_meta())
    meta["hardware"] = _hardware_meta()
    meta.update(extra or {})
    return json_safe(meta)


def _torch_meta() -> dict[str, Any]:
    """torch's version and the CUDA devices it sees. A run that never imported torch (a
    simulation) used no device: it reads the installed version without the import (seconds)."""
    if "torch" not in sys.modules:
        try:
            return {"torch": importlib.metadata.version("torch"), "cuda": None, "cuda_devices": []}
        except importlib.metadata.PackageNotFoundError:
            return {"torch": None, "cuda_devices": []}
    try:
        import torch
    except Exception:  # torch absent or broken: the metadata says so instead of failing the run
        return {"torch": None, "cuda_devices": []}
    devices, nccl = [], None
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        nccl = nccl_version(torch)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_devices": devices,
        "nccl": nccl,
        "flash_attn": _installed("flash-attn"),
        "triton": _installed("triton"),
    }


def nccl_version(torch) -> Optional[str]:
    """NCCL's version where this torch build has NCCL (None on a CPU build)."""
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()  # a tuple (2, 21, 5); one integer on old torch
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _installed(distribution: str) -> Optional[str]:
    """A package's installed version without importing it (None when absent)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hardware_meta() -> dict[str, Any]:
    """GPUs, driver and NVLink/P2P topology from NVML (read only); the reason when absent."""
    try:
        return gpu_inventory()
    except Exception as e:  # an odd driver must not fail the run: the metadata says so instead
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}


def _git_meta() -> dict[str, Any]:
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}
