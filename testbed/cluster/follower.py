"""A rank of a tensor-parallel worker other than its leader (testbed/cluster/tensor_group.py).

    loop: take the leader's next call -> run it on this rank's engine and KV share

It decides nothing: the leader's calls arrive in the order the leader made them, so this rank's
engine takes the leader's states; its steps' all-reduces pair with the leader's. Its KV pieces
travel between it and the ranks of the peer group that the reshard plan names. Before the leader
installs a request, every rank says whether its own share arrived whole (`Confirm`, one
all-reduce; each piece bounded by the transfer timeout): a share broken by a peer that died
mid-transfer fails the attempt on every rank alike, as the leader's own broken piece would, and
the failure policy (retry, recompute, fail) follows. A step never reads KV that has not arrived.
"""

from __future__ import annotations

import pickle
import time

import torch.distributed as dist

from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.kv_ipc import PeerPools, release, synchronize
from testbed.cluster.kv_wire import Retired, receive_part, send_pieces, unpack_arrived
from testbed.cluster.tensor_group import (
    Attach,
    Confirm,
    EngineCall,
    Halt,
    RecvShare,
    SendShare,
    WriteShare,
    agreed,
    export_to_prefill,
    prefill_processes,
    write_pieces,
)
from testbed.errors import PeerLost
from testbed.net.messages import Audit, KVPoolAttached

WAIT_S = 0.001  # between polls of this rank's pieces while an install waits for them


class Follower:
    def __init__(self, spec, engine, inboxes, events, pool=None, group=None):
        self.spec, self.engine, self.inboxes, self.events = spec, engine, inboxes, events
        self.inbox, self.group = inboxes[spec.rank], group
        self.worker, self.index = spec.groups.place(spec.rank)
        self.pools = PeerPools()  # ipc, P: the decode pools this rank writes into
        self.pool = pool  # ipc, D: this rank's exported pool, until every P process has mapped it
        self.unattached = prefill_processes(spec.roles) if pool else set()
        if pool is not None:
            export_to_prefill(spec.groups, spec.roles, spec.rank, inboxes, pool)
        kv = spec.kv
        self.completions = CompletionTracker(kv.timeout_s)
        self.buffers = BufferPool(engine.runner.device, engine.runner.dtype)
        self.retired = Retired(self.buffers)
        self.incoming: dict[int, tuple[int, list]] = {}  # rid -> (attempt, [(layer, start, block table, wire)])
        self.bytes_sent = self.bytes_received = 0

    def loop(self) -> None:
        while True:
            message = self.inbox.get()  # the leader's calls, pickled; a P process's KVPoolAttached
            message = pickle.loads(message) if isinstance(message, bytes) else message
            if isinstance(message, Halt):
                break
            self.apply(message)
            self.retired.poll()
        self.events.put(self.audit())

    def apply(self, message) -> None:
        if isinstance(message, EngineCall):
            self.call(message)
        elif isinstance(message, SendShare):
            self.send(message)
        elif isinstance(message, RecvShare):
            self.receive(message)
        elif isinstance(message, WriteShare):
            self.write(message)
        elif isinstance(message, Confirm):
            self.confirm(message.rid)
        elif isinstance(message, Attach):
            self.pools.attach(message.src, message.handle, self.engine.runner.kv_cache)
            self.inboxes[message.src].put(KVPoolAttached(self.spec.rank))
        elif isinstance(message, KVPoolAttached):
            self.unattached.discard(message.src)
            if not self.unattached:  # every P process has it mapped
                release(self.pool)

    def call(self, call: EngineCall) -> None:
        if call.name == "install":
            self._await(call.args[0])
        elif call.name in ("abort", "release", "recompute"):
            self._retire(call.args[0])
        getattr(self.engine, call.name)(*call.args)

    # -- KV --------------------------------------------------------------------------------------
    def send(self, share: SendShare) -> None:
        runner, kv = self.engine.runner, self.spec.kv
        pieces = self.spec.groups.sends(self.worker, self.index, share.dst)
        wires = send_pieces(
            runner,
            list(share.block_table),
            share.num_tokens,
            share.layer,
            pieces,
            self.buffers,
            self.completions,
            kv.piece_bytes,
            share.start,
        )
        self.bytes_sent += sum(wire.nbytes for wire in wires)
        self.retired.add(wires)  # their buffers return once the pieces have left

    def write(self, share: WriteShare) -> None:
        """ipc: this rank's pieces straight into the decode ranks' pools, then the group's barrier."""
        own, dst = list(share.block_table), list(share.dst_blocks)
        pieces = self.spec.groups.writes(self.worker, self.index, share.dst)
        self.bytes_sent += write_pieces(pieces, self.pools, own, dst, share.layer)
        synchronize(self.engine.runner.device)
        dist.barrier(group=self.group)

    def receive(self, share: RecvShare) -> None:
        part = self.engine.runner.kv_shape(share.num_tokens, share.layer)
        wires = [
            receive_part(shape, src, self.buffers, self.completions, self.spec.kv.piece_bytes, heads)
            for src, shape, heads in self.spec.groups.receives(share.src, self.worker, self.index, part)
        ]
        if share.stale:
            self.retired.add(wires)
            return
        attempt, held = self.incoming.get(share.rid, (share.attempt, []))
        if attempt != share.attempt:  # a new attempt: the last one's pieces are abandoned
            self.retired.add([w for *_, w in held])
            held = []
        held = held + [(share.layer, share.start, share.block_table, w) for w in wires]
        self.incoming[share.rid] = (share.attempt, held)

    def confirm(self, rid: int) -> None:
        """Say whether this rank's share of `rid` arrived whole (waiting for it, each piece bounded
        by the transfer timeout); a broken share is retired, the leader fails the attempt."""
        whole = self._arrived(rid) is None
        if not whole:
            self._retire(rid)
        agreed(whole, self.group, self.engine.runner.device)

    def _arrived(self, rid: int):
        """None once every piece of this rank's share of `rid` is in its blocks; else the error
        that broke one."""
        _, held = self.incoming.get(rid, (0, []))
        runner = self.engine.runner
        while True:
            arrived = [unpack_arrived(runner, list(table), w, layer, start) for layer, start, table, w in held]
            broken = next((w.error() for *_, w in held if w.error()), None)
            if broken or all(arrived):
                return broken
            time.sleep(WAIT_S)

    def _await(self, rid: int) -> None:
        """Every piece of this rank's share of `rid` in its blocks (Confirm said so), or PeerLost."""
        broken = self._arrived(rid)
        if broken:
            raise PeerLost(f"tensor-parallel rank {self.spec.rank}: its KV share of request {rid} broke: {broken}")
        _, held = self.incoming.pop(rid, (0, []))
        for *_, wire in held:
            self.bytes_received += wire.nbytes
            self.buffers.put(wire.buffer)

    def _retire(self, rid: int) -> None:
        _, held = self.incoming.pop(rid, (0, []))
        self.retired.add([w for *_, w in held])

    def audit(self) -> Audit:
        deadline = time.perf_counter() + self.spec.kv.timeout_s
        while self.retired.parts and time.perf_counter() < deadline:
            time.sleep(WAIT_S)
            self.retired.poll()
        return Audit(
            self.spec.rank,
            self.engine.num_used_blocks,
            len(self.buffers.loaned),
            self.buffers.loaned_bytes,
            self.engine.num_cached_blocks,
            kv_bytes_sent=self.bytes_sent,
            kv_bytes_received=self.bytes_received,
        )
