"""The KV cache between tensor-parallel groups of different degrees: which prefill rank sends which
KV heads to which decode rank.

A rank of a group of tp holds a contiguous share of the model's KV heads, or, with fewer KV heads
than ranks, the one head a run of tp / Hkv ranks shares (testbed/model/config.py kv_heads_of). A prefill group
of degree a hands a request's KV to a decode group of degree b: each decode rank receives exactly
the heads it holds, each once, straight from a prefill rank that holds it, and where several
prefill ranks hold a head (replicas) the decode ranks take them in turn, so no rank gathers for
the others. Pure and clock-free: the connector's plan and the simulator's hand-off time read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from testbed.model.config import kv_heads_of


@dataclass(frozen=True)
class Piece:
    """Heads `heads` (of the full model's KV heads) from prefill rank `src` to decode rank `dst`."""

    src: int
    dst: int
    heads: range


def reshard(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[Piece]:
    """Every piece of one hand-off from a group of `prefill_tp` to one of `decode_tp`, in decode
    rank order; consecutive heads from one source make one piece."""
    pieces: list[Piece] = []
    for dst in range(decode_tp):
        for head in kv_heads_of(num_kv_heads, dst, decode_tp):
            holders = [src for src in range(prefill_tp) if head in kv_heads_of(num_kv_heads, src, prefill_tp)]
            src = holders[dst % len(holders)]  # replicas in turn: no prefill rank sends every copy
            last = pieces[-1] if pieces else None
            if last is not None and (last.src, last.dst, last.heads.stop) == (src, dst, head):
                pieces[-1] = Piece(src, dst, range(last.heads.start, head + 1))
            else:
                pieces.append(Piece(src, dst, range(head, head + 1)))
    return pieces


def rank_heads(pieces: list[Piece]) -> tuple[dict[int, int], dict[int, int]]:
    """(heads each prefill rank sends, heads each decode rank receives) over one hand-off."""
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for piece in pieces:
        sent[piece.src] = sent.get(piece.src, 0) + len(piece.heads)
        received[piece.dst] = received.get(piece.dst, 0) + len(piece.heads)
    return sent, received


@lru_cache(maxsize=None)
def busiest_heads(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[int, int]:
    """(heads the busiest prefill rank sends, heads the busiest decode rank receives); cached: the
    simulator asks it on every KV transfer with the same few degrees."""
    sent, received = rank_heads(reshard(num_kv_heads, prefill_tp, decode_tp))
    return max(sent.values()), max(received.values())


def busiest_link_bytes(num_kv_heads: int, prefill_tp: int, decode_tp: int, nbytes: int) -> tuple[int, int]:
    """(bytes through the busiest prefill rank, through the busiest decode rank) of a hand-off of
    `nbytes` (the request's KV, every head once): each rank moves its pieces over its own link."""
    sent, received = busiest_heads(num_kv_heads, prefill_tp, decode_tp)
    return -(-nbytes * sent // num_kv_heads), -(-nbytes * received // num_kv_heads)
