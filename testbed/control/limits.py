"""Admission by tenant: token buckets on requests and on prompt tokens, and the workers a
request may go to (its tenant's pool, or the long-prompt pool by input length). No clock: the
driver passes the time, its own (router) or virtual (simulator), so both refuse alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from testbed.errors import ConfigError


@dataclass
class TokenBucket:
    rate: float  # per second
    capacity: float
    level: Optional[float] = None  # None: full, on first use
    last: float = 0.0

    def refill(self, t: float) -> float:
        if self.level is None:
            self.level = self.capacity
        else:
            self.level = min(self.capacity, self.level + (t - self.last) * self.rate)
        self.last = t
        return self.level


class TenantLimits:
    """Per tenant (by name), its buckets; a request is admitted only when every bucket of its
    tenant holds what it takes (a request, its prompt tokens; a prompt larger than the token
    bucket when that bucket is full, leaving it in debt), and then takes from each."""

    def __init__(self, tenants: Sequence):
        self.buckets: dict[str, list[tuple[str, TokenBucket]]] = {}
        for tenant in tenants:
            limit = tenant.rate_limit
            # a bucket holds at least one request (else a slow limit would refuse every one)
            pairs = [
                (unit, TokenBucket(rate, max(rate * limit.burst_s, 1.0)))
                for unit, rate in (("requests", limit.requests_per_s), ("prompt tokens", limit.prompt_tokens_per_s))
                if rate is not None
            ]
            if pairs:
                self.buckets[tenant.name] = pairs

    def refusal(self, tenant: str, prompt_tokens: int, t: float) -> Optional[str]:
        """Why the tenant's limit refuses the request at time t, or None (and it is counted)."""
        pairs = self.buckets.get(tenant, [])
        needs = [1.0 if unit == "requests" else float(prompt_tokens) for unit, _ in pairs]
        for (unit, bucket), need in zip(pairs, needs):
            if bucket.refill(t) < min(need, bucket.capacity):
                return f"tenant {tenant} over its rate limit of {bucket.rate:g} {unit}/s (burst {bucket.capacity:g})"
        for (_, bucket), need in zip(pairs, needs):
            bucket.level -= need
        return None

    def refund(self, tenant: str, prompt_tokens: int) -> None:
        """Give back what an admitted request took when it is refused after all (no worker)."""
        for unit, bucket in self.buckets.get(tenant, []):
            bucket.level = min(bucket.capacity, bucket.level + (1.0 if unit == "requests" else prompt_tokens))


class Routes:
    """The front workers a request may go to: its tenant's `workers`, and for prompts of at
    least `cluster.long_prompt_min_tokens` the `cluster.long_prompt_workers` (shorter prompts
    then keep off them). None: any live worker."""

    def __init__(self, cluster, tenants: Sequence, front: Sequence[int]):
        self.min_tokens, self.long = cluster.long_prompt_min_tokens, set(cluster.long_prompt_workers)
        self.pools = {t.name: set(t.workers) for t in tenants if t.workers}
        named = [("cluster.long_prompt_workers", self.long)]
        named += [(f"workload.tenants[{t}].workers", pool) for t, pool in self.pools.items()]
        for what, ranks in named:
            if not ranks <= set(front):
                raise ConfigError(
                    f"{what}={sorted(ranks)} names workers that take no requests; "
                    f"allowed: {sorted(front)} (mixed or prefill workers)"
                )
        if self.long and self.long == set(front):
            raise ConfigError("cluster.long_prompt_workers names every front worker: short prompts have none left")
        self.front = set(front)

    def allowed(self, tenant: str, prompt_tokens: int) -> Optional[set[int]]:
        pool = self.pools.get(tenant)
        if self.long and self.min_tokens is not None:
            by_length = self.long if prompt_tokens >= self.min_tokens else self.front - self.long
            pool = by_length if pool is None else (pool & by_length) or pool  # the tenant's pool wins a conflict
        return pool
