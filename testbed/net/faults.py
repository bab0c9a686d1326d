"""Fault injection (`faults:` in the config). Every injected fault is recorded in the results.

- kill_worker / kill_at_s: the router kills that worker's process at that time; or, with
  kill_after_ended, once that many requests have ended (a state, not a time: the kill lands
  where the run is, however loaded the machine).
- stall_worker / stall_at_s / stall_ms: that worker sleeps, unresponsive, for stall_ms.
- drop_kv_probability: an attempt to send a request's KV loses its data: P begins the attempt
  (D's lease starts) but sends nothing, so D's lease runs out and kv_transfer.on_failure decides
  (fail, recompute on D, or retry: P sends again, and each attempt is drawn anew).
- delay_kv_ms: every KV send starts this much later than it could.
- exhaust_kv_pool: every worker's pool is shrunk to the least that holds one max_model_len
  request (preemption and back-pressure under load).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from testbed.errors import ConfigError


@dataclass(frozen=True)
class FaultsConfig:
    kill_worker: Optional[int] = None  # rank of the worker the router kills at kill_at_s; None: none
    kill_at_s: float = 1.0  # when to kill kill_worker (s after the run's start)
    kill_after_ended: Optional[int] = None  # kill kill_worker once this many requests ended, not at kill_at_s
    stall_worker: Optional[int] = None  # rank of the worker that stalls at stall_at_s; None: none
    stall_at_s: float = 1.0  # when stall_worker stalls (s after the run's start)
    stall_ms: float = 500.0  # how long stall_worker sleeps, unresponsive (ms)
    drop_kv_probability: float = 0.0  # chance in [0, 1] that a KV send attempt sends nothing (D's lease runs out)
    delay_kv_ms: float = 0.0  # every KV send starts this much later (ms)
    exhaust_kv_pool: bool = False  # shrink every worker's KV pool to the least that holds one max_model_len request

    def validate(self) -> "FaultsConfig":
        if not 0 <= self.drop_kv_probability <= 1:
            raise ConfigError(f"faults.drop_kv_probability must be in [0, 1] (got {self.drop_kv_probability})")
        for key in ("kill_at_s", "stall_at_s", "stall_ms", "delay_kv_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(f"faults.{key} must be >= 0 (got {getattr(self, key)})")
        if self.kill_after_ended is not None and (self.kill_worker is None or self.kill_after_ended < 1):
            raise ConfigError(
                f"faults.kill_after_ended must be >= 1 and needs faults.kill_worker set "
                f"(got {self.kill_after_ended}, kill_worker={self.kill_worker})"
            )
        return self

    @property
    def delay_kv_s(self) -> float:
        return self.delay_kv_ms / 1000

    @property
    def hits_workers(self) -> bool:
        """Whether the router kills or stalls a worker (one box only: it owns their processes)."""
        return self.kill_worker is not None or self.stall_worker is not None

    def timed(self) -> list[tuple[float, str, int]]:
        """(time, kind, worker) of the faults the router injects, in time order."""
        out = []
        if self.kill_worker is not None and self.kill_after_ended is None:
            out.append((self.kill_at_s, "kill_worker", self.kill_worker))
        if self.stall_worker is not None:
            out.append((self.stall_at_s, "stall_worker", self.stall_worker))
        return sorted(out)


@dataclass(frozen=True)
class Stall:
    """router -> worker: stop responding for `seconds`."""

    seconds: float


@dataclass(frozen=True)
class FaultInjected:
    """worker -> router: a fault this worker injected (KV drop or delay)."""

    worker: int
    kind: str
    rid: Optional[int]
    t: float


class KVFaults:
    """The prefill worker's side: which sends to drop, how long to hold them. Seeded per rank."""

    def __init__(self, faults: FaultsConfig, seed: int):
        self.drop_probability, self.delay_s = faults.drop_kv_probability, faults.delay_kv_s
        self.rng = random.Random(seed)

    def drop(self) -> bool:
        return self.drop_probability > 0 and self.rng.random() < self.drop_probability
