"""Fixed-size KV blocks: a free list, reference counts and optional prefix sharing.

Check/act pairs: `can_allocate` then `allocate`. A sequence's block table covers every token
that has or will get KV this step. With prefix caching, a full block whose KV is computed is
registered under a chain hash of its tokens; a later sequence whose prompt starts with the same
tokens shares it (reference count + 1) instead of recomputing it. Freed blocks keep their hash
until reused, so a finished turn's KV still serves the next turn of a session. KV written from
outside (received from a prefill worker) goes into fresh blocks, never shared ones, and is
registered once installed. A tracked manager keeps the hashes it registered and evicted since
the last `drain_changes`, which a worker reports for KV-aware routing (testbed/control/kv_index.py).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from testbed.engine.prefix import ROOT, block_hash, cacheable_blocks
from testbed.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class Blocks(dict):
    """Block id -> Block, each made on first use: a device-sized pool (hundreds of thousands of
    blocks, one per simulated worker) costs nothing until its blocks are taken."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside a pool of {self.num_blocks}")
        block = self[block_id] = Block(block_id)
        return block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.changes: dict[int, bool] | None = None  # hash -> cached now; None: not tracked
        self.store = None  # a shared KV store (testbed/engine/kv_store.py): puts and fetches by hash

    def track_changes(self) -> None:
        self.changes = {}

    def drain_changes(self) -> tuple[list[int], list[int]]:
        """(hashes registered, hashes evicted) since the last call; disjoint."""
        changes = self.changes
        if not changes:
            return [], []
        self.changes = {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a registered prefix (kept for later hits, not leaked)."""
        return sum(1 for b in self.hash_to_block.values() if self.blocks[b].ref_count == 0)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Room to cover `num_tokens` tokens of `seq` (prefix hits counted when it has no blocks)."""
        hits = self._match_prefix(seq)[0] if not seq.block_table else []
        fresh = self.blocks_for(num_tokens) - len(seq.block_table) - len(hits)
        hits_now_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return fresh + hits_now_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if not seq.block_table:
            hits, seq.block_hashes = self._match_prefix(seq)
            for block_id in hits:
                self._take(block_id)
                seq.block_table.append(block_id)
            if self.store is not None:
                self._fetch_from_store(seq)
            seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > 0:  # most decode steps: the last block has room
            self._take_fresh(seq, need)

    def _fetch_from_store(self, seq: Sequence) -> None:
        """Past the pool's hits, the prompt's next blocks that the store holds: each fetched into
        a fresh block (the LRU free one, taken only once the fetch found it) and registered."""
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT
        for i in range(len(seq.block_table), cacheable_blocks(seq.num_tokens, self.block_size)):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            if not self.free_ids or not self.store.contains(h) or not self.store.fetch(h, next(iter(self.free_ids))):
                return
            self._take_fresh(seq, 1)
            block = self.blocks[seq.block_table[-1]]
            if h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
                if self.changes is not None:
                    self.changes[h] = True
            seq.block_hashes.append(h)
            parent = h

    def can_allocate_fresh(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate_fresh(self, seq: Sequence, num_tokens: int) -> None:
        """Unshared blocks for KV written from outside: a write never touches a block that
        another sequence reads. `commit` registers them once the KV is in."""
        assert not seq.block_table
        seq.block_hashes = []
        self._take_fresh(seq, self.blocks_for(num_tokens))

    def _take_fresh(self, seq: Sequence, need: int) -> None:
        fresh = list(islice(self.free_ids, need))
        free_ids, blocks = self.free_ids, self.blocks
        for block_id in fresh:  # LRU first; _forget_hash and _take, inlined: a long simulation's hottest loop
            block = blocks[block_id]
            if block.hash is not None:
                self._forget_hash(block_id)  # evicted: the least recently freed cached block
            del free_ids[block_id]
            block.ref_count = 1
        seq.block_table.extend(fresh)

    def free(self, seq: Sequence) -> None:
        blocks, free_ids = self.blocks, self.free_ids
        for block_id in reversed(seq.block_table):  # tail first: it is the least likely to be shared
            block = blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                free_ids[block_id] = None
        seq.block_table, seq.block_hashes = [], []

    # -- prefix caching ---------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        # only the blocks filled since the last commit: the step loop calls this for every item
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else ROOT, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
                if self.changes is not None:
                    self.changes[h] = True
                if self.store is not None:  # write-through: the block outlives this pool
                    self.store.put(h, block.block_id)
            seq.block_hashes.append(h)

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(block ids, their chain hashes) of the cached blocks the sequence starts with. Only
        blocks strictly before the last token: that token must be computed to get logits, and a
        shared block is never written."""
        if not self.enable_prefix_caching:
            return [], []
        hits, hashes, parent = [], [], ROOT
        for i in range(cacheable_blocks(seq.num_tokens, self.block_size)):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            hashes.append(h)
            parent = h
        return hits, hashes

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _forget_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.hash_to_block[block.hash]
            if self.changes is not None:
                self.changes[block.hash] = False
            block.hash, block.token_ids = None, ()

    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal the number of live block tables holding each block."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in map(self.blocks.__getitem__, range(self.num_blocks)):
            assert block.ref_count == counts[block.block_id], f"block {block.block_id} refcount"
            assert (block.block_id in self.free_ids) == (block.ref_count == 0), f"block {block.block_id} free list"
