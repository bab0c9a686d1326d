"""The KV store in shared host memory (testbed/engine/kv_store.py says what it is for).

Slots of one block's KV each, (layers, 2, block_size, Hkv, D), in tensors every worker maps
(created by the driver, handed to the workers when they are spawned), with their hashes, an LRU
clock and a lock: a worker puts a block's KV in the least recently used slot and fetches by
hash. Lookups are vectorised over the slots' hashes, so a store of tens of thousands of blocks
answers in microseconds.
"""

from __future__ import annotations

from typing import Callable

import torch


class SharedKVStore:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, lock):
        self.data = torch.zeros(num_slots, *block_shape, dtype=dtype).share_memory_()
        self.hashes = torch.zeros(num_slots, dtype=torch.int64).share_memory_()
        self.used = torch.zeros(num_slots, dtype=torch.bool).share_memory_()
        self.last = torch.zeros(num_slots, dtype=torch.int64).share_memory_()  # LRU clock per slot
        self.clock = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.lock = lock

    @property
    def num_slots(self) -> int:
        return self.hashes.numel()

    def _slot(self, h: int) -> int:
        found = torch.nonzero(self.used & (self.hashes == h))
        return int(found[0, 0]) if found.numel() else -1

    def _touch(self, slot: int) -> None:
        self.clock += 1
        self.last[slot] = self.clock[0]

    def contains(self, h: int) -> bool:
        with self.lock:
            return self._slot(h) >= 0

    def put(self, h: int, block: torch.Tensor) -> bool:
        """Write a block's KV under its hash (evicting the least recently used slot); False when
        the hash is held already."""
        with self.lock:
            if self._slot(h) >= 0:
                return False
            slot = int(torch.argmin(torch.where(self.used, self.last, torch.full_like(self.last, -1))))
            self.data[slot].copy_(block)
            self.hashes[slot] = h
            self.used[slot] = True
            self._touch(slot)
            return True

    def fetch(self, h: int, read: Callable[[torch.Tensor], None]) -> bool:
        """Hand the block's KV to `read` (under the lock: no put overwrites it meanwhile)."""
        with self.lock:
            slot = self._slot(h)
            if slot < 0:
                return False
            read(self.data[slot])
            self._touch(slot)
            return True


def create_store(capacity_mib: float, block_shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVStore | None":
    """The run's store, made by the driver before it spawns the workers (None when off)."""
    block_bytes = torch.tensor([], dtype=dtype).element_size()
    for n in block_shape:
        block_bytes *= n
    slots = int(capacity_mib * (1 << 20)) // block_bytes
    if slots < 1:
        return None
    import torch.multiprocessing as mp  # the workers' start method: their lock must come from it

    return SharedKVStore(slots, block_shape, dtype, mp.get_context("spawn").Lock())
