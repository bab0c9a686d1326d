"""The KV hand-off ledger: what each end of a P -> D transfer holds, with no clock and no I/O.

The real connector (testbed/cluster/connector.py, receiver.py) and the simulated worker
(testbed/sim/worker.py) keep their hand-off state here, so both follow the same rules:

    P (SendLedger)                              D (ReceiveLedger)
    bind: D known at arrival (early binding)     request: a reservation joins the FCFS queue
    handoff: prefill done, KV held               admit: reserve blocks in queue order while the
      (counts against kv_transfer.max_pending)     engine has room (back-pressure)
    ready: D reserved blocks for attempt k       begin: P starts attempt k: the lease starts
      (a later k asks P to send again)           renew: a piece arrived: the lease restarts
    release: the KV left or D acknowledged it    expired: nothing arrived for the lease's length
    abort: the request ended                     retry / take / abort

Entries are created through `entry_type`, so a side with more state per attempt (the real
connector's staging buffers) extends the entry and keeps one record per request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

from testbed.engine.sequence import Sequence
from testbed.errors import StateError


@dataclass
class Outgoing:
    """P's record of one request's KV."""

    seq: Optional[Sequence]  # None while D's Ready has overtaken the request itself
    decode_rank: Optional[int] = None
    handoff_t: Optional[float] = None  # prefill done: the KV is held here
    attempt: int = 0  # the attempt D is ready for; 0 before D's first Ready
    ready_t: Optional[float] = None
    start: Optional[float] = None  # this attempt's first byte left
    skip: int = 0  # leading prompt tokens D already holds (incremental transfer): not sent

    @property
    def held(self) -> bool:
        return self.handoff_t is not None

    @property
    def sendable(self) -> bool:
        """Prefilled and D ready: the attempt may go."""
        return self.handoff_t is not None and self.ready_t is not None

    @property
    def wait_s(self) -> float:
        """Handed off -> D ready (back-pressure); a resend is ready at once."""
        if self.attempt > 1 or self.handoff_t is None or self.ready_t is None:
            return 0.0
        return max(self.ready_t - self.handoff_t, 0.0)

    def restart(self, attempt: int, decode_rank: int, now: float) -> None:
        """D is ready for `attempt`: per-attempt state starts over."""
        self.attempt, self.decode_rank, self.ready_t, self.start = attempt, decode_rank, now, None


@dataclass
class Incoming:
    """D's record of blocks reserved for a request's KV."""

    seq: Sequence
    prefill_rank: int
    reserved_t: float
    attempt: int = 1
    lease_t: Optional[float] = None  # None until P begins the attempt; renewed by every piece
    first_token: Optional[int] = None  # with the last piece: the token P sampled

    def restart(self) -> None:
        """The next attempt into the same blocks."""
        self.attempt += 1
        self.lease_t = self.first_token = None


O = TypeVar("O", bound=Outgoing)
I = TypeVar("I", bound=Incoming)  # noqa: E741 - the entry type's usual letter


class SendLedger(Generic[O]):
    """P's side: the requests whose KV it will send or holds, and the back-pressure count."""

    def __init__(self, entry_type: Callable[..., O] = Outgoing):
        self.entry_type = entry_type
        self.out: dict[int, O] = {}
        self.aborted: set[int] = set()  # ended here: a late Ready must not revive them
        self.num_held = 0

    def __contains__(self, rid: int) -> bool:
        return rid in self.out

    def get(self, rid: int) -> Optional[O]:
        return self.out.get(rid)

    def serve(self, seq: Sequence, decode_rank: Optional[int]) -> O:
        """The request reached P (again, after a re-dispatch); `decode_rank` when bound early."""
        self.aborted.discard(seq.seq_id)
        entry = self.out.setdefault(seq.seq_id, self.entry_type(seq))
        entry.seq = seq
        if decode_rank is not None:
            entry.decode_rank = decode_rank
        return entry

    def handoff(self, seq: Sequence, t: float) -> O:
        """Prefill done: the KV is held here until it has left."""
        entry = self.out.setdefault(seq.seq_id, self.entry_type(seq))
        if entry.held:
            raise StateError(f"request {seq.seq_id}: handed off twice")
        entry.seq, entry.handoff_t = seq, t
        self.num_held += 1
        return entry

    def ready(self, rid: int, decode_rank: int, attempt: int, t: float, skip: int = 0) -> Optional[O]:
        """D reserved blocks for `attempt`, holding the first `skip` prompt tokens' KV already:
        the entry, or None when the request ended here or that attempt is already under way (D
        may answer before P has read the request)."""
        if rid in self.aborted:
            return None
        entry = self.out.setdefault(rid, self.entry_type(None))
        if attempt <= entry.attempt:
            return None
        entry.restart(attempt, decode_rank, t)
        entry.skip = skip
        return entry

    def blocked(self, max_pending: int) -> bool:
        """Back-pressure: P stops stepping while this many prefilled requests hold their KV."""
        return self.num_held >= max_pending

    def release(self, rid: int) -> O:
        """The KV left (or D acknowledged it): P's copy is no longer needed."""
        entry = self.out.pop(rid)
        if entry.held:
            self.num_held -= 1
        return entry

    def abort(self, rid: int) -> Optional[O]:
        """The request ended: its entry, if P had one."""
        self.aborted.add(rid)
        return self.release(rid) if rid in self.out else None


class ReceiveLedger(Generic[I]):
    """D's side: FCFS reservations, and the transfers under way into reserved blocks."""

    def __init__(self, entry_type: Callable[..., I] = Incoming):
        self.entry_type = entry_type
        self.queued: deque[tuple[Sequence, int]] = deque()  # (sequence, prefill rank) waiting for room
        self.incoming: dict[int, I] = {}

    def __contains__(self, rid: int) -> bool:
        return rid in self.incoming

    def request(self, seq: Sequence, prefill_rank: int) -> None:
        self.queued.append((seq, prefill_rank))

    def admit(self, reserve: Callable[[Sequence], bool], t: float) -> list[I]:
        """Reserve in queue order while `reserve` (the engine's) finds room: FCFS, so a later
        small request never overtakes a waiting large one."""
        admitted = []
        while self.queued and reserve(self.queued[0][0]):
            seq, prefill_rank = self.queued.popleft()
            entry = self.incoming[seq.seq_id] = self.entry_type(seq, prefill_rank, t)
            admitted.append(entry)
        return admitted

    def current(self, rid: int, attempt: int, src: Optional[int] = None) -> Optional[I]:
        """The entry when a message belongs to its attempt under way, else None (a late piece
        of an abandoned attempt, or of an ended request)."""
        entry = self.incoming.get(rid)
        if entry is None or entry.attempt != attempt or src not in (None, entry.prefill_rank):
            return None
        return entry

    def begin(self, rid: int, attempt: int, src: Optional[int], t: float) -> Optional[I]:
        """P began the attempt: the lease starts."""
        entry = self.current(rid, attempt, src)
        if entry is not None:
            entry.lease_t = t
        return entry

    @staticmethod
    def renew(entry: I, t: float) -> None:
        entry.lease_t = t

    @staticmethod
    def expired(entry: I, t: float, lease_s: float) -> bool:
        """Begun, and nothing arrived for `lease_s`; a reservation whose prefill still queues on
        P is never timed."""
        return entry.lease_t is not None and t - entry.lease_t > lease_s

    def retry(self, rid: int) -> I:
        entry = self.incoming[rid]
        entry.restart()
        return entry

    def take(self, rid: int) -> I:
        """The transfer is over here (installed, or given up): the entry leaves the ledger."""
        return self.incoming.pop(rid)

    def abort(self, rid: int) -> Optional[I]:
        """The request ended: drop its queued reservation; its entry, if blocks were reserved."""
        if any(seq.seq_id == rid for seq, _ in self.queued):
            self.queued = deque(q for q in self.queued if q[0].seq_id != rid)
        return self.incoming.pop(rid, None)

    @property
    def num_pending(self) -> int:
        return len(self.queued) + len(self.incoming)
