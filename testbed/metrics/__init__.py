"""Metrics: lifecycle events -> per-request table -> summaries (pure functions)."""

from testbed.metrics.concurrency import by_concurrency, token_batches
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.events import REQUEST_COLUMNS, STEP_COLUMNS, TRANSFER_COLUMNS, Event, RequestLog, request_table
from testbed.metrics.latency import (
    add_derived,
    by_output_bucket,
    decode_stalls,
    distribution,
    harness_delays,
    interference_ratio,
    pooled_itl,
    ttft_by_bucket,
    ttft_by_tenant,
)
from testbed.metrics.slo import (
    attainment_by_tenant,
    attainment_curve,
    capacity,
    goodput,
    meets_slo,
    slo_attainment,
    tenant_slos,
)
from testbed.metrics.summary import (
    json_safe,
    kv_transfer_summary,
    mark_warmup,
    pool_and_cache_by_worker,
    step_summary,
    summarize,
    throughput,
)
from testbed.metrics.telemetry import gpu_roles, telemetry_summary

__all__ = [
    "Event",
    "RequestLog",
    "request_table",
    "REQUEST_COLUMNS",
    "STEP_COLUMNS",
    "TRANSFER_COLUMNS",
    "SLOConfig",
    "MetricsConfig",
    "distribution",
    "add_derived",
    "pooled_itl",
    "harness_delays",
    "ttft_by_bucket",
    "interference_ratio",
    "decode_stalls",
    "meets_slo",
    "slo_attainment",
    "attainment_by_tenant",
    "attainment_curve",
    "goodput",
    "capacity",
    "tenant_slos",
    "summarize",
    "mark_warmup",
    "throughput",
    "kv_transfer_summary",
    "step_summary",
    "json_safe",
    "ttft_by_tenant",
    "by_output_bucket",
    "by_concurrency",
    "token_batches",
    "pool_and_cache_by_worker",
    "telemetry_summary",
    "gpu_roles",
]
