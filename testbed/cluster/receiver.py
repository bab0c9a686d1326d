"""The decode side of the KV connector (protocol: testbed/cluster/connector.py).

D reserves blocks for a request's KV (queueing the reservation while its pool or its running
limit is full: back-pressure), receives the parts P sends into staging buffers, writes them into
the blocks and hands the sequence to its decode scheduler.

The transfer timer is a lease: it starts when P begins an attempt (KVBegin) and every header or
piece that arrives renews it. A reservation made at arrival (kv_transfer.binding=early) is not
timed while the prefill waits in P's queue. An attempt whose lease runs out, or whose wire
breaks, ends as the failure policy says: `retry` asks P to send again (a Ready with the next
attempt number, into the same blocks), `recompute` prefills here, `fail` fails the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.config import KVFailurePolicy
from testbed.cluster.kv_wire import Retired, receive_part, unpack_arrived
from testbed.cluster.messages import (Failed, KVAck, KVArrived, KVAttemptFailed, KVBegin, KVDone, KVPart, Ready,
                                      Reserve, Reserved)
from testbed.engine import Engine, Sequence, SequenceStatus


@dataclass
class Incoming:
    seq: Sequence
    prefill_rank: int
    attempt: int = 1
    lease_t: Optional[float] = None  # None until P begins the attempt; renewed by every piece
    recvs: list = field(default_factory=list)  # (layer or None for the whole request, WirePart)
    pieces: int = 0  # pieces written into the blocks so far in this attempt
    first_token: Optional[int] = None
    num_parts: Optional[int] = None

    def restart(self) -> list:
        """The next attempt into the same blocks; returns the abandoned attempt's parts."""
        parts = [wire for _, wire in self.recvs]
        self.attempt += 1
        self.lease_t, self.recvs, self.pieces, self.first_token, self.num_parts = None, [], 0, None, None
        return parts


class KVReceiver:
    """The D side: reserve blocks (or queue the reservation), receive, hand to decode."""

    def __init__(self, engine: Engine, rank: int, inboxes, events, timeout_s: float, policy: KVFailurePolicy,
                 piece_bytes: int, clock: Callable[[], float] = time.perf_counter):
        self.engine, self.rank, self.inboxes, self.events = engine, rank, inboxes, events
        self.timeout_s, self.policy, self.piece_bytes, self.clock = timeout_s, policy, piece_bytes, clock
        self.completions = CompletionTracker(timeout_s)
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
        self.retired = Retired(self.buffers)  # parts of abandoned attempts and of unknown requests
        self.queued: list[Reserve] = []
        self.incoming: dict[int, Incoming] = {}

    def reserve(self, msg: Reserve) -> None:
        self.queued.append(msg)
        self._admit()

    def _admit(self) -> None:
        bm, limit = self.engine.block_manager, self.engine.scheduler.config.max_running
        while self.queued:
            msg = self.queued[0]
            seq = Sequence(msg.rid, list(msg.prompt), msg.max_tokens)
            busy = len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting) + len(self.incoming)
            if busy >= limit or not bm.can_allocate(seq, seq.num_tokens + 1):
                return  # FCFS: wait for decodes to finish
            self.queued.pop(0)
            bm.allocate(seq, seq.num_tokens + 1)  # the prompt's KV and the first token's slot
            seq.status = SequenceStatus.TRANSFERRING
            self.incoming[msg.rid] = Incoming(seq, msg.prefill_rank)
            self.events.put(Reserved(msg.rid, self.rank, self.clock()))
            self.inboxes[msg.prefill_rank].put(Ready(msg.rid, self.rank, 1))

    def _current(self, rid: int, attempt: int, src: Optional[int]) -> Optional[Incoming]:
        """The request's entry if the message belongs to its attempt under way, else None."""
        entry = self.incoming.get(rid)
        if entry is None or entry.attempt != attempt or src not in (None, entry.prefill_rank):
            return None
        return entry

    def on_begin(self, msg: KVBegin) -> None:
        entry = self._current(msg.rid, msg.attempt, msg.src)
        if entry is not None:
            entry.lease_t = self.clock()

    def on_part(self, msg: KVPart) -> None:
        assert msg.dtype == str(self.engine.runner.dtype).removeprefix("torch."), "P and D pools differ in dtype"
        # every header gets its receive, even a stale one: later parts stay in step with P's sends
        wire = receive_part(msg.shape, msg.src, self.buffers, self.completions, self.piece_bytes)
        entry = self._current(msg.rid, msg.attempt, msg.src)
        if entry is None:
            self.retired.add([wire])
            return
        entry.recvs.append((msg.part if len(msg.shape) == 4 else None, wire))  # a layer part is 4-d
        entry.lease_t = self.clock()

    def on_done(self, msg: KVDone) -> None:
        entry = self._current(msg.rid, msg.attempt, msg.src)
        if entry is not None:
            entry.first_token, entry.num_parts = msg.first_token, msg.num_parts

    def poll(self) -> None:
        self._admit()
        self.retired.poll()
        now = self.clock()
        for rid, entry in list(self.incoming.items()):
            error = next((wire.error() for _, wire in entry.recvs if wire.error()), None)
            if error:
                self._attempt_failed(rid, entry, "error", f"KV transfer from worker {entry.prefill_rank} broke: "
                                                          f"{error}", now)
                continue
            unpacked = [unpack_arrived(self.engine.runner, entry.seq.block_table, wire, layer)
                        for layer, wire in entry.recvs]
            pieces = sum(wire.unpacked for _, wire in entry.recvs)
            if pieces > entry.pieces:
                entry.pieces, entry.lease_t = pieces, now
            if entry.num_parts is not None and len(entry.recvs) == entry.num_parts and all(unpacked):
                self._install(rid, entry, self.clock())  # after the unpacking: when the KV is really there
            elif entry.lease_t is not None and now - entry.lease_t > self.timeout_s:
                self._attempt_failed(rid, entry, "timed_out", f"KV transfer timed out: nothing arrived for "
                                                              f"{self.timeout_s:g} s", now)

    def _install(self, rid: int, entry: Incoming, now: float) -> None:
        del self.incoming[rid]
        seq = entry.seq
        for _, wire in entry.recvs:
            self.buffers.put(wire.buffer)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(entry.first_token)
        self.engine.scheduler.add_running(seq)
        self.events.put(KVArrived(rid, self.rank, now, entry.attempt, entry.prefill_rank))
        if self.policy.holds_until_ack:
            self.inboxes[entry.prefill_rank].put(KVAck(rid, entry.attempt, installed=True))

    def _attempt_failed(self, rid: int, entry: Incoming, outcome: str, reason: str, now: float) -> None:
        attempt = entry.attempt
        self.events.put(KVAttemptFailed(rid, self.rank, entry.prefill_rank, attempt, outcome, now, reason))
        action = self.policy.after(attempt)
        if action == "retry":
            self.retired.add(entry.restart())
            self.inboxes[entry.prefill_rank].put(Ready(rid, self.rank, entry.attempt))
            return
        del self.incoming[rid]
        self.retired.add([wire for _, wire in entry.recvs])
        self.engine.release(entry.seq)
        if self.policy.holds_until_ack:
            self.inboxes[entry.prefill_rank].put(KVAck(rid, attempt, installed=False))
        if action == "recompute":
            self._recompute(entry, reason, now)
        else:
            entry.seq.status = SequenceStatus.FAILED
            self.events.put(Failed(rid, self.rank, reason, now, "kv_broken" if outcome == "error" else "kv_lost"))

    def _recompute(self, entry: Incoming, reason: str, now: float) -> None:
        seq = entry.seq
        if entry.first_token is not None:
            seq.append_token(entry.first_token)
        seq.reset_for_recompute()
        self.engine.scheduler.add(seq)
        self.events.put(Failed(seq.seq_id, self.rank, f"{reason}: recomputing on the decode worker", now,
                               "kv_recompute"))

    def abort(self, rid: int) -> None:
        self.queued = [m for m in self.queued if m.rid != rid]
        entry = self.incoming.pop(rid, None)
        if entry is not None:
            self.retired.add([wire for _, wire in entry.recvs])
            self.engine.release(entry.seq)

    @property
    def in_flight(self) -> bool:
        """Staging buffers still on the wire."""
        return bool(self.retired.parts) or any(entry.recvs for entry in self.incoming.values())
