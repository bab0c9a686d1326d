"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as nano-vllm does).

A decode-only step of n sequences runs the graph of the smallest bucket >= n. Its ids, positions,
slots, block tables and lengths are copied into the graphs' static buffers first. Rows n..bucket
are padding: they write their KV into the pool's scratch block, which no sequence owns, and read
only that block. The metadata is `static` (shapes fixed by the tensors, no host lengths), so every
backend's decode path can be captured; the torch backend then reads each sequence's whole table
width, which is why CUDA runs take flash-attn or the Triton kernel.

Without capture (`capture=False`) the same buffers and padding run eagerly: that is how the
bookkeeping is tested on CPU, where greedy tokens must equal the unpadded path's.
"""

from __future__ import annotations

import torch

from testbed.model.attention import AttentionMetadata


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to the first one >= max_batch."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch + 16, 16)) if max_batch > 8 else small + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        backend,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
        block_stride: int,
        device: torch.device,
        capture: bool,
    ):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = buckets(max_batch)
        self.scratch_slot = scratch_block * block_stride  # slot_mapping's unit (attention.block_stride)
        self.scratch_block = scratch_block
        size = self.buckets[-1]
        with torch.device(device):
            self.ids = torch.zeros(size, dtype=torch.int64)
            self.positions = torch.zeros(size, dtype=torch.int64)
            self.slots = torch.full((size,), self.scratch_slot, dtype=torch.int64)
            self.tables = torch.full((size, max_blocks), scratch_block, dtype=torch.int32)
            self.lens = torch.ones(size, dtype=torch.int32)
            self.hidden = torch.zeros(size, model.args.hidden_size, dtype=next(model.parameters()).dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        ones = [1] * bs  # the host lengths a static decode never reads
        zeros = self.lens.new_zeros(bs + 1)
        return AttentionMetadata(
            q_lens=ones,
            kv_lens=ones,
            num_single=bs,
            slot_mapping=self.slots[:bs],
            block_tables=self.tables[:bs],
            kv_lens_t=self.lens[:bs],
            cu_q=zeros,
            cu_kv=zeros,
            static=True,
        )

    def _forward(self, bs: int) -> None:
        self.hidden[:bs] = self.model(self.ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs), self.backend)

    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            self._forward(bs)  # lazy initialisation and kernel tuning outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that a bucket holds."""
        n = len(meta.q_lens)
        return meta.num_single == n and n <= self.buckets[-1] and meta.block_tables.shape[1] <= self.tables.shape[1]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(n, hidden) of a decode-only step, from its bucket's graph."""
        n = len(meta.q_lens)
        bs = next(b for b in self.buckets if b >= n)
        width = meta.block_tables.shape[1]
        self.ids[:n] = ids
        self.positions[:n] = positions
        self.slots[:n] = meta.slot_mapping
        self.slots[n:bs] = self.scratch_slot
        self.tables[:bs] = self.scratch_block  # padding columns and rows read the scratch block only
        self.tables[:n, :width] = meta.block_tables
        self.lens[:n] = meta.kv_lens_t
        self.lens[n:bs] = 1
        if bs in self.graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.hidden[:n]
