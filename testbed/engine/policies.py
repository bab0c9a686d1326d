"""Scheduling policies, one per worker role. The mode picks them once, where workers are built.

| policy         | a step holds                                               | used by         |
|----------------|------------------------------------------------------------|-----------------|
| `colocated`    | prefill chunks alone if any prefill work is admissible, else all decodes | colocated mode |
| `chunked`      | every running decode, then prefill chunks up to the budget | chunked mode    |
| `prefill_only` | prefill chunks; a sequence leaves after its first token    | disagg P worker |
| `decode_only`  | all decodes of sequences whose KV arrived                  | disagg D worker |
"""

from __future__ import annotations

from testbed.engine.scheduler import Batch, Scheduler
from testbed.errors import ConfigError
from testbed.names import Role


class PrefillFirst:
    """vLLM v0 / Orca style: a prefill batch runs alone and the decodes wait (the interference)."""

    name = Role.COLOCATED
    hands_off_after_prefill = False

    def token_budget(self, s: Scheduler) -> int:
        return s.config.max_batched_tokens

    def schedule(self, s: Scheduler) -> Batch:
        batch = Batch()
        s.schedule_prefills(batch, self.token_budget(s))
        if not batch.items:
            s.schedule_decodes(batch)
        return batch


class Chunked:
    """Sarathi-Serve / vLLM v1: decodes first, prefill chunks fill the rest of the budget."""

    name = Role.CHUNKED
    hands_off_after_prefill = False

    def token_budget(self, s: Scheduler) -> int:
        return s.config.chunk_size

    def schedule(self, s: Scheduler) -> Batch:
        batch = Batch()
        s.schedule_decodes(batch)
        s.schedule_prefills(batch, self.token_budget(s) - len(batch))
        return batch


class PrefillOnly(PrefillFirst):
    """Disaggregated prefill: the first token is sampled here, then the KV moves on."""

    name = Role.PREFILL_ONLY
    hands_off_after_prefill = True


class DecodeOnly:
    """Disaggregated decode: sequences arrive RUNNING with their KV already in this pool. A
    sequence whose KV never came (kv_transfer.on_failure=recompute) waits here and is prefilled
    alongside the decodes, chunked, as in `chunked`."""

    name = Role.DECODE_ONLY
    hands_off_after_prefill = False

    def token_budget(self, s: Scheduler) -> int:
        return s.config.max_running + s.config.max_batched_tokens

    def schedule(self, s: Scheduler) -> Batch:
        batch = Batch()
        s.schedule_decodes(batch)
        if s.waiting or any(seq.in_prefill for seq in s.running):
            s.schedule_prefills(batch, s.config.max_batched_tokens)
        return batch


POLICIES = {p.name: p for p in (PrefillFirst, Chunked, PrefillOnly, DecodeOnly)}


def make_policy(name: str):
    if name not in POLICIES:
        raise ConfigError(f"scheduler policy {name!r} is not one of {sorted(POLICIES)}")
    return POLICIES[name]()
