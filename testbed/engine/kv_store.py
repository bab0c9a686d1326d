"""A KV store beside the engine's pool, shared by every worker of a run (the LMCache idea):
blocks are put by their prefix chain hash (testbed/engine/prefix.py) when they are registered,
and a prompt whose next block is missing from the pool but found in the store gets it fetched
into a fresh block instead of recomputed. So a session's KV outlives a worker's eviction (or
the worker), and a prefix computed on P is there for D.

The block manager calls a store through three methods, keyed by hash: `contains`, `put(h,
block_id)` and `fetch(h, block_id)` (False when the block is gone). Two implementations:
`HashStore` here keeps only which hashes are held (LRU, no data: the simulator), and
testbed/engine/host_store.py keeps the KV itself in shared host memory (real workers).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass


@dataclass
class StoreStats:
    """One worker's traffic with the store."""

    lookups: int = 0  # prompt blocks looked for after the pool had no more
    hits: int = 0  # of those, fetched
    puts: int = 0  # blocks written (a hash already held is not written again)
    bytes_fetched: int = 0
    bytes_put: int = 0

    def as_dict(self) -> dict:
        return {**asdict(self), "misses": self.lookups - self.hits}


class HashStore:
    """Which block hashes the store holds, LRU, up to `capacity_blocks`: the simulator's store."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.held: OrderedDict[int, None] = OrderedDict()

    def contains(self, h: int) -> bool:
        return h in self.held

    def put(self, h: int) -> bool:
        """True when the block was written (not held before)."""
        if h in self.held or self.capacity <= 0:
            return False
        if len(self.held) >= self.capacity:
            self.held.popitem(last=False)
        self.held[h] = None
        return True

    def fetch(self, h: int) -> bool:
        if h not in self.held:
            return False
        self.held.move_to_end(h)
        return True


class StoreView:
    """A worker's handle on a store: the block manager's three calls, counted."""

    def __init__(self, store, block_bytes: int, copy_in=None, copy_out=None):
        self.store, self.block_bytes = store, block_bytes
        self.copy_in, self.copy_out = copy_in, copy_out  # block_id -> data, and (data, block_id): real KV only
        self.stats = StoreStats()

    def contains(self, h: int) -> bool:
        self.stats.lookups += 1
        return self.store.contains(h)

    def put(self, h: int, block_id: int) -> None:
        written = self.store.put(h) if self.copy_out is None else self.store.put(h, self.copy_out(block_id))
        if written:
            self.stats.puts += 1
            self.stats.bytes_put += self.block_bytes

    def fetch(self, h: int, block_id: int) -> bool:
        found = (
            self.store.fetch(h)
            if self.copy_in is None
            else self.store.fetch(h, lambda data: self.copy_in(data, block_id))
        )
        if found:
            self.stats.hits += 1
            self.stats.bytes_fetched += self.block_bytes
        return found


def store_blocks(capacity_mib: float, block_bytes: int) -> int:
    """Blocks a store of `capacity_mib` holds."""
    return int(capacity_mib * (1 << 20)) // block_bytes
