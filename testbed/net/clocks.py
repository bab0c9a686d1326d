"""Worker times on rank 0's clock. Every worker stamps its reports with its own host's monotonic
clock; on another host that clock has another origin, so rank 0 measures each rank's offset once
(pings over the message link, the round trip with the least delay wins, as NTP does) and rebases
the worker-stamped fields of its reports before anything reads them. TTFT, TPOT and ITL use
rank 0's receipt times and need none of this; queueing, KV transfer times and the step table do.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from testbed.net.faults import FaultInjected
from testbed.net.messages import Failed, Heartbeat, KVArrived, KVAttemptFailed, KVSent, Reserved, StepEvents

# the fields each report stamps on its sender's clock (StepEvents' record: its start and end)
TIME_FIELDS = {
    StepEvents: ("t", "sent"),
    KVSent: ("start", "end"),
    KVArrived: ("t",),
    KVAttemptFailed: ("t",),
    Failed: ("t",),
    Heartbeat: ("t",),
    Reserved: ("t",),
    FaultInjected: ("t",),
}


class Offset(NamedTuple):
    seconds: float  # worker clock - rank 0's clock
    rtt_s: float  # the round trip it was measured on: the offset is good to half of it


def estimate(samples: list[tuple[float, float, float]]) -> Offset:
    """(rank 0 sent, worker stamped, rank 0 received) per ping -> the offset of the quickest round trip."""
    sent, stamped, received = min(samples, key=lambda s: s[2] - s[0])
    return Offset(stamped - (sent + received) / 2, received - sent)


def sender(msg) -> int | None:
    """The rank whose clock stamped the report (P's for a KV send)."""
    return msg.prefill_rank if isinstance(msg, KVSent) else getattr(msg, "worker", None)


def rebase(msg, offset: float):
    """The report with its worker-stamped times on rank 0's clock."""
    fields = TIME_FIELDS.get(type(msg))
    if not fields or not offset:
        return msg
    changes = {name: getattr(msg, name) - offset for name in fields}
    if isinstance(msg, StepEvents):
        changes["record"] = msg.record._replace(start=msg.record.start - offset, end=msg.record.end - offset)
    return dataclasses.replace(msg, **changes)
