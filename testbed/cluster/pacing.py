"""Pacing a real worker to an emulated device (hardware.emulate): the arithmetic, with no clock.

A paced worker runs the real model, then holds each step until the cost model's time for the
step's batch shape has passed; a prefill worker holds each KV hand-off until the modelled link
time has passed. Holding sleeps, so the CPU goes to the other workers. Callers pass `now` (or a
clock and a sleep function), so the tests drive all of it on a fake clock.

The cost model is any object with `step_time`, `prefill_context` and `transfer_time`, as
testbed.sim.cost_model.CostModel: the simulator and a paced run can share one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from testbed.control.handoff import HandoffRule
from testbed.names import KVBackend

LATE_SHARE = 0.5  # a paced step that ends this share of its modelled time after due has lost the pace


@dataclass(frozen=True)
class StepPace:
    """One step: its modelled and its real duration, the real one counted from `begin` (see
    StepPacer.pace); the step is held until `begin + modelled_s`."""

    modelled_s: float
    real_s: float
    begin: float = 0.0

    @property
    def until(self) -> float:
        return self.begin + self.modelled_s

    @property
    def sleep_s(self) -> float:
        return max(0.0, self.modelled_s - self.real_s)

    @property
    def overrun(self) -> bool:
        """The real step took longer than the modelled one: this device cannot keep the pace."""
        return self.real_s > self.modelled_s

    def late(self, end: float) -> bool:
        """Held until `end`: did the step end more than LATE_SHARE of its modelled time after it was
        due? Sleep that overshoots (a loaded host's wake-up) is time the device did not lose."""
        return end - self.until > LATE_SHARE * self.modelled_s

    def lost(self, end: float) -> bool:
        """The step lost the pace (steps.parquet `pace_overrun`): its work overran, or it ended late."""
        return self.overrun or self.late(end)


class StepPacer:
    """Modelled step time from a step record's batch shape (metrics.record.StepRecord fields)."""

    def __init__(self, model):
        self.model = model

    def modelled_s(self, record) -> float:
        chunks = record.prefill_chunks
        context = self.model.prefill_context(chunks) if chunks else 0.0
        return self.model.step_time(record.prefill_tokens, context, record.decode_seqs, record.decode_context)

    def pace(self, record, since: Optional[float] = None) -> StepPace:
        """`since`: the previous step's end, when the worker went on to this step without waiting
        for work. The modelled step holds the device's whole per-step cost (overhead_s), so the
        host's time between the steps (messages, KV arriving, reports, being off the core) counts
        against the pace too: it is absorbed where the step leaves room, and an overrun where not."""
        begin = record.start if since is None else min(since, record.start)
        return StepPace(self.modelled_s(record), record.end - begin, begin)


class LinkPacer:
    """A prefill worker's link: one transfer at a time, each `transfer_time(bytes)` long, timed by
    the connector's rule (testbed/control/handoff.py, as the simulator's link): `rule` (default:
    send), `network` (GB/s, latency s) when every hand-off crosses one (kv_transfer.link=rdma|tcp).
    `bytes_scale` turns the real KV bytes into the modelled shape's bytes."""

    def __init__(
        self,
        model,
        bytes_scale: float = 1.0,
        backend: str = KVBackend.PROCESS_GROUP,
        rule: Optional[HandoffRule] = None,
        network: Optional[tuple[float, float]] = None,
    ):
        self.model, self.bytes_scale, self.backend = model, bytes_scale, backend
        self.rule, self.network = rule or HandoffRule(), network
        self.free_at = -math.inf
        self.begin: dict[tuple[int, float], float] = {}  # (request, start) -> when the link is free for it
        self.due: dict[tuple[int, float], float] = {}  # (request, start) -> when the KV may arrive
        self.prefill_s: dict[int, float] = {}  # request -> its last prefill step's modelled time (a push overlaps it)

    def link_s(self, modelled_bytes: float) -> float:
        if self.network is not None:
            gbps, latency_s = self.network
            return latency_s + modelled_bytes / (gbps * 1e9)
        return self.model.transfer_time(modelled_bytes, self.backend)

    def modelled_s(self, nbytes: int, tokens: int = 0) -> float:
        """send, pull: how long `nbytes` real bytes of `tokens` tokens hold the link."""
        return self.rule.busy_s(self.link_s, nbytes * self.bytes_scale, tokens)

    def prefilled(self, rid: int, modelled_s: float) -> None:
        """The request's prefill ended with a paced step this long (push_layerwise overlaps it)."""
        if self.rule.layerwise:
            self.prefill_s[rid] = modelled_s

    def arrived(
        self,
        rid: int,
        start: float,
        nbytes: int,
        now: float,
        tokens: int = 0,
        handoff_t: Optional[float] = None,
        ready_t: Optional[float] = None,
    ) -> bool:
        """May this transfer (all of its bytes posted, the first at `start`; the prefill ended at
        `handoff_t`, D ready at `ready_t`) complete at `now`? The first call books it on the link;
        keyed by start too, so a re-dispatched request books anew."""
        key = (rid, start)
        if self.rule.layerwise and handoff_t is not None:
            since = self.begin.setdefault(key, max(self.free_at, start if ready_t is None else ready_t))
            prefill_s, modelled = self.prefill_s.get(rid, 0.0), nbytes * self.bytes_scale
            end = handoff_t + self.rule.leg(self.link_s, modelled, tokens, prefill_s, since - handoff_t).end
        else:
            # from the bytes posted so far: a later call may know of more
            end = self.begin.setdefault(key, max(start, self.free_at)) + self.modelled_s(nbytes, tokens)
        self.free_at = max(self.free_at, end)
        due = self.due[key] = end + self.rule.first_token_path_s  # D's own path after the KV landed
        if now < due:
            return False
        del self.due[key], self.begin[key]
        self.prefill_s.pop(rid, None)
        return True

    def next_due(self, now: float) -> Optional[float]:
        """The earliest booked completion still ahead of `now` (a worker wakes for it)."""
        ahead = [due for due in self.due.values() if due > now]
        return min(ahead) if ahead else None


def hold(
    until: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    poll: Callable[[], None] = lambda: None,
    wake: Callable[[float], Optional[float]] = lambda now: None,
) -> None:
    """Sleep until `until`, waking at each `wake(now)` time on the way to `poll` (the KV link
    keeps running while a paced step holds the worker). Loops because a sleep may end early; no
    poll once `until` has come, so host work (a KV copy) never lengthens the step it follows: it
    falls in the next step's cycle, where the pace absorbs it or marks it."""
    while (now := clock()) < until:
        early = wake(now)
        sleep((until if early is None else min(until, early)) - now)
        if clock() < until:
            poll()


def pace_summary(steps) -> Optional[dict]:
    """Steps that kept the modelled pace and those that overran it; None when nothing was paced."""
    if steps is None or "modelled_s" not in steps.columns or not steps["modelled_s"].notna().any():
        return None
    paced = steps[steps["modelled_s"].notna()]
    real = paced[["schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s"]].sum(axis=1)
    overruns = int(paced["pace_overrun"].sum())
    return {
        "steps": int(len(paced)),
        "overrun_steps": overruns,
        "overrun_share": overruns / len(paced),
        "modelled_s_mean": float(paced["modelled_s"].mean()),
        "real_s_mean": float(real.mean()),
    }
