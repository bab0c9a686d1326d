"""Block manager invariants under randomized allocate / append / free, with prefix sharing."""

import random

import pytest

from testbed.engine import BlockManager, Sequence


def _assert_no_overlap(live):
    """A block may appear in several tables only through prefix sharing, never twice in one table."""
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_random_allocate_append_free(prefix, seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=prefix)
    system = [rng.randrange(100) for _ in range(9)]  # a shared system prompt: two full blocks
    live, next_id = [], 0
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            body = [rng.randrange(100) for _ in range(rng.randint(1, 20))]
            seq = Sequence(next_id, (system if rng.random() < 0.5 else []) + body, 50)
            next_id += 1
            if bm.can_allocate(seq, seq.num_tokens):
                free_before = bm.num_free_blocks
                bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens  # its KV is now "computed"
                bm.commit(seq)
                assert len(seq.block_table) == bm.blocks_for(seq.num_tokens)
                assert bm.num_free_blocks >= free_before - len(seq.block_table)
                live.append(seq)
        elif action < 0.8 and live:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(100)) if not seq.is_done else None
            if bm.can_allocate(seq, seq.num_tokens):
                bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                bm.commit(seq)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            assert seq.block_table == []
        bm.check_invariants(live)
        _assert_no_overlap(live)
        held = {b for s in live for b in s.block_table}
        assert bm.num_used_blocks == len(held), "counts balance: used blocks are exactly those held"
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_shared_prefix_blocks_are_counted_once_per_holder():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    a = Sequence(0, prompt, 4)
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.commit(a)
    b = Sequence(1, prompt + [99], 4)
    assert bm.can_allocate(b, b.num_tokens)
    bm.allocate(b, b.num_tokens)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_used_blocks == 3 + 1  # a: 3 blocks; b: shares 2, owns 1
    bm.free(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.free(b)
    bm.check_invariants([])
    # freed blocks keep their hash: a third identical prompt still hits the cache
    c = Sequence(2, prompt + [7], 4)
    bm.allocate(c, c.num_tokens)
    assert c.num_cached_tokens == 8


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = Sequence(0, list(range(10)), 2), Sequence(1, list(range(10)), 2)
    for s in (a, b):
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    assert not set(a.block_table) & set(b.block_table)
    assert b.num_cached_tokens == 0


def test_can_allocate_refuses_when_full():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Sequence(0, list(range(12)), 2)
    assert bm.can_allocate(a, 12) and not bm.can_allocate(a, 13)
