"""testbed/control/reshard.py: KV between tensor-parallel groups of different degrees. Every decode
rank receives exactly the KV heads it holds, each once, from a prefill rank that holds it; with
one head per decode rank or more, the bytes moved are the KV's size, each byte once; no prefill
rank gathers for the others."""

from __future__ import annotations

import itertools

import pytest

from testbed.control.reshard import Piece, busiest_link_bytes, rank_heads, reshard
from testbed.model.config import kv_heads_of

DEGREES = (1, 2, 4, 8)
CASES = [
    (h, a, b)
    for h, a, b in itertools.product((1, 2, 4, 8), DEGREES, DEGREES)
    if all(h % t == 0 or t % h == 0 for t in (a, b))
]


@pytest.mark.parametrize("heads, a, b", CASES)
def test_each_decode_rank_gets_exactly_its_heads_once_from_a_rank_that_holds_them(heads, a, b):
    pieces = reshard(heads, a, b)
    for dst in range(b):
        got = [h for p in pieces if p.dst == dst for h in p.heads]
        assert got == list(kv_heads_of(heads, dst, b)), (dst, pieces)  # each of its heads, once, in order
    for piece in pieces:
        assert set(piece.heads) <= set(kv_heads_of(heads, piece.src, a)), piece  # the source holds them
    moved = sum(len(p.heads) for p in pieces)
    assert moved == (b if heads < b else heads)  # each byte once, or once per decode replica


@pytest.mark.parametrize("heads, a, b", CASES)
def test_no_prefill_rank_sends_more_than_its_share(heads, a, b):
    sent, received = rank_heads(reshard(heads, a, b))
    moved = sum(received.values())
    holders = min(a, heads)  # prefill ranks holding distinct heads
    assert max(sent.values()) <= -(-moved // holders), (sent, received)


def test_the_pieces_of_some_degrees_spelled_out():
    assert reshard(8, 1, 1) == [Piece(0, 0, range(0, 8))]
    assert reshard(8, 2, 4) == [
        Piece(0, 0, range(0, 2)),
        Piece(0, 1, range(2, 4)),
        Piece(1, 2, range(4, 6)),
        Piece(1, 3, range(6, 8)),
    ]
    assert reshard(8, 4, 2) == [
        Piece(0, 0, range(0, 2)),
        Piece(1, 0, range(2, 4)),
        Piece(2, 1, range(4, 6)),
        Piece(3, 1, range(6, 8)),
    ]
    # 2 KV heads on 4 prefill ranks (each replicated twice) to 1 decode rank: one copy of each
    assert reshard(2, 4, 1) == [Piece(0, 0, range(0, 1)), Piece(2, 0, range(1, 2))]


def test_the_busiest_link_sets_a_hand_offs_bytes():
    assert busiest_link_bytes(8, 1, 1, 800) == (800, 800)  # TP1: the whole KV on one link
    assert busiest_link_bytes(8, 4, 4, 800) == (200, 200)  # four links in parallel
    assert busiest_link_bytes(8, 1, 4, 800) == (800, 200)  # one sender feeds four receivers
    assert busiest_link_bytes(2, 1, 4, 800) == (1600, 400)  # each of 2 heads to two replicas: sent twice
