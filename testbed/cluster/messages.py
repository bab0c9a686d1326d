"""Control-plane messages (small, picklable). KV tensors never travel here: only their headers.

router -> worker:  Serve, Reserve, Abort, Stop
D -> P (direct):   Ready            P -> D (direct): KVPart, KVDone
worker -> router:  Started, StepEvents, Reserved, KVSent, KVArrived, Failed, Heartbeat, Audit, WorkerError
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from testbed.engine import StepRecord


@dataclass(frozen=True)
class Serve:
    """Run this request (mixed worker), or prefill it (P worker; `decode_rank` set when bound early)."""

    rid: int
    prompt: tuple[int, ...]
    max_tokens: int
    decode_rank: Optional[int] = None


@dataclass(frozen=True)
class Reserve:
    """D: allocate blocks for the prompt's KV (+ the first token's slot), then tell P it may send."""

    rid: int
    prompt: tuple[int, ...]
    max_tokens: int
    prefill_rank: int


@dataclass(frozen=True)
class Abort:
    rid: int
    reason: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    rid: int
    decode_rank: int


@dataclass(frozen=True)
class KVPart:
    """Announces the next tensor on the wire from `src`: D posts the matching irecv in this order."""

    rid: int
    part: int  # layer index, or 0 for the whole request
    shape: tuple[int, ...]
    dtype: str
    src: int


@dataclass(frozen=True)
class KVDone:
    rid: int
    first_token: int
    num_parts: int


@dataclass(frozen=True)
class Started:
    worker: int
    role: str
    device: str
    num_blocks: int
    pid: int


@dataclass(frozen=True)
class StepEvents:
    worker: int
    t: float  # end of the step, on the worker
    record: StepRecord
    scheduled: list[tuple[int, int, bool]]  # (rid, new tokens, was prefill)
    tokens: list[tuple[int, int, int]]  # (rid, output index, token id)
    finished: list[int]
    handoff: list[int]
    free_blocks: int
    num_running: int


@dataclass(frozen=True)
class Reserved:
    rid: int
    worker: int
    t: float


@dataclass(frozen=True)
class KVSent:
    rid: int
    prefill_rank: int
    decode_rank: int
    kv_bytes: int
    start: float
    end: float
    wait_s: float  # handed off -> D ready (back-pressure)


@dataclass(frozen=True)
class KVArrived:
    rid: int
    worker: int
    t: float


@dataclass(frozen=True)
class Failed:
    rid: int
    worker: int
    reason: str
    t: float
    kind: str = "error"  # kv_lost: a transfer timed out or broke; kv_recompute: D recomputes it


@dataclass(frozen=True)
class Heartbeat:
    worker: int
    t: float


@dataclass(frozen=True)
class Audit:
    worker: int
    used_blocks: int
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerError:
    worker: int
    error: str
    bad_input: bool = False  # a TestbedError: `error` is its one-line message
