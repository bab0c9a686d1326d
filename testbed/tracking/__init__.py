"""Tracking: results directories, optional W&B trackers and optional NVML telemetry."""

from testbed.tracking.config import TrackerConfig
from testbed.tracking.results import ResultsError, collect_meta, read_results, write_results
from testbed.tracking.telemetry import gpu_inventory, start_telemetry
from testbed.tracking.wandb_tracker import NullTracker, Tracker, TrackerError, WandbTracker, make_tracker

__all__ = ["write_results", "read_results", "collect_meta", "ResultsError", "TrackerConfig", "Tracker",
           "NullTracker", "WandbTracker", "TrackerError", "make_tracker", "start_telemetry", "gpu_inventory"]
