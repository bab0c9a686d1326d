"""Tracking: results directories (and, elsewhere, optional W&B and NVML telemetry)."""

from testbed.tracking.results import ResultsError, collect_meta, read_results, write_results

__all__ = ["write_results", "read_results", "collect_meta", "ResultsError"]
