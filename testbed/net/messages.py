"""The messages between processes (small, picklable): what the control plane's decisions and the
workers' reports travel as. KV tensors never travel here: only their headers.

router -> worker:  Serve, Reserve, Abort, Stop, Ping (clock offsets across hosts)
D -> P (direct):   Ready, KVAck     P -> D (direct): KVBegin, KVPart, KVDone
worker -> router:  Started, StepEvents, Reserved, KVSent, KVArrived, KVAttemptFailed, Failed, Heartbeat, Pong,
                   Audit, WorkerError

A request's KV may take several attempts (kv_transfer.on_failure=retry): every P -> D message and
every report about a transfer names its attempt, so a late piece of an abandoned attempt is
told apart from the current one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from testbed.engine.scheduler import StepReport
from testbed.metrics.record import StepRecord


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
    """D has blocks for the KV: P may send attempt `attempt` (a higher one asks P to resend)."""

    rid: int
    decode_rank: int
    attempt: int = 1
    skip: int = 0  # leading prompt tokens whose KV D holds already (incremental): P sends the rest
    blocks: tuple = ()  # kv_transfer.backend=ipc: D's blocks from token `skip` on, which P writes into


@dataclass(frozen=True)
class KVBegin:
    """P starts sending an attempt: D's lease on the transfer starts here, not at reservation."""

    rid: int
    attempt: int
    src: int


@dataclass(frozen=True)
class KVAck:
    """D is done with P's copy of the KV (installed, or given up for good): P frees its blocks.
    Sent only where P holds the KV until D answers (kv_transfer.on_failure=retry)."""

    rid: int
    attempt: int
    installed: bool


@dataclass(frozen=True)
class KVPoolExport:
    """kv_transfer.backend=ipc, D -> every P at start: how to map D's KV pool (testbed/cluster/kv_ipc.py)."""

    src: int
    handle: object  # kv_ipc.PoolHandle


@dataclass(frozen=True)
class KVPoolAttached:
    """P -> D: P has mapped D's pool (once every P has, D removes the shared-memory file)."""

    src: int


@dataclass(frozen=True)
class KVFence:
    """ipc, P -> D: P will not write into the blocks D reserved for `rid` (it ended here, or the
    Ready came after it did): D may free blocks it kept back for that reason."""

    rid: int


@dataclass(frozen=True)
class KVPart:
    """Announces the next tensor on the wire from `src`: D posts the matching irecv in this order."""

    rid: int
    part: int  # layer index, or 0 for the whole request
    shape: tuple[int, ...]
    dtype: str
    src: int
    attempt: int = 1


@dataclass(frozen=True)
class KVDone:
    rid: int
    first_token: int
    num_parts: int
    attempt: int = 1
    src: Optional[int] = None


@dataclass(frozen=True, kw_only=True)  # eight fields: built by name
class Started:
    worker: int
    role: str
    device: str
    num_blocks: int
    pid: int
    host: str = ""
    node: int = 0
    attention_backend: str = ""  # the backend the engine actually runs (engine.attention_backend=auto picks)


@dataclass(frozen=True)
class StepEvents:
    worker: int
    t: float  # end of the step, on the worker
    record: StepRecord
    report: StepReport  # the step by request id: scheduled, tokens, finished, handed off, prefix hits
    free_blocks: int
    num_running: int
    cached: tuple = ((), ())  # prefix-cache block hashes (registered, evicted) since the last report
    sent: float = 0.0  # when the worker had built this report and was about to send it


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
    wait_s: float  # handed off -> D ready (back-pressure); 0 for a resend
    attempt: int = 1
    dropped: bool = False  # fault injection: this attempt's data was lost
    error: str = ""  # a send that broke (the peer is gone): D's side decides what follows


@dataclass(frozen=True)
class KVArrived:
    rid: int
    worker: int
    t: float
    attempt: int = 1
    prefill_rank: Optional[int] = None


@dataclass(frozen=True)
class KVAttemptFailed:
    """D gave up one attempt: its lease ran out (`timed_out`) or the wire broke (`error`)."""

    rid: int
    worker: int
    prefill_rank: int
    attempt: int
    outcome: str
    t: float
    reason: str


@dataclass(frozen=True)
class Failed:
    rid: int
    worker: int
    reason: str
    t: float
    # kv_lost: a transfer timed out; kv_broken: its wire broke (the peer is gone, so the router
    # treats it as that worker's loss); kv_recompute: D recomputes it
    kind: str = "error"


@dataclass(frozen=True)
class Ping:
    """router -> worker (under torchrun): answer with the time on your clock."""

    t: float  # rank 0's clock when sent


@dataclass(frozen=True)
class Pong:
    worker: int
    sent: float  # the Ping's t, echoed
    t: float  # the worker's clock when it read the Ping


@dataclass(frozen=True)
class Heartbeat:
    worker: int
    t: float


@dataclass(frozen=True)
class Audit:
    """End of run: what the worker still holds (all zero when nothing leaked)."""

    worker: int
    used_blocks: int
    loaned_buffers: int = 0  # KV staging buffers not back in their pool
    loaned_bytes: int = 0
    cached_blocks: int = 0  # free blocks kept for their prefix (a cache, not a leak)
    store: dict = field(default_factory=dict)  # its traffic with the shared KV store (StoreStats)
    kv_bytes_sent: int = 0  # KV this process put on the wire, and took off it into its blocks
    kv_bytes_received: int = 0


@dataclass(frozen=True)
class WorkerError:
    worker: int
    error: str
    bad_input: bool = False  # a TestbedError: `error` is its one-line message
