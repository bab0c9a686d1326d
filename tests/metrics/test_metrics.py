"""Metric functions on hand-made timestamps; every expected value is worked out by hand."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from testbed.metrics import (
    Event,
    MetricsConfig,
    RequestLog,
    SLOConfig,
    attainment_by_tenant,
    attainment_curve,
    capacity,
    decode_stalls,
    distribution,
    goodput,
    interference_ratio,
    json_safe,
    mark_warmup,
    pooled_itl,
    request_table,
    slo_attainment,
    summarize,
    tenant_slos,
    throughput,
    ttft_by_bucket,
)

T0 = 100.0


def req(request_id, arrival_s, input_len=100, output_len=4, tenant="default"):
    return SimpleNamespace(
        request_id=request_id,
        arrival_s=arrival_s,
        input_len=input_len,
        output_len=output_len,
        session_id=None,
        turn=0,
        tenant=tenant,
    )


@pytest.fixture
def log() -> RequestLog:
    """A: full disaggregated lifecycle, 4 tokens. B: one token. C: failed. D: rejected."""
    log = RequestLog(T0)
    log.register(req(0, 0.0, input_len=100))
    log.event(0, Event.DISPATCHED, 100.1)
    log.event(0, Event.PREFILL_START, 100.2, worker=0)
    log.event(0, Event.PREFILL_START, 100.25, worker=0)  # a second start: the first is kept
    log.event(0, Event.PREFILL_CHUNK, 100.2)
    log.event(0, Event.PREFILL_CHUNK, 100.3)
    log.event(0, Event.PREFILL_END, 100.4)
    log.event(0, Event.PREFILL_END, 100.5)  # the last end is kept
    log.event(0, Event.KV_TRANSFER_START, 100.5)
    log.event(0, Event.KV_TRANSFER_END, 100.7, kv_bytes=1000, prefill_worker=0, decode_worker=1)
    log.event(0, Event.DECODE_QUEUED, 100.7, worker=1)
    log.event(0, Event.DECODE_START, 100.9, worker=1)
    log.tokens(0, [11], 100.5, 100.6)
    log.tokens(0, [12], 100.95, 101.0)
    log.tokens(0, [13], 101.15, 101.2)
    log.tokens(0, [14], [101.35], 101.4)
    log.finish(0, 101.4)
    log.register(req(1, 1.0, input_len=200, output_len=1))
    log.tokens(1, [7], 101.45, 101.5)
    log.finish(1, 101.5)
    log.register(req(2, 2.0))
    log.fail(2, 103.0, "worker died")
    log.reject(req(3, 3.0, input_len=5000), 103.0, "overlength", by="workload")
    return log


def test_distribution_by_linear_interpolation():
    d = distribution([5, 1, 4, 2, 3])
    # Sorted 1..5; percentile q sits at index q/100 * 4: p90 -> 3.6 -> 4 + 0.6 = 4.6.
    assert d == pytest.approx({"mean": 3.0, "p50": 3.0, "p90": 4.6, "p95": 4.8, "p99": 4.96, "max": 5.0})
    assert all(math.isnan(v) for v in distribution([]).values())
    assert distribution([1.0, float("nan"), 3.0])["mean"] == 2.0


def test_request_table_lifecycle_and_derived_columns(log):
    t = log.table().set_index("request_id")
    a = t.loc[0]
    assert a["status"] == "ok" and a["prefill_worker"] == 0 and a["decode_worker"] == 1
    assert a["dispatched_s"] == pytest.approx(0.1)
    assert a["prefill_start_s"] == pytest.approx(0.2) and a["prefill_end_s"] == pytest.approx(0.5)
    assert a["num_prefill_chunks"] == 2 and a["kv_bytes"] == 1000
    assert list(a["output_token_ids"]) == [11, 12, 13, 14]
    assert a["token_times"] == pytest.approx([0.6, 1.0, 1.2, 1.4])
    assert a["ttft"] == pytest.approx(0.6)  # 0.6 - 0.0
    assert a["tpot"] == pytest.approx(0.8 / 3)  # (1.4 - 0.6) / (4 - 1)
    assert a["e2e"] == pytest.approx(1.4)
    assert a["normalized_latency"] == pytest.approx(0.35)  # 1.4 / 4
    assert a["prefill_queue_s"] == pytest.approx(0.2)  # 0.2 - 0.0
    assert a["decode_queue_s"] == pytest.approx(0.2)  # 0.9 - 0.7
    assert a["kv_transfer_s"] == pytest.approx(0.2)  # 0.7 - 0.5
    b = t.loc[1]
    assert b["ttft"] == pytest.approx(0.5) and math.isnan(b["tpot"]) and b["e2e"] == pytest.approx(0.5)
    assert math.isnan(b["prefill_start_s"])
    assert (t.loc[2, "status"], t.loc[2, "reason"]) == ("failed", "worker died")
    assert (t.loc[3, "status"], t.loc[3, "reason"], t.loc[3, "input_len"]) == ("rejected", "overlength", 5000)


def test_unfinished_request_is_failed():
    log = RequestLog(0.0)
    log.register(req(0, 0.0))
    row = log.table().iloc[0]
    assert (row["status"], row["reason"]) == ("failed", "unfinished")


def test_itl_pools_every_gap(log):
    assert sorted(pooled_itl(log.table())) == pytest.approx([0.2, 0.2, 0.4])


def test_slo_attainment_counts_failures_as_misses_and_ignores_rejections(log):
    t = log.table()
    # A: TTFT 0.6 > 0.55 misses; B: TTFT 0.5 and a single token meets; C failed misses; D not counted.
    assert slo_attainment(t, SLOConfig(ttft_s=0.55, tpot_s=0.3)) == pytest.approx(1 / 3)
    # A: TTFT 0.6 <= 0.7 and TPOT 0.2667 <= 0.3 meets too.
    assert slo_attainment(t, SLOConfig(ttft_s=0.7, tpot_s=0.3)) == pytest.approx(2 / 3)
    # TPOT 0.2667 > 0.25: A misses again.
    assert slo_attainment(t, SLOConfig(ttft_s=0.7, tpot_s=0.25)) == pytest.approx(1 / 3)


def test_attainment_curve_scales_both_slos(log):
    curve = attainment_curve(log.table(), SLOConfig(ttft_s=0.55, tpot_s=0.3), [0.5, 1.0, 2.0])
    # x0.5: TTFT SLO 0.275 nobody; x1: B only; x2: TTFT 1.1, TPOT 0.6: A and B.
    assert curve == pytest.approx({0.5: 0.0, 1.0: 1 / 3, 2.0: 2 / 3})


def test_tenant_slos_override():
    t = request_table(
        [
            {"request_id": 0, "arrival_s": 0.0, "tenant": "chat", "token_times": [0.5, 0.6]},
            {"request_id": 1, "arrival_s": 0.0, "tenant": "batch", "token_times": [3.0, 3.5]},
            {"request_id": 2, "arrival_s": 0.0, "tenant": "batch", "token_times": [5.0, 5.1]},
        ]
    )
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.2)
    tenants = tenant_slos([SimpleNamespace(name="batch", ttft_s=4.0, tpot_s=None)], slo)
    assert tenants["batch"] == SLOConfig(ttft_s=4.0, tpot_s=0.2)
    # chat: 0.5 <= 1.0, 0.1 <= 0.2 ok. batch #1: TTFT 3 <= 4 but TPOT 0.5 > 0.2 misses; batch #2: TTFT 5 > 4.
    assert slo_attainment(t, slo) == pytest.approx(1 / 3)
    assert slo_attainment(t, slo, tenants) == pytest.approx(1 / 3)
    assert attainment_by_tenant(t, slo, tenants) == {"batch": 0.0, "chat": 1.0}
    relaxed = {"batch": SLOConfig(ttft_s=6.0, tpot_s=1.0)}
    assert attainment_by_tenant(t, slo, relaxed) == {"batch": 1.0, "chat": 1.0}


def test_goodput_interpolates_between_bracketing_rates():
    # Attainment 0.95 at 2 req/s, 0.85 at 3 req/s: crosses 0.9 halfway -> 2.5.
    assert goodput([1, 2, 3, 4], [1.0, 0.95, 0.85, 0.5]) == pytest.approx(2.5)
    assert goodput([4, 1, 3, 2], [0.5, 1.0, 0.85, 0.95]) == pytest.approx(2.5)  # unsorted input
    assert goodput([1, 2, 3, 4], [1.0, 0.95, 0.85, 0.5], num_gpus=2) == pytest.approx(1.25)
    # 0.9 exactly at 2, 0.8 at 4: 2 + (0 / 0.1) * 2 = 2.
    assert goodput([2, 4], [0.9, 0.8]) == pytest.approx(2.0)
    # 0.98 at 1, 0.78 at 3: 1 + 0.08 / 0.2 * 2 = 1.8.
    assert goodput([1, 3], [0.98, 0.78]) == pytest.approx(1.8)


def test_goodput_edge_cases():
    assert goodput([1, 2, 3], [1.0, 0.99, 0.95]) == 3.0  # every rate passes: the highest
    assert goodput([1, 2, 3], [0.5, 0.4, 0.1]) == 0.0  # none passes
    assert goodput([], []) == 0.0
    # Non-monotonic: the highest passing rate (3) wins, interpolated towards 4.
    assert goodput([1, 2, 3, 4], [0.95, 0.8, 0.92, 0.82]) == pytest.approx(3.2)


def test_capacity_interpolates_p99_itl():
    # Margins 0.05, 0.02, -0.02 -> crosses between 2 and 4 halfway: 3.0.
    assert capacity([1, 2, 4], [0.05, 0.08, 0.12], itl_slo=0.1) == pytest.approx(3.0)
    assert capacity([1, 2], [0.2, 0.3], itl_slo=0.1) == 0.0
    assert capacity([1, 2], [0.01, 0.02], itl_slo=0.1) == 2.0


def test_interference_and_stalls():
    assert interference_ratio([0.2, 0.2, 0.2], [0.1, 0.1]) == pytest.approx(2.0)
    assert math.isnan(interference_ratio([], [0.1]))
    # Median 0.1; 5 x median = 0.5: the gaps 0.6 and 1.0 are stalls, 0.5 is not.
    assert decode_stalls([0.1, 0.1, 0.1, 0.1, 0.5, 0.6, 1.0], factor=5.0) == 2
    assert decode_stalls([], factor=5.0) == 0


def test_ttft_by_input_bucket():
    t = request_table(
        [
            {"request_id": i, "arrival_s": 0.0, "input_len": n, "token_times": [ttft]}
            for i, (n, ttft) in enumerate([(100, 0.1), (1023, 0.3), (1024, 1.0), (5000, 2.0), (20000, 8.0)])
        ]
    )
    buckets = ttft_by_bucket(t)
    assert buckets["0-1K"]["count"] == 2 and buckets["0-1K"]["mean"] == pytest.approx(0.2)
    assert buckets["1K-4K"]["count"] == 1 and buckets["1K-4K"]["max"] == pytest.approx(1.0)
    assert buckets["4K-16K"]["p50"] == pytest.approx(2.0) and buckets["16K+"]["p99"] == pytest.approx(8.0)


def test_throughput(log):
    tput = throughput(log.table())
    # First arrival 0.0 (A), last token of a finished request 1.5 (B): 1.5 s.
    assert tput["duration_s"] == pytest.approx(1.5)
    assert tput["requests_per_s"] == pytest.approx(2 / 1.5)
    assert tput["input_tokens_per_s"] == pytest.approx(300 / 1.5)  # 100 + 200
    assert tput["output_tokens_per_s"] == pytest.approx(5 / 1.5)  # 4 + 1


def test_warmup_by_count_and_time(log):
    t = log.table()
    assert list(mark_warmup(t, MetricsConfig(warmup_requests=2))["warmup"]) == [True, True, False, False]
    assert list(mark_warmup(t, MetricsConfig(warmup_s=2.5))["warmup"]) == [True, True, True, False]


def test_summarize(log):
    s = summarize(log.table(), slo=SLOConfig(ttft_s=0.7, tpot_s=0.3), num_gpus=2)
    json.dumps(s, allow_nan=False)
    assert s["num_requests"] == {"ok": 2, "failed": 1, "rejected": 1, "refused": 0, "total": 4}
    assert s["ttft"]["mean"] == pytest.approx(0.55)  # (0.6 + 0.5) / 2
    assert s["tpot"]["mean"] == pytest.approx(0.8 / 3)
    assert s["itl"]["p50"] == pytest.approx(0.2) and s["itl"]["max"] == pytest.approx(0.4)
    assert s["e2e"]["max"] == pytest.approx(1.4)
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["kv_transfer"]["bytes_total"] == 1000 and s["kv_transfer"]["count"] == 1
    assert s["kv_transfer"]["aggregate_bandwidth_bytes_per_s"] == pytest.approx(5000.0)  # 1000 B / 0.2 s
    assert s["queue"]["prefill_queue_s"]["mean"] == pytest.approx(0.2)
    assert s["queue"]["decode_queue_s"]["p99"] == pytest.approx(0.2)
    # Harness delays: A 0.1, 0.05, 0.05, 0.05; B 0.05. p99 at index 3.96: 0.05 + 0.96 * 0.05 = 0.098.
    assert s["harness_delay"]["p50"] == pytest.approx(0.05) and s["harness_delay"]["p99"] == pytest.approx(0.098)
    assert s["throughput"]["requests_per_s_per_gpu"] == pytest.approx(2 / 1.5 / 2)
    assert s["ttft_by_bucket"]["16K+"]["mean"] is None  # NaN becomes null
    assert s["warmup_excluded"] == 0


def test_summarize_with_warmup_steps_and_transfers(log):
    steps = pd.DataFrame(
        {
            "role": ["prefill", "decode", "decode"],
            "start_s": [0.0, 0.0, 1.0],
            "end_s": [0.5, 0.1, 1.3],
            "batched_tokens": [100, 2, 4],
        }
    )
    transfers = pd.DataFrame(
        {"request_id": [0, 0], "kv_bytes": [600.0, 400.0], "start_s": [0.5, 0.6], "end_s": [0.6, 0.7]}
    )
    s = summarize(log.table(), steps, transfers, slo=SLOConfig(), metrics=MetricsConfig(warmup_requests=1))
    assert s["warmup_excluded"] == 1 and s["num_requests"]["ok"] == 1
    assert s["steps_by_role"] == {"decode": 2, "prefill": 1}
    assert s["mean_step_s_by_role"]["decode"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
    assert s["kv_transfer"]["count"] == 2
    assert s["kv_transfer"]["bandwidth_bytes_per_s"]["max"] == pytest.approx(6000.0)  # 600 B / 0.1 s


def test_summarize_empty_table_does_not_crash():
    s = summarize(request_table([]), slo=SLOConfig())
    json.dumps(s, allow_nan=False)
    assert s["ttft"]["p99"] is None and s["slo_attainment"] is None


def test_json_safe():
    assert json_safe({"a": np.float32(1.5), "b": float("nan"), 3: (np.int64(2), float("inf"))}) == {
        "a": 1.5,
        "b": None,
        "3": [2, None],
    }
