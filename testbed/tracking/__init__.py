"""Tracking: a run's metadata, optional W&B trackers and optional NVML telemetry (the results
directory itself is written and read by testbed/metrics/results_dir.py)."""

from testbed.tracking.config import TrackerConfig
from testbed.tracking.nvml import gpu_inventory, start_telemetry
from testbed.tracking.run_meta import collect_meta
from testbed.tracking.wandb_tracker import NullTracker, Tracker, TrackerError, WandbTracker, make_tracker

__all__ = [
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
