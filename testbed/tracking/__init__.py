"""Tracking: writing results directories (testbed/metrics/results_dir.py reads them), optional W&B
trackers and optional NVML telemetry."""

from testbed.tracking.config import TrackerConfig
from testbed.tracking.nvml import gpu_inventory, start_telemetry
from testbed.tracking.results import collect_meta, write_results
from testbed.tracking.wandb_tracker import NullTracker, Tracker, TrackerError, WandbTracker, make_tracker

__all__ = [
    "write_results",
    "collect_meta",
    "TrackerConfig",
    "Tracker",
    "NullTracker",
    "WandbTracker",
    "TrackerError",
    "make_tracker",
    "start_telemetry",
    "gpu_inventory",
]
