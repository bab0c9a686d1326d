"""Asynchronous scheduling: the engine's host work for step n+1 runs while the GPU runs step n.

vLLM V1 with async scheduling (and SGLang's overlap scheduler) schedules, prepares inputs and
processes the previous step's outputs on the CPU while the GPU executes, so a step costs the longer
of the two, not their sum:

    step = max(host, gpu),   host = fixed + per_seq x sampled,   gpu = every kernel term

against `host + gpu` for a synchronous engine (RooflineModel). Eager launches stay on the GPU side
(the GPU idles between them either way). A step whose host work is the longer one still waits
for it: at a large batch the per-sequence term shows again.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.perf.roofline import RooflineModel

HOST_TERMS = ("overhead", "host_per_seq")


def overlapped(parts: dict[str, float]) -> float:
    """A step's time from its components (RooflineModel.breakdown) when host and GPU overlap."""
    host = sum(parts[k] for k in HOST_TERMS)
    return max(host, sum(v for k, v in parts.items() if k not in HOST_TERMS))


@dataclass(frozen=True)
class AsyncRoofline(RooflineModel):
    """The roofline of an engine that overlaps its host work with the GPU step (`overlapped`)."""

    def step_time(self, prefill_tokens: int, prefill_context: float, decode_seqs: int, decode_context: int) -> float:
        return overlapped(self.breakdown(prefill_tokens, prefill_context, decode_seqs, decode_context))

    def combine(self, parts: dict[str, float]) -> float:
        return overlapped(parts)

    def host_terms(self) -> dict:
        return {**super().host_terms(), "async_scheduling": True}
