"""KV connector: a prefill worker pushes a request's KV into blocks a decode worker reserved.

Handshake (control plane), then data (torch.distributed point-to-point, gloo or NCCL):

    P: prefill done -> KV held (bounded queue)      D: Reserve -> allocate blocks -> Ready to P
    P: on Ready: KVBegin, then per part a KVPart     D: KVBegin starts the lease; on KVPart: irecv
       header to D and isend(buffer)                    (buffer) in header order
    P: sends complete -> KVDone to D; blocks freed   D: all parts + KVDone -> write blocks -> decode
       (or, with on_failure=retry, kept until D's      (+ KVAck to P with on_failure=retry)
       KVAck)

D's timer is a lease (kv_transfer.timeout_s): it starts when P begins an attempt and every piece
that arrives renews it, so a long prefill queue never times out a reserved transfer. An attempt
whose lease runs out or whose wire breaks is retried, recomputed or failed by D
(kv_transfer.on_failure, see testbed/cluster/receiver.py); a retry is a new Ready with the next
attempt number, and P sends again from the KV it kept.

Headers travel on D's inbox from a single producer (P), so D posts its receives in exactly the
order P posts its sends: that is what NCCL, which has no tags, needs. One contiguous buffer
per request (granularity=request) or per layer (granularity=layer, streamed during the prefill
when D is already bound and ready). A staging buffer returns to its pool once its pieces have
settled, on every path: sent, failed, aborted, superseded by a resend.

With kv_transfer.backend=ipc (testbed/cluster/kv_ipc.py) there are no parts: Ready carries D's
blocks and P copies its blocks straight into them, then sends KVDone (num_parts 0). The copy is
synchronous between KVBegin and KVDone, so D's lease needs only to outlast one copy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.kv_ipc import PeerPools, synchronize
from testbed.cluster.kv_wire import Retired, WirePart, send_pieces
from testbed.cluster.tensor_group import Attach, Groups, Mirror, SendShare, WriteShare, write_pieces
from testbed.control.config import KVTransferConfig
from testbed.control.ledger import Outgoing, SendLedger
from testbed.engine import Engine, Sequence
from testbed.names import Granularity
from testbed.net.faults import FaultInjected, KVFaults
from testbed.net.messages import KVAck, KVBegin, KVDone, KVFence, KVPart, KVPoolAttached, KVPoolExport, KVSent, Ready


@dataclass
class WireOutgoing(Outgoing):
    """The ledger's entry plus this attempt's wire state."""

    begun: bool = False  # KVBegin sent for this attempt
    sent_parts: set = field(default_factory=set)
    parts: list[WirePart] = field(default_factory=list)  # this attempt's buffers, lent until settled
    abandoned: list[WirePart] = field(default_factory=list)  # the previous attempt's, to retire
    kv_bytes: int = 0
    dropped: bool = False  # fault injection: this attempt's data is lost on the way
    done_sent: bool = False
    reported: bool = False  # KVSent for this attempt
    dst_blocks: tuple = ()  # ipc: D's blocks for this attempt
    renewed_t: float = float("-inf")  # when P last renewed D's lease while an emulated link held KVDone

    def restart(self, attempt: int, decode_rank: int, now: float) -> None:
        super().restart(attempt, decode_rank, now)
        self.abandoned, self.parts = self.abandoned + self.parts, []
        self.begun = self.dropped = self.done_sent = self.reported = False
        self.sent_parts, self.kv_bytes = set(), 0


class KVSender:
    """The P side. Blocks are freed once every part has left, or once D acknowledges the KV when
    the policy keeps it for resends."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        inboxes,
        events,
        kv: KVTransferConfig,
        faults: KVFaults,
        clock: Callable[[], float] = time.perf_counter,
        groups: Optional[Groups] = None,
    ):
        self.engine, self.rank, self.inboxes, self.events, self.kv = engine, rank, inboxes, events, kv
        self.groups = groups  # tensor-parallel workers: each rank sends its own pieces (tensor_group.py)
        self.bytes_moved = 0  # this process's KV put on the wire
        self.direct = kv.direct  # kv_transfer.backend=ipc: write into D's mapped pool
        self.pools = PeerPools()
        self.by_layer, self.piece_bytes = kv.granularity == Granularity.LAYER, kv.piece_bytes
        self.faults, self.policy, self.clock = faults, kv.failure_policy(), clock
        self.lease_s = kv.timeout_s  # D's lease (the same kv_transfer.timeout_s): renewed while a link holds
        self.ledger: SendLedger[WireOutgoing] = SendLedger(WireOutgoing)
        self.completions = CompletionTracker(kv.timeout_s)  # bounds every send: a dead peer fails it
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
        self.retired = Retired(self.buffers)
        self.link = None  # an emulated device's link (testbed/cluster/pacing.py LinkPacer), set by the worker

    @property
    def num_parts(self) -> int:
        return self.engine.args.num_layers if self.by_layer else 1

    def attach(self, msg: KVPoolExport) -> None:
        """ipc: map a decode process's pool, and say so (it removes its shared-memory file once
        every P process has); a TP worker's other ranks map it too."""
        if isinstance(self.engine, Mirror):
            self.engine.tell(Attach(msg.src, msg.handle))
        self.pools.attach(msg.src, msg.handle, self.engine.runner.kv_cache)
        self.inboxes[msg.src].put(KVPoolAttached(self.rank))

    def serve(self, seq: Sequence, decode_rank: Optional[int]) -> None:
        """The request reached this worker (again, after a re-dispatch); D known when bound early."""
        self.ledger.serve(seq, decode_rank)

    def handoff(self, seq: Sequence, t: float) -> None:
        self._try_send(self.ledger.handoff(seq, t))

    def ready(self, msg: Ready) -> None:
        # D may answer before this worker has read the request itself (two queues, no order)
        entry = self.ledger.ready(msg.rid, msg.decode_rank, msg.attempt, self.clock(), msg.skip)
        if entry is None:
            if self.direct and msg.rid in self.ledger.aborted:  # D may free what it kept back for us
                self.inboxes[msg.decode_rank].put(KVFence(msg.rid))
            return  # ended here, or already under way
        entry.dst_blocks = msg.blocks
        self.retired.add(entry.abandoned)
        entry.abandoned = []
        if self.faults.drop():
            entry.dropped = True
            self.events.put(FaultInjected(self.rank, "drop_kv", msg.rid, entry.ready_t))
        self._try_send(entry)

    def ack(self, msg: KVAck) -> None:
        """D installed the KV or gave it up for good: P's copy is no longer needed."""
        entry = self.ledger.get(msg.rid)
        if entry is None or entry.seq is None or not entry.held:
            return
        if entry.done_sent and not entry.reported:
            self._sent(msg.rid, entry)  # D holds every piece, whether or not P's side has seen them settle
        self._release(msg.rid)

    def blocked(self, max_pending: int) -> bool:
        """Back-pressure: prefilled KV waits for decode workers."""
        return self.ledger.blocked(max_pending)

    @property
    def busy(self) -> bool:
        return bool(self.ledger.out)

    def stream_layer(self, layer: int, finishing: list[Sequence]) -> None:
        """Called after `layer` of a step's forward: that layer's KV of these sequences is final."""
        for seq in finishing:
            entry = self.ledger.get(seq.seq_id)
            if entry is not None and self._may_send(entry) and not entry.dropped and layer not in entry.sent_parts:
                self._send_part(entry, layer)

    def _may_send(self, entry: WireOutgoing) -> bool:
        return entry.ready_t is not None and self.clock() >= entry.ready_t + self.faults.delay_s

    def _try_send(self, entry: WireOutgoing) -> None:
        if not entry.sendable or entry.done_sent or not self._may_send(entry):
            return
        if entry.dropped:  # the attempt begins (D's lease starts) but its data never arrives
            self._begin(entry)
            entry.done_sent = True
            return
        for part in range(self.num_parts):
            if part not in entry.sent_parts:
                self._send_part(entry, part)
        if self.link is not None and not self._link_arrived(entry):
            self._renew_lease(entry)  # emulated link: D may not install the KV (nor P free it) before its
            return  # modelled time, and must not time the attempt out while the modelled link holds it
        if self.direct:
            synchronize(self.engine.runner.device)  # every byte in D's blocks before D hears of it
        self.inboxes[entry.decode_rank].put(
            KVDone(
                entry.seq.seq_id,
                entry.seq.token_ids[-1],
                0 if self.direct else self.num_parts,
                entry.attempt,
                self.rank,
            )
        )
        entry.done_sent = True

    def _link_arrived(self, entry: WireOutgoing) -> bool:
        """Has the emulated link (and D's first-token path) passed its modelled time for this KV?"""
        rid, tokens, now = entry.seq.seq_id, entry.seq.num_prompt_tokens - entry.skip, self.clock()
        return self.link.arrived(rid, entry.start, entry.kv_bytes, now, tokens, entry.handoff_t, entry.ready_t)

    def _renew_lease(self, entry: WireOutgoing) -> None:
        """KVBegin again for the attempt under way restarts D's lease (receiver.on_begin): sent a
        few times per lease while the modelled link is slower than the lease is long."""
        now = self.clock()
        if now - max(entry.start, entry.renewed_t) >= self.lease_s / 4:
            entry.renewed_t = now
            self.inboxes[entry.decode_rank].put(KVBegin(entry.seq.seq_id, entry.attempt, self.rank))

    def _begin(self, entry: WireOutgoing) -> None:
        if not entry.begun:
            entry.begun, entry.start = True, self.clock()
            self.inboxes[entry.decode_rank].put(KVBegin(entry.seq.seq_id, entry.attempt, self.rank))

    def _send_part(self, entry: WireOutgoing, part: int) -> None:
        seq = entry.seq
        layer = part if self.by_layer else None
        runner = self.engine.runner
        self._begin(entry)
        if self.direct:
            self._write_part(entry, layer)
            entry.sent_parts.add(part)
            return
        shape = runner.kv_shape(seq.num_prompt_tokens - entry.skip, layer)
        self.inboxes[entry.decode_rank].put(
            KVPart(seq.seq_id, part, shape, str(runner.dtype).removeprefix("torch."), self.rank, entry.attempt)
        )
        num_tokens = seq.num_prompt_tokens - entry.skip
        if isinstance(self.engine, Mirror):  # the group's other ranks send their pieces too
            share = SendShare(seq.seq_id, entry.decode_rank, tuple(seq.block_table), num_tokens, entry.skip, layer)
            self.engine.tell(share)
        pieces = self._pieces(entry.decode_rank)
        wires = send_pieces(
            runner,
            seq.block_table,
            num_tokens,
            layer,
            pieces,
            self.buffers,
            self.completions,
            self.piece_bytes,
            entry.skip,
        )
        entry.parts.extend(wires)
        entry.sent_parts.add(part)
        self.bytes_moved += sum(wire.nbytes for wire in wires)
        entry.kv_bytes += self._group_bytes(runner.kv_shape(num_tokens, layer), entry.decode_rank)

    def _pieces(self, decode_rank: int) -> list[tuple[int, Optional[slice]]]:
        """(process rank, heads of this pool) of each piece this process sends to a decode worker."""
        if self.groups is None:
            return [(decode_rank, None)]
        return self.groups.sends(self.rank, 0, decode_rank)

    def _group_bytes(self, shape: tuple, decode_rank: int) -> int:
        """The bytes a part moves over every rank of the group: each of the model's KV heads once."""
        nbytes = math.prod(shape) * self.engine.runner.dtype.itemsize
        if self.groups is None:
            return nbytes
        return nbytes * self.groups.moved_heads(self.rank, decode_rank) // shape[-2]

    def _write_part(self, entry: WireOutgoing, layer: Optional[int]) -> None:
        """ipc: P's blocks of the tokens D lacks, copied whole into the blocks D reserved (the
        prefix D holds is whole blocks, so the two tables line up block for block)."""
        bs, seq = self.engine.runner.block_size, entry.seq
        assert entry.skip % bs == 0, f"a cached prefix of {entry.skip} tokens is not whole {bs}-token blocks"
        own = seq.block_table[entry.skip // bs : -(-seq.num_prompt_tokens // bs)]
        dst = list(entry.dst_blocks[: len(own)])
        if self.groups is None:
            entry.kv_bytes += self.pools[entry.decode_rank].write(own, dst, layer)
            return
        if isinstance(self.engine, Mirror):  # the group's other ranks write their pieces too
            self.engine.tell(WriteShare(seq.seq_id, entry.decode_rank, tuple(own), tuple(dst), layer))
        self.bytes_moved += write_pieces(
            self.groups.writes(self.rank, 0, entry.decode_rank), self.pools, own, dst, layer
        )
        if isinstance(self.engine, Mirror):
            synchronize(self.engine.runner.device)
            self.engine.barrier()  # every rank's copy has landed before KVDone leaves
        # whole blocks, as the copies move them
        entry.kv_bytes += self._group_bytes(self.engine.runner.kv_shape(len(own) * bs, layer), entry.decode_rank)

    def poll(self) -> None:
        self.retired.poll()
        for rid, entry in list(self.ledger.out.items()):
            self._try_send(entry)  # a delayed send whose time has come
            if entry.done_sent and not entry.reported and all(wire.settled() for wire in entry.parts):
                self._sent(rid, entry)

    def _sent(self, rid: int, entry: WireOutgoing) -> None:
        """Every part of the attempt left (or broke: D's side sees it too and decides what follows)."""
        self._report(rid, entry)
        self.retired.add(entry.parts)
        entry.parts = []
        if not self.policy.holds_until_ack:
            self._release(rid)

    def _report(self, rid: int, entry: WireOutgoing) -> None:
        entry.reported = True
        error = next((wire.error() for wire in entry.parts if wire.error()), None) or ""
        self.events.put(
            KVSent(
                rid,
                self.rank,
                entry.decode_rank,
                entry.kv_bytes,
                entry.start,
                self.clock(),
                entry.wait_s,
                entry.attempt,
                entry.dropped,
                error,
            )
        )

    def _release(self, rid: int) -> None:
        entry = self.ledger.release(rid)
        self.retired.add(entry.parts + entry.abandoned)
        self.engine.release(rid)

    def abort(self, rid: int) -> bool:
        """The router ended the request: free its blocks now and its buffers once they settle.
        False when this side had no record of it (the engine may still hold it queued)."""
        entry = self.ledger.abort(rid)
        if entry is None:
            return False
        if entry.begun and not entry.reported:  # the attempt keeps its row: broken, else aborted
            self._report(rid, entry)
        if self.direct and entry.ready_t is not None:  # P writes no more into D's blocks for it
            self.inboxes[entry.decode_rank].put(KVFence(rid))
        self.retired.add(entry.parts + entry.abandoned)
        if entry.seq is not None:
            self.engine.abort(rid)
        return True

    @property
    def in_flight(self) -> bool:
        """Staging buffers still on the wire."""
        return bool(self.retired.parts) or any(entry.parts for entry in self.ledger.out.values())

    @property
    def awaits_ack(self) -> bool:
        """KV sent in full and kept for a resend until D's acknowledgement, which D puts before
        the request can end: at the end of a run it is on its way, and may arrive after the
        router's Stop (the two come from different processes)."""
        return self.policy.holds_until_ack and any(entry.held and entry.done_sent for entry in self.ledger.out.values())
