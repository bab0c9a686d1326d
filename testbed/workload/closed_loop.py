"""A closed loop: `concurrency` users, each sending its next request when its last one ended.

The requests are the open loop's (same lengths, trace rows, tenants, in arrival order); only when
each is sent changes. The first `concurrency` go at time 0; every later one is sent a think time
after some user's request ended (finished, failed or refused), so no more than `concurrency` are
ever in flight. A request's arrival is its send time, so TTFT excludes the think time. Paced
(`workload.paced`), a request also waits for its open-loop arrival: the arrival process stands
and the users cap it, as vLLM's `bench serve --request-rate R --max-concurrency N`.

Think times are drawn up front, one per request in send order, from their own stream: the same
seed gives the same waits whichever user sends which request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from testbed.workload.request import TAG_THINK, Request, derived_rng


class Users:
    """Hands out a closed loop's requests: `first()` at the start, `after(t)` as each ends."""

    def __init__(self, pool: list[Request], cfg, seed: int):
        self.pool, self.concurrency, self.paced = pool, cfg.concurrency, cfg.paced
        self.duration_s = cfg.duration_s
        mean = cfg.think_s(closed=True)
        if cfg.think_time_dist == "exponential" and mean > 0:
            self.think = derived_rng(seed, TAG_THINK).exponential(mean, size=len(pool)).tolist()
        else:
            self.think = [float(mean)] * len(pool)
        self.sent = 0
        self.last_send_s = 0.0
        self.think_sum = 0.0  # of the waits taken so far

    def first(self) -> list[Request]:
        """The requests the users start with (every user at time 0; paced: at their arrivals)."""
        out = []
        while self.sent < min(self.concurrency, len(self.pool)):
            request = self._take(0.0)
            if request is None:
                break
            out.append(request)
        return out

    def after(self, ended_s: float) -> Optional[Request]:
        """The next request of the user whose request ended at `ended_s` (None: nothing left)."""
        if self.sent >= len(self.pool):
            return None
        self.think_sum += self.think[self.sent]
        return self._take(ended_s + self.think[self.sent])

    def _take(self, ready_s: float) -> Optional[Request]:
        request = self.pool[self.sent]
        at = max(ready_s, request.arrival_s) if self.paced else ready_s
        if self.duration_s is not None and at > self.duration_s:
            self.sent = len(self.pool)  # the run's window closed: no user sends again
            return None
        self.sent += 1
        self.last_send_s = max(self.last_send_s, at)
        return replace(request, arrival_s=float(at))

    @property
    def unsent(self) -> int:
        return len(self.pool) - self.sent

    def report(self) -> dict:
        """The loop as summary.json's workload_report states it (sent rate: sends over their span)."""
        rate = self.sent / self.last_send_s if self.last_send_s > 0 else float("nan")
        return {
            "loop": "closed",
            "concurrency": self.concurrency,
            "paced": self.paced,
            "requests_sent": self.sent,
            "sent_per_s": rate,
            "mean_think_s": self.think_sum / max(self.sent - min(self.sent, self.concurrency), 1),
        }
