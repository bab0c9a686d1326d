"""One part of a request's KV on the wire: packed from P's blocks, unpacked into D's blocks.

A part (the whole request, or one layer) is one staging buffer, lent by a BufferPool and returned
only once every piece of it has completed or failed (the transport may still read or write it).
Large parts travel as a few pieces of about `piece_bytes` (kv_transfer.piece_kib): P gathers
piece i+1 while piece i is on the wire, and D scatters piece i while piece i+1 arrives, so
packing overlaps the transfer instead of adding to it.
Both sides derive the same pieces from the part's shape; a piece is a contiguous slice
(2, [layers,] tokens, Hkv, D) of the buffer, so every send is one contiguous tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from testbed.cluster.completion import BufferPool, CompletionTracker, Handle
from testbed.engine.model_runner import ModelRunner

PIECE_BYTES = 8 << 20


def piece_ranges(shape: tuple[int, ...], itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """Token ranges [a, b) of the pieces of a part of `shape` (tokens are dim -3)."""
    tokens = shape[-3]
    per_token = math.prod(shape) // tokens * itemsize
    step = max(piece_bytes // per_token, 1)
    return [(a, min(a + step, tokens)) for a in range(0, tokens, step)]


def _views(buffer: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Contiguous piece views laid out one after another in the buffer's storage."""
    flat, per_token = buffer.view(-1), math.prod(buffer.shape) // buffer.shape[-3]
    lead = buffer.shape[:-3]
    return [flat[a * per_token : b * per_token].view(*lead, b - a, *buffer.shape[-2:]) for a, b in ranges]


@dataclass
class WirePart:
    buffer: torch.Tensor
    ranges: list[tuple[int, int]]
    views: list[torch.Tensor]
    handles: list[Handle] = field(default_factory=list)
    unpacked: int = 0  # pieces already scattered into blocks (D side)
    heads: Optional[slice] = None  # the pool's KV heads it holds (a tensor-parallel rank's share); None: all

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def settled(self) -> bool:
        """Every piece completed or failed: the transport no longer touches the buffer."""
        return all(h.done() for h in self.handles)

    def error(self) -> Optional[str]:
        return next((h.error for h in self.handles if h.done() and h.error), None)


def send_part(
    runner: ModelRunner,
    block_table: list[int],
    num_tokens: int,
    layer: Optional[int],
    dst: int,
    pool: BufferPool,
    tracker: CompletionTracker,
    piece_bytes: int = PIECE_BYTES,
    start: int = 0,
    heads: Optional[slice] = None,
) -> WirePart:
    """The KV of `num_tokens` tokens from token `start` on (start > 0: D holds the ones before);
    `heads`: only those of the pool's KV heads."""
    buffer = pool.get(runner.kv_shape(num_tokens, layer, heads))
    ranges = piece_ranges(tuple(buffer.shape), buffer.element_size(), piece_bytes)
    part = WirePart(buffer, ranges, _views(buffer, ranges), heads=heads)
    for (a, b), view in zip(ranges, part.views):
        runner.read_tokens(block_table, b - a, layer, out=view, start=start + a, heads=heads)
        part.handles.append(_post(dist.isend, view, dst, tracker))
    return part


def send_pieces(
    runner: ModelRunner,
    block_table: list[int],
    num_tokens: int,
    layer: Optional[int],
    pieces: list[tuple[int, Optional[slice]]],
    pool: BufferPool,
    tracker: CompletionTracker,
    piece_bytes: int = PIECE_BYTES,
    start: int = 0,
) -> list[WirePart]:
    """One part to each (peer rank, heads) of `pieces`: a tensor-parallel rank's shares of it."""
    return [
        send_part(runner, block_table, num_tokens, layer, dst, pool, tracker, piece_bytes, start=start, heads=heads)
        for dst, heads in pieces
    ]


def receive_part(
    shape: tuple[int, ...],
    src: int,
    pool: BufferPool,
    tracker: CompletionTracker,
    piece_bytes: int = PIECE_BYTES,
    heads: Optional[slice] = None,
) -> WirePart:
    """`shape` counts the heads received; `heads`: where in this pool's KV heads they go."""
    buffer = pool.get(shape)
    ranges = piece_ranges(shape, buffer.element_size(), piece_bytes)
    part = WirePart(buffer, ranges, _views(buffer, ranges), heads=heads)
    part.handles = [_post(dist.irecv, view, src, tracker) for view in part.views]
    return part


def _post(op, view: torch.Tensor, peer: int, tracker: CompletionTracker) -> Handle:
    """isend / irecv one piece; a peer whose connection is gone fails the piece instead of the worker."""
    try:
        return tracker.track(op(view, peer), peer)
    except RuntimeError as error:
        return Handle.failed(str(error).splitlines()[0] if str(error) else type(error).__name__)


class Retired:
    """Parts of an abandoned attempt (aborted, given up, or for a request this worker no longer
    has): their buffers go back to the pool once every piece has settled, never before."""

    def __init__(self, pool: BufferPool):
        self.pool = pool
        self.parts: list[WirePart] = []

    def add(self, parts) -> None:
        self.parts.extend(parts)
        self.poll()

    def poll(self) -> None:
        waiting = []
        for part in self.parts:
            if part.settled():
                self.pool.put(part.buffer)
            else:
                waiting.append(part)
        self.parts = waiting


def unpack_arrived(
    runner: ModelRunner, block_table: list[int], part: WirePart, layer: Optional[int], start: int = 0
) -> bool:
    """Scatter every piece that has arrived (in order) into the tokens from `start` on; True once
    the whole part is in the blocks."""
    while part.unpacked < len(part.views) and part.handles[part.unpacked].done():
        if part.handles[part.unpacked].error:
            return False
        a, _ = part.ranges[part.unpacked]
        runner.write_tokens(block_table, part.views[part.unpacked], layer, start=start + a, heads=part.heads)
        part.unpacked += 1
    return part.unpacked == len(part.views)
