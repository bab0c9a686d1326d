"""A worker of tensor-parallel degree tp: tp processes, one per device, one logical worker.

The control plane sees one worker per group: its leader (the group's first process, whose rank is
the worker's) takes every message and makes every decision. Before it changes its engine it sends
the same call to the other ranks of its group (`Mirror`), so every rank's scheduler and block
manager take the same states in the same order; `engine.step()` then runs on every rank at once,
the model's all-reduces (testbed/model/tensor_parallel.py) pairing the ranks' forwards. The other
ranks (`testbed/cluster/follower.py`) report nothing but their start, their failure and their audit.

The KV between groups of different degrees follows control/reshard.py's plan: each rank sends
its pieces (the heads a decode rank holds, from a prefill rank that holds them) straight to the
decode rank that holds them, and each decode rank posts its receives for exactly those; the
leaders' headers carry the part's tokens, the leaders tell their ranks when to send, receive and
install (`SendShare`, `RecvShare`, and the mirrored `install`).

    process ranks: the workers' leaders first (rank = worker), then each group's other ranks in
    worker order, so a run without tensor parallelism keeps its ranks.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from testbed.control.reshard import reshard
from testbed.model.config import kv_heads_of
from testbed.names import Role
from testbed.net.messages import KVPoolExport


@dataclass(frozen=True)
class Groups:
    """Every worker's processes as global ranks, its leader (rank = the worker) first."""

    ranks: tuple[tuple[int, ...], ...]
    num_kv_heads: int  # the full model's: the reshard plan's heads

    @classmethod
    def of(cls, tps: list[int], num_kv_heads: int) -> "Groups":
        after, groups = len(tps), []
        for worker, tp in enumerate(tps):
            groups.append((worker, *range(after, after + tp - 1)))
            after += tp - 1
        return cls(tuple(groups), num_kv_heads)

    @property
    def world_size(self) -> int:
        return sum(len(g) for g in self.ranks)

    def tp(self, worker: int) -> int:
        return len(self.ranks[worker])

    def place(self, rank: int) -> tuple[int, int]:
        """(worker, index in its group) of a process rank."""
        return next((w, g.index(rank)) for w, g in enumerate(self.ranks) if rank in g)

    def sends(self, src: int, index: int, dst: int) -> list[tuple[int, Optional[slice]]]:
        """(process rank, this rank's heads) of each piece rank `index` of worker `src` sends to
        worker `dst` in one hand-off; heads as a slice of the sender's pool (None: all of them)."""
        a, b = self.tp(src), self.tp(dst)
        held = kv_heads_of(self.num_kv_heads, index, a)
        return [
            (self.ranks[dst][p.dst], _local(p.heads, held)) for p in reshard(self.num_kv_heads, a, b) if p.src == index
        ]

    def receives(self, src: int, dst: int, index: int, shape: tuple) -> list[tuple[int, tuple, Optional[slice]]]:
        """(process rank, the piece's shape, where its heads go in this rank's pool) of each piece
        rank `index` of worker `dst` receives from worker `src` in one hand-off, in the sender's
        order per peer; `shape`: the part's, (..., tokens, heads, head_dim), its heads replaced."""
        a, b = self.tp(src), self.tp(dst)
        held = kv_heads_of(self.num_kv_heads, index, b)
        return [
            (self.ranks[src][p.src], (*shape[:-2], len(p.heads), shape[-1]), _local(p.heads, held))
            for p in reshard(self.num_kv_heads, a, b)
            if p.dst == index
        ]

    def writes(self, src: int, index: int, dst: int) -> list[tuple[int, Optional[slice], Optional[slice]]]:
        """kv_transfer.backend=ipc: (process rank, heads of the sender's pool, where they go in that
        rank's pool) of each piece rank `index` of worker `src` writes into worker `dst`'s pools."""
        a, b = self.tp(src), self.tp(dst)
        held = kv_heads_of(self.num_kv_heads, index, a)
        return [
            (self.ranks[dst][p.dst], _local(p.heads, held), _local(p.heads, kv_heads_of(self.num_kv_heads, p.dst, b)))
            for p in reshard(self.num_kv_heads, a, b)
            if p.src == index
        ]

    def leaders(self, ranks) -> list[int]:
        """The workers' own ranks among `ranks` (process ranks)."""
        return [r for r in ranks if r < len(self.ranks)]

    def moved_heads(self, src: int, dst: int) -> int:
        """Heads one hand-off moves in all (each of the model's KV heads once)."""
        return sum(len(p.heads) for p in reshard(self.num_kv_heads, self.tp(src), self.tp(dst)))


def _local(heads: range, held: range) -> Optional[slice]:
    """`heads` (of the model's) as a slice of a pool holding `held`; None when they are all of it."""
    return None if heads == held else slice(heads.start - held.start, heads.stop - held.start)


def new_groups(groups: Optional[Groups], rank: int, backend: Optional[str] = None):
    """Every group's process group, made by every process in the same order (torch.distributed's
    rule); this rank's, or None when it is alone. `backend`: the groups' (None: the world's)."""
    mine = None
    for ranks in groups.ranks if groups is not None else ():
        if len(ranks) > 1:
            group = dist.new_group(list(ranks), backend=backend)
            mine = group if rank in ranks else mine
    return mine


def prefill_processes(roles: tuple) -> set[int]:
    """ipc: every P process (a TP worker's ranks each map the decode pools they write into)."""
    return {r for r, role in enumerate(roles) if role == Role.PREFILL_ONLY}


def export_to_prefill(groups: Optional[Groups], roles: tuple, rank: int, inboxes, pool) -> None:
    """ipc, a D process: its pool's handle to every P worker (a leader passes it on to its ranks)."""
    targets = sorted(prefill_processes(roles))
    for target in groups.leaders(targets) if groups is not None else targets:
        inboxes[target].put(KVPoolExport(rank, pool))


def write_pieces(pieces: list, pools, own: list[int], dst_blocks: list[int], layer: Optional[int]) -> int:
    """ipc: a rank's pieces (Groups.writes) copied from its blocks `own` into the decode ranks'
    mapped pools (kv_ipc.PeerPools) at `dst_blocks`; the bytes copied."""
    return sum(pools[rank].write(own, dst_blocks, layer, (heads, into)) for rank, heads, into in pieces)


# -- what a leader tells the other ranks of its group ----------------------------------------
@dataclass(frozen=True)
class EngineCall:
    """A call that changes the engine, made on every rank in the leader's order."""

    name: str
    args: tuple


@dataclass(frozen=True)
class SendShare:
    """Send this rank's pieces of part `layer` (None: the whole request) of `rid` to worker `dst`."""

    rid: int
    dst: int
    block_table: tuple
    num_tokens: int
    start: int
    layer: Optional[int]


@dataclass(frozen=True)
class RecvShare:
    """Receive this rank's pieces of a part of `rid`'s attempt from worker `src` into `block_table`
    from token `start`; `stale`: a header for an attempt the leader no longer has (received and
    returned, so later pieces stay in step with the sender)."""

    rid: int
    attempt: int
    src: int
    block_table: tuple
    num_tokens: int
    start: int
    layer: Optional[int]
    stale: bool = False


@dataclass(frozen=True)
class WriteShare:
    """kv_transfer.backend=ipc: write this rank's pieces of `rid` from `block_table` into worker
    `dst`'s blocks `dst_blocks` (every rank then meets the leader at the group's barrier, so the
    leader's KVDone leaves once every rank's copy has landed)."""

    rid: int
    dst: int
    block_table: tuple
    dst_blocks: tuple
    layer: Optional[int]


@dataclass(frozen=True)
class Attach:
    """kv_transfer.backend=ipc: map decode process `src`'s pool (and say so to it)."""

    src: int
    handle: Any


@dataclass(frozen=True)
class Confirm:
    """Every rank says whether its share of `rid` has arrived whole (the group's MIN), before the
    leader installs it."""

    rid: int


def agreed(yes: bool, group, device) -> bool:
    """True when every rank of `group` says yes: one all-reduce (MIN) of a flag."""
    flag = torch.tensor([1 if yes else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@dataclass(frozen=True)
class Halt:
    """The run is over: audit and exit."""


MIRRORED = frozenset({"add", "reserve", "install", "recompute", "release", "abort", "step"})


class Mirror:
    """The leader's engine: a call that changes it goes to the group's other ranks first (pickled
    at once: the engine mutates the sequences it is given), then runs here."""

    def __init__(self, engine, outboxes: list, group=None):
        self.engine, self.outboxes, self.group = engine, outboxes, group

    def barrier(self) -> None:
        """Every rank of the group has reached the same call (a WriteShare's copies done)."""
        dist.barrier(group=self.group)

    def agree(self, confirm: Confirm) -> bool:
        """Ask every rank (the leader's own share is in already) whether its share has arrived."""
        self.tell(confirm)
        return agreed(True, self.group, self.engine.runner.device)

    def tell(self, message: Any) -> None:
        data = pickle.dumps(message)
        for box in self.outboxes:
            box.put(data)

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if name not in MIRRORED:
            return attr

        def mirrored(*args):
            self.tell(EngineCall(name, args))
            return attr(*args)

        return mirrored
