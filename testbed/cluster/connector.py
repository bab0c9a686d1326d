"""KV connector: a prefill worker pushes a request's KV into blocks a decode worker reserved.

Handshake (control plane), then data (torch.distributed point-to-point, gloo or NCCL):

    P: prefill done -> KV held (bounded queue)      D: Reserve -> allocate blocks -> Ready to P
    P: on Ready: KVPart header to D, isend(buffer)   D: on KVPart: irecv(buffer) in header order
    P: send complete -> free blocks, KVDone to D     D: all parts + KVDone -> write blocks -> decode

Headers travel on D's inbox from a single producer (P), so D posts its receives in exactly the
order P posts its sends: that is what NCCL, which has no tags, needs. One contiguous buffer
per request (granularity=request) or per layer (granularity=layer, streamed during the prefill
when D is already bound and ready).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional


from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.faults import FaultInjected, KVFaults
from testbed.cluster.kv_wire import WirePart, receive_part, send_part, unpack_arrived
from testbed.cluster.messages import Failed, KVArrived, KVDone, KVPart, KVSent, Ready, Reserve, Reserved
from testbed.engine import Engine, Sequence, SequenceStatus


@dataclass
class Outgoing:
    seq: Optional[Sequence]  # None while a Ready from D has overtaken the request itself
    handoff_t: Optional[float] = None  # KV complete on P (prefill finished)
    decode_rank: Optional[int] = None
    ready_t: Optional[float] = None
    sent_parts: set = field(default_factory=set)
    parts: list[WirePart] = field(default_factory=list)  # buffers live until sent
    start: Optional[float] = None
    kv_bytes: int = 0
    dropped: bool = False  # fault injection: this KV never leaves
    done_sent: bool = False


class KVSender:
    """The P side. Blocks are freed only once every part has left."""

    def __init__(self, engine: Engine, rank: int, inboxes, events, granularity: str, timeout_s: float,
                 piece_bytes: int, faults: KVFaults):
        self.engine, self.rank, self.inboxes, self.events = engine, rank, inboxes, events
        self.granularity, self.timeout_s, self.piece_bytes = granularity, timeout_s, piece_bytes
        self.faults = faults
        self.out: dict[int, Outgoing] = {}
        self.aborted: set[int] = set()
        self.completions = CompletionTracker(timeout_s)
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
        self.link = None  # an emulated device's link (testbed/cluster/pacing.py LinkPacer), set by the worker

    @property
    def num_parts(self) -> int:
        return self.engine.args.num_layers if self.granularity == "layer" else 1

    def bind(self, seq: Sequence, decode_rank: Optional[int]) -> None:
        entry = self.out.setdefault(seq.seq_id, Outgoing(seq))
        entry.seq, entry.decode_rank = seq, decode_rank

    def handoff(self, seq: Sequence, t: float) -> None:
        entry = self.out.setdefault(seq.seq_id, Outgoing(seq))
        entry.handoff_t = t
        self._try_send(entry)

    def ready(self, msg: Ready) -> None:
        if msg.rid in self.aborted:
            return
        # D may answer before this worker has read the request itself (two queues, no order)
        entry = self.out.setdefault(msg.rid, Outgoing(None))
        entry.decode_rank, entry.ready_t = msg.decode_rank, time.perf_counter()
        if self.faults.drop():
            entry.dropped = True
            self.events.put(FaultInjected(self.rank, "drop_kv", msg.rid, entry.ready_t))
        self._try_send(entry)

    @property
    def num_waiting(self) -> int:
        """Prefilled requests whose KV still occupies this worker's pool."""
        return sum(1 for e in self.out.values() if e.handoff_t is not None)

    def stream_layer(self, layer: int, finishing: list[Sequence]) -> None:
        """Called after `layer` of a step's forward: that layer's KV of these sequences is final."""
        for seq in finishing:
            entry = self.out.get(seq.seq_id)
            if entry is not None and self._may_send(entry) and layer not in entry.sent_parts:
                self._send_part(entry, layer)

    def _may_send(self, entry: Outgoing) -> bool:
        if entry.ready_t is None or entry.dropped:
            return False
        return time.perf_counter() >= entry.ready_t + self.faults.delay_s

    def _try_send(self, entry: Outgoing) -> None:
        if entry.handoff_t is None or entry.done_sent or not self._may_send(entry):
            return
        for part in range(self.num_parts):
            if part not in entry.sent_parts:
                self._send_part(entry, part)
        if self.link is not None and not self.link.arrived(entry.seq.seq_id, entry.start, entry.kv_bytes,
                                                           time.perf_counter()):
            return  # emulated link: D may not install the KV (nor P free it) before its modelled time
        self.inboxes[entry.decode_rank].put(KVDone(entry.seq.seq_id, entry.seq.token_ids[-1], self.num_parts))
        entry.done_sent = True

    def _send_part(self, entry: Outgoing, part: int) -> None:
        seq = entry.seq
        layer = part if self.granularity == "layer" else None
        runner = self.engine.runner
        entry.start = entry.start or time.perf_counter()
        shape = runner.kv_shape(seq.num_prompt_tokens, layer)
        self.inboxes[entry.decode_rank].put(KVPart(seq.seq_id, part, shape, str(runner.dtype).removeprefix("torch."),
                                                   self.rank))
        wire = send_part(runner, seq.block_table, seq.num_prompt_tokens, layer, entry.decode_rank, self.buffers,
                         self.completions, self.piece_bytes)
        entry.parts.append(wire)
        entry.sent_parts.add(part)
        entry.kv_bytes += wire.nbytes

    def poll(self) -> None:
        now = time.perf_counter()
        for rid, entry in list(self.out.items()):
            self._try_send(entry)  # a delayed send whose time has come
            if entry.done_sent and all(wire.sent() for wire in entry.parts):
                error = next((wire.error() for wire in entry.parts if wire.error()), None)
                if error:
                    self.abort(rid, f"KV send failed: {error}", now, kind="kv_lost")
                else:
                    self._done(rid, entry, now)
            elif entry.handoff_t is not None and now - entry.handoff_t > self.timeout_s:
                self.abort(rid, f"KV transfer timed out after {self.timeout_s:.0f} s", now, kind="kv_lost")

    def _done(self, rid: int, entry: Outgoing, now: float) -> None:
        del self.out[rid]
        for wire in entry.parts:
            self.buffers.put(wire.buffer)
        self.engine.release(entry.seq)
        entry.seq.status = SequenceStatus.FINISHED
        wait = (entry.ready_t - entry.handoff_t) if entry.ready_t > entry.handoff_t else 0.0
        self.events.put(KVSent(rid, self.rank, entry.decode_rank, entry.kv_bytes, entry.start, now, wait))

    def abort(self, rid: int, reason: str, now: float, kind: str = "error") -> None:
        self.aborted.add(rid)
        entry = self.out.pop(rid, None)
        if entry is None or entry.seq is None:
            return
        if entry.seq.status is SequenceStatus.TRANSFERRING:
            self.engine.release(entry.seq)
        else:
            self.engine.scheduler.abort(entry.seq)
        entry.seq.status = SequenceStatus.FAILED
        self.events.put(Failed(rid, self.rank, reason, now, kind))


@dataclass
class Incoming:
    seq: Sequence
    prefill_rank: int
    reserved_t: float
    recvs: list = field(default_factory=list)  # (layer or None for the whole request, WirePart)
    first_token: Optional[int] = None
    num_parts: Optional[int] = None


class KVReceiver:
    """The D side: reserve blocks (or queue the reservation: back-pressure), receive, hand to decode."""

    def __init__(self, engine: Engine, rank: int, inboxes, events, timeout_s: float, recompute: bool,
                 piece_bytes: int):
        self.engine, self.rank, self.inboxes, self.events = engine, rank, inboxes, events
        self.timeout_s, self.recompute, self.piece_bytes = timeout_s, recompute, piece_bytes
        self.completions = CompletionTracker(timeout_s)
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
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
            now = time.perf_counter()
            self.incoming[msg.rid] = Incoming(seq, msg.prefill_rank, now)
            self.events.put(Reserved(msg.rid, self.rank, now))
            self.inboxes[msg.prefill_rank].put(Ready(msg.rid, self.rank))

    def on_part(self, msg: KVPart) -> None:
        assert msg.dtype == str(self.engine.runner.dtype).removeprefix("torch."), "P and D pools differ in dtype"
        wire = receive_part(msg.shape, msg.src, self.buffers, self.completions, self.piece_bytes)
        entry = self.incoming.get(msg.rid)
        if entry is not None:  # if aborted, the receive still drains the wire so later messages stay in step
            entry.recvs.append((msg.part if len(msg.shape) == 4 else None, wire))  # a layer part is 4-d

    def on_done(self, msg: KVDone) -> None:
        entry = self.incoming.get(msg.rid)
        if entry is not None:
            entry.first_token, entry.num_parts = msg.first_token, msg.num_parts

    def poll(self) -> None:
        self._admit()
        now = time.perf_counter()
        for rid, entry in list(self.incoming.items()):
            if any(wire.error() for _, wire in entry.recvs):
                self._give_up(rid, entry, now)
                continue
            unpacked = [unpack_arrived(self.engine.runner, entry.seq.block_table, wire, layer)
                        for layer, wire in entry.recvs]
            if entry.num_parts is not None and len(entry.recvs) == entry.num_parts and all(unpacked):
                self._install(rid, entry, now)
            elif now - entry.reserved_t > self.timeout_s:
                self._give_up(rid, entry, now)

    def _install(self, rid: int, entry: Incoming, now: float) -> None:
        del self.incoming[rid]
        seq = entry.seq
        for _, wire in entry.recvs:
            self.buffers.put(wire.buffer)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(entry.first_token)
        self.engine.scheduler.add_running(seq)
        self.events.put(KVArrived(rid, self.rank, now))

    def _give_up(self, rid: int, entry: Incoming, now: float) -> None:
        del self.incoming[rid]
        seq = entry.seq
        self.engine.release(seq)
        if self.recompute:
            if entry.first_token is not None:
                seq.append_token(entry.first_token)
            seq.reset_for_recompute()
            self.engine.scheduler.add(seq)
            self.events.put(Failed(rid, self.rank, "KV transfer timed out: recomputing on the decode worker", now,
                                   "kv_recompute"))
        else:
            seq.status = SequenceStatus.FAILED
            self.events.put(Failed(rid, self.rank, f"KV transfer timed out after {self.timeout_s:.0f} s", now,
                                   "kv_lost"))

    def abort(self, rid: int) -> None:
        self.queued = [m for m in self.queued if m.rid != rid]
        entry = self.incoming.pop(rid, None)
        if entry is not None:
            self.engine.release(entry.seq)
