"""Where KV lives: each worker's prefix-cache blocks, by chain hash, as its step reports say.

A worker reports the blocks it registered and the ones it evicted since its last report (the
engine's own hashes: testbed/engine/prefix.py); the index applies them in that order, so it
holds what the worker's cache held at the report. KV-aware dispatch (testbed/control/dispatch.py)
asks it how many of a prompt's leading tokens a worker would find cached. No clock, no I/O.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class KVIndex:
    def __init__(self, block_size: int, workers: Iterable[int]):
        self.block_size = block_size
        self.held: dict[int, set[int]] = {w: set() for w in workers}

    def update(self, worker: int, stored: Iterable[int], removed: Iterable[int]) -> None:
        """A report's changes: blocks evicted, then blocks registered (the two are disjoint)."""
        held = self.held[worker]
        held.difference_update(removed)
        held.update(stored)

    def forget(self, worker: int) -> None:
        """A lost worker's cache is gone with it."""
        self.held[worker].clear()

    def cached_tokens(self, worker: int, hashes: Sequence[int]) -> int:
        """Leading prompt tokens the worker holds: its longest run of the prompt's block hashes."""
        held, n = self.held[worker], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * self.block_size

    def blocks(self, worker: int) -> int:
        return len(self.held[worker])
