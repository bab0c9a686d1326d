"""Admission and routing by tenant: token buckets on requests and prompt tokens, tenant pools
and long-prompt workers; the same rules in a simulated run as in the book."""

from __future__ import annotations

import pytest

from testbed.control.book import RequestBook
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.control.limits import Routes, TenantLimits, TokenBucket
from testbed.errors import ConfigError
from testbed.metrics.events import RequestLog
from testbed.workload import Request
from testbed.workload.config import RateLimitConfig, TenantConfig
from tests.cluster_helpers import make_config


def request(rid: int, tenant: str = "chat", input_len: int = 10) -> Request:
    return Request(
        request_id=rid, arrival_s=0.0, prompt_token_ids=tuple(range(1, input_len + 1)), output_len=2, tenant=tenant
    )


def test_a_bucket_starts_full_refills_at_its_rate_and_never_past_its_capacity():
    bucket = TokenBucket(rate=2.0, capacity=4.0)
    assert bucket.refill(10.0) == 4.0
    bucket.level -= 4.0
    assert bucket.refill(11.0) == 2.0 and bucket.refill(100.0) == 4.0


def test_a_tenant_over_either_limit_is_refused_and_takes_nothing():
    limits = TenantLimits(
        [
            TenantConfig(
                name="chat", rate_limit=RateLimitConfig(requests_per_s=2, prompt_tokens_per_s=100, burst_s=1.0)
            ),
            TenantConfig(name="batch"),
        ]
    )
    assert limits.refusal("chat", 60, 0.0) is None
    assert "100 prompt tokens/s" in limits.refusal("chat", 60, 0.0)  # 40 tokens left
    assert limits.refusal("chat", 40, 0.0) is None  # the refusal took nothing: a request is still left
    assert "2 requests/s" in limits.refusal("chat", 1, 0.0)
    assert limits.refusal("chat", 40, 0.5) is None  # half a second: one request and 50 tokens back
    assert all(limits.refusal("batch", 10_000, 0.0) is None for _ in range(5))  # no limit


def test_routes_by_tenant_pool_and_by_input_length():
    cluster = ClusterConfig(long_prompt_min_tokens=100, long_prompt_workers=[2])
    routes = Routes(cluster, [TenantConfig(name="vip", workers=[0])], front=[0, 1, 2])
    assert routes.allowed("chat", 500) == {2} and routes.allowed("chat", 50) == {0, 1}
    assert routes.allowed("vip", 50) == {0} and routes.allowed("vip", 500) == {0}  # its pool wins
    assert Routes(ClusterConfig(), [], front=[0, 1]).allowed("chat", 10_000) is None
    with pytest.raises(ConfigError, match="allowed: \\[0, 1\\]"):
        Routes(ClusterConfig(long_prompt_min_tokens=100, long_prompt_workers=[3]), [], front=[0, 1])
    with pytest.raises(ConfigError, match="go together"):
        ClusterConfig(long_prompt_min_tokens=100).validate()
    with pytest.raises(ConfigError, match="every front worker"):
        Routes(ClusterConfig(long_prompt_min_tokens=1, long_prompt_workers=[0, 1]), [], front=[0, 1])


def test_the_book_refuses_with_the_reason_and_routes_within_the_pool():
    roles = {0: "colocated", 1: "colocated", 2: "colocated"}
    tenants = [
        TenantConfig(name="chat", rate_limit=RateLimitConfig(requests_per_s=1)),
        TenantConfig(name="vip", workers=[2]),
    ]
    b = RequestBook(
        ClusterConfig(dispatch="round_robin"), KVTransferConfig(), False, roles, RequestLog(0.0), tenants=tenants
    )
    assert b.admit(request(0), 0.0) is not None
    assert b.admit(request(1), 0.1) is None
    assert [b.admit(request(i, "vip"), 0.1).worker for i in range(2, 5)] == [2, 2, 2]
    table = b.log.table().set_index("request_id")
    assert table.loc[1, "status"] == "rejected" and table.loc[1, "refused_by"] == "admission"
    assert "tenant chat over its rate limit" in table.loc[1, "reason"]


def test_a_simulated_run_refuses_a_limited_tenant_and_counts_the_refusals_as_misses():
    from testbed.sim.executor import simulate
    from tests.sim.test_sim import PROFILE

    cfg = make_config(
        "workload=mixed_tenants",
        "workload.num_requests=60",
        "workload.rate=40",
        "hardware=cpu",
        "mode=chunked",
        "cluster.num_workers=2",
        "+workload.tenants.1.rate_limit.requests_per_s=2",
    )
    result = simulate(cfg.serving, cfg.sim, PROFILE, num_devices=2)
    requests = result["requests"]
    refused = requests[requests.status == "rejected"]
    assert len(refused) > 0 and set(refused.tenant) == {"summarize"}
    assert refused.reason.str.contains("tenant summarize over its rate limit").all()
    assert result["summary"]["num_requests"]["refused"] == len(refused)
    assert result["summary"]["slo_attainment"] < 1 - len(refused) / len(requests) + 1e-9


def test_a_slow_limit_still_admits_and_a_prompt_larger_than_the_bucket_goes_in_debt():
    limits = TenantLimits(
        [
            TenantConfig(name="slow", rate_limit=RateLimitConfig(requests_per_s=0.5)),
            TenantConfig(name="tokens", rate_limit=RateLimitConfig(prompt_tokens_per_s=100)),
        ]
    )
    assert limits.refusal("slow", 10, 0.0) is None  # the bucket holds one request, not half of one
    assert "0.5 requests/s" in limits.refusal("slow", 10, 1.0)
    assert limits.refusal("slow", 10, 2.0) is None  # two seconds a request
    assert limits.refusal("tokens", 500, 0.0) is None  # a full bucket lets one oversized prompt in
    assert "100 prompt tokens/s" in limits.refusal("tokens", 10, 1.0)  # ... and owes 400 tokens for it
    assert limits.refusal("tokens", 10, 5.0) is None
    limits.refund("tokens", 10)
    assert limits.refusal("tokens", 100, 5.0) is None  # the refund made the bucket whole again


def test_a_request_with_no_live_worker_is_not_charged_to_its_tenant():
    roles = {0: "colocated"}
    tenants = [TenantConfig(name="chat", rate_limit=RateLimitConfig(requests_per_s=1))]
    b = RequestBook(ClusterConfig(), KVTransferConfig(), False, roles, RequestLog(0.0), tenants=tenants)
    b.lose_worker(0)
    assert b.admit(request(0), 0.0) is None
    assert b.limits.refusal("chat", 10, 0.0) is None  # the refused request took nothing
