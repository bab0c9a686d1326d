"""The decode side of the KV connector (protocol: testbed/cluster/connector.py).

D reserves blocks for a request's KV (queueing the reservation while its pool or its running
limit is full: back-pressure), receives the parts P sends into staging buffers, writes them into
the blocks and hands the sequence to its decode scheduler.

The transfer timer is a lease: it starts when P begins an attempt (KVBegin) and every header or
piece that arrives renews it. A reservation made at arrival (kv_transfer.decode_binding=early) is not
timed while the prefill waits in P's queue. An attempt whose lease runs out, or whose wire
breaks, ends as the failure policy says: `retry` asks P to send again (a Ready with the next
attempt number, into the same blocks), `recompute` prefills here, `fail` fails the request.

With kv_transfer.backend=ipc P writes into the reserved blocks itself (Ready names them), so a
request ended here after its Ready left keeps its blocks until P says it will not write (KVFence)
or has written (KVDone): a freed block handed to another request must never take a late write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.kv_wire import Retired, receive_part, unpack_arrived
from testbed.cluster.tensor_group import Confirm, Groups, Mirror, RecvShare
from testbed.control.config import KVTransferConfig
from testbed.control.ledger import Incoming, ReceiveLedger
from testbed.engine import Engine, Sequence
from testbed.names import OnFailure
from testbed.net.messages import (
    Failed,
    KVAck,
    KVArrived,
    KVAttemptFailed,
    KVBegin,
    KVDone,
    KVFence,
    KVPart,
    Ready,
    Reserve,
    Reserved,
)


@dataclass
class WireIncoming(Incoming):
    """The ledger's entry plus this attempt's receives."""

    recvs: list = field(default_factory=list)  # (layer or None for the whole request, WirePart)
    pieces: int = 0  # pieces written into the blocks so far in this attempt
    num_parts: int | None = None
    headers: int = 0  # parts announced (a tensor-parallel part may come as several wires)

    def restart(self) -> None:
        super().restart()
        self.recvs, self.pieces, self.num_parts, self.headers = [], 0, None, 0

    @property
    def parts(self) -> list:
        return [wire for _, wire in self.recvs]


class KVReceiver:
    """The D side: reserve blocks (or queue the reservation), receive, hand to decode."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        inboxes,
        events,
        kv: KVTransferConfig,
        clock: Callable[[], float] = time.perf_counter,
        groups: Optional[Groups] = None,
    ):
        self.engine, self.rank, self.inboxes, self.events, self.kv = engine, rank, inboxes, events, kv
        self.groups = groups  # tensor-parallel workers: each rank receives its own pieces (tensor_group.py)
        self.bytes_moved = 0  # this process's KV taken off the wire into its blocks
        self.timeout_s, self.policy, self.clock = kv.timeout_s, kv.failure_policy(), clock
        self.piece_bytes = kv.piece_bytes
        self.completions = CompletionTracker(kv.timeout_s)
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
        self.retired = Retired(self.buffers)  # parts of abandoned attempts and of unknown requests
        self.ledger: ReceiveLedger[WireIncoming] = ReceiveLedger(WireIncoming)
        self.share_prefix = kv.incremental  # reserve onto cached blocks, receive only the rest
        self.direct = kv.direct  # kv_transfer.backend=ipc: P writes into the blocks Ready names
        self.kept: set[int] = set()  # ended requests whose blocks P may still write (ipc)

    @property
    def incoming(self) -> dict[int, WireIncoming]:
        return self.ledger.incoming

    @property
    def busy(self) -> bool:
        return self.ledger.num_pending > 0

    def reserve(self, msg: Reserve) -> None:
        self.ledger.request(Sequence(msg.rid, list(msg.prompt), msg.max_tokens), msg.prefill_rank)
        self._admit()

    def _admit(self) -> None:
        for entry in self.ledger.admit(lambda seq: self.engine.reserve(seq, self.share_prefix), self.clock()):
            rid = entry.seq.seq_id
            self.events.put(Reserved(rid, self.rank, entry.reserved_t))
            self.inboxes[entry.prefill_rank].put(self._ready(entry.seq, 1))

    def _ready(self, seq: Sequence, attempt: int) -> Ready:
        skip = seq.num_cached_tokens
        blocks = tuple(seq.block_table[skip // self.engine.runner.block_size :]) if self.direct else ()
        return Ready(seq.seq_id, self.rank, attempt, skip, blocks)

    def on_begin(self, msg: KVBegin) -> None:
        self.ledger.begin(msg.rid, msg.attempt, msg.src, self.clock())

    def on_part(self, msg: KVPart) -> None:
        assert msg.dtype == str(self.engine.runner.dtype).removeprefix("torch."), "P and D pools differ in dtype"
        # every header gets its receives, even a stale one: later parts stay in step with P's sends
        wires = [
            receive_part(shape, src, self.buffers, self.completions, self.piece_bytes, heads)
            for src, shape, heads in self._pieces(msg)
        ]
        entry = self.ledger.current(msg.rid, msg.attempt, msg.src)
        layer = msg.part if len(msg.shape) == 4 else None  # a layer part is 4-d
        if isinstance(self.engine, Mirror):  # the group's other ranks receive their pieces too
            table, start = (tuple(entry.seq.block_table), entry.seq.num_cached_tokens) if entry else ((), 0)
            num_tokens = msg.shape[-3]
            self.engine.tell(RecvShare(msg.rid, msg.attempt, msg.src, table, num_tokens, start, layer, entry is None))
        if entry is None:
            self.retired.add(wires)
            return
        entry.recvs.extend((layer, wire) for wire in wires)
        entry.headers += 1
        self.ledger.renew(entry, self.clock())

    def _pieces(self, msg: KVPart) -> list[tuple[int, tuple, Optional[slice]]]:
        """(process rank, shape, heads of this pool) of each piece of a part this process receives."""
        if self.groups is None:
            return [(msg.src, msg.shape, None)]
        return self.groups.receives(msg.src, self.rank, 0, msg.shape)

    def on_done(self, msg: KVDone) -> None:
        entry = self.ledger.current(msg.rid, msg.attempt, msg.src)
        if entry is not None:
            entry.first_token, entry.num_parts = msg.first_token, msg.num_parts
        elif msg.rid in self.kept:  # P's write into the blocks of an ended request is over
            self._free_kept(msg.rid)

    def on_fence(self, msg: KVFence) -> None:
        if msg.rid in self.kept:
            self._free_kept(msg.rid)

    def _free_kept(self, rid: int) -> None:
        self.kept.discard(rid)
        self.engine.abort(rid)

    def close(self) -> None:
        """End of the run: no P writes any more; blocks kept back go back to the pool."""
        for rid in list(self.kept):
            self._free_kept(rid)

    def poll(self) -> None:
        self._admit()
        self.retired.poll()
        now = self.clock()
        for rid, entry in list(self.ledger.incoming.items()):
            error = next((wire.error() for wire in entry.parts if wire.error()), None)
            if error:
                self._attempt_failed(
                    rid, entry, "error", f"KV transfer from worker {entry.prefill_rank} broke: {error}", now
                )
                continue
            unpacked = [
                unpack_arrived(self.engine.runner, entry.seq.block_table, wire, layer, entry.seq.num_cached_tokens)
                for layer, wire in entry.recvs
            ]
            pieces = sum(wire.unpacked for wire in entry.parts)
            if pieces > entry.pieces:
                entry.pieces = pieces
                self.ledger.renew(entry, now)
            if entry.num_parts is not None and entry.headers == entry.num_parts and all(unpacked):
                if not self._every_rank_has(rid):
                    reason = "KV transfer broke: a tensor-parallel rank's share did not arrive"
                    self._attempt_failed(rid, entry, "error", reason, now)
                    continue
                self._install(rid, self.clock())  # after the unpacking: when the KV is really there
            elif self.ledger.expired(entry, now, self.timeout_s):
                self._attempt_failed(
                    rid, entry, "timed_out", f"KV transfer timed out: nothing arrived for {self.timeout_s:g} s", now
                )

    def _every_rank_has(self, rid: int) -> bool:
        """A tensor-parallel worker's ranks each hold their share of `rid` (they agree at once: a
        rank whose peer died mid-transfer says no, and the attempt fails on every rank alike)."""
        return self.engine.agree(Confirm(rid)) if isinstance(self.engine, Mirror) else True

    def _install(self, rid: int, now: float) -> None:
        entry = self.ledger.take(rid)
        for wire in entry.parts:
            self.bytes_moved += wire.nbytes
            self.buffers.put(wire.buffer)
        self.engine.install(rid, entry.first_token)
        self.events.put(KVArrived(rid, self.rank, now, entry.attempt, entry.prefill_rank))
        if self.policy.holds_until_ack:
            self.inboxes[entry.prefill_rank].put(KVAck(rid, entry.attempt, installed=True))

    def _attempt_failed(self, rid: int, entry: WireIncoming, outcome: str, reason: str, now: float) -> None:
        attempt = entry.attempt
        self.events.put(KVAttemptFailed(rid, self.rank, entry.prefill_rank, attempt, outcome, now, reason))
        action = self.policy.after(attempt)
        if action == OnFailure.RETRY:
            self.retired.add(entry.parts)
            self.ledger.retry(rid)
            self.inboxes[entry.prefill_rank].put(self._ready(entry.seq, entry.attempt))
            return
        self.ledger.take(rid)
        self.retired.add(entry.parts)
        if self.policy.holds_until_ack:
            self.inboxes[entry.prefill_rank].put(KVAck(rid, attempt, installed=False))
        if action == OnFailure.RECOMPUTE:
            self.engine.recompute(rid, entry.first_token)
            self.events.put(Failed(rid, self.rank, f"{reason}: recomputing on the decode worker", now, "kv_recompute"))
        else:
            self.engine.abort(rid)
            self.events.put(Failed(rid, self.rank, reason, now, "kv_broken" if outcome == "error" else "kv_lost"))

    def abort(self, rid: int) -> bool:
        """The router ended the request; True when this side had it (its blocks are then freed
        here, or kept until P's fence under ipc)."""
        entry = self.ledger.abort(rid)
        if entry is None:
            return False
        self.retired.add(entry.parts)
        if self.direct:
            self.kept.add(rid)
        else:
            self.engine.abort(rid)
        return True

    @property
    def in_flight(self) -> bool:
        """Staging buffers still on the wire."""
        return bool(self.retired.parts) or any(entry.recvs for entry in self.ledger.incoming.values())
