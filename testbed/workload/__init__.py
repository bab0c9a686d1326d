"""Workloads: arrival processes, length distributions, sessions, tenants and trace replay."""

from testbed.workload.builder import Workload, build_workload
from testbed.workload.config import LengthConfig, TenantConfig, WorkloadConfig, WorkloadError
from testbed.workload.request import Request

__all__ = ["build_workload", "Request", "Workload", "WorkloadConfig", "WorkloadError", "LengthConfig", "TenantConfig"]
