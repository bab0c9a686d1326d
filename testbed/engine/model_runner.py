"""Turns a batch plan into tensors, runs the model on the paged KV pool, samples greedily."""

from __future__ import annotations

import array
import dataclasses
import logging
from itertools import accumulate
from typing import NamedTuple

import torch

from testbed.engine.config import EngineConfig
from testbed.engine.cuda_graphs import DecodeGraphs, buckets
from testbed.engine.kv_pool import checked_pool, host_available_bytes, kv_block_shape, pool_blocks, sized_from_memory
from testbed.engine.scheduler import Batch
from testbed.model.attention import (
    AttentionMetadata,
    TorchAttention,
    after_cache,
    block_stride,
    chunk_plan,
    select_backend,
)
from testbed.model.config import ModelArgs
from testbed.model.linear import pack_linears
from testbed.model.llama import Transformer

log = logging.getLogger(__name__)
ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


class PreparedBatch(NamedTuple):
    """A batch as the model runs it (ModelRunner.prepare): its items reordered, decodes first."""

    order: list[int]  # the batch's item indices in the order the model runs them
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows sampled: one per item that reaches its sequence's end


class ModelRunner:
    """`fit_max_model_len`: when the pool cannot hold one request of max_model_len, lower
    max_model_len to what it holds (and say so) instead of refusing; for a length the user did not
    ask for, such as a checkpoint's max_position_embeddings. `max_running`: a CPU pool sized from
    the memory holds at most that many requests of max_model_len (more would never be used), and
    a CUDA pool sized from the memory leaves room for a step of `step_tokens` (profiled first).
    `decodes`: False for a prefill-only worker, which captures no decode graphs."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        device: torch.device,
        fit_max_model_len: bool = False,
        max_running: int | None = None,
        step_tokens: int | None = None,
        decodes: bool = True,
    ):
        self.dtype = next(model.parameters()).dtype
        config = config.for_device(device.type, self.dtype)
        self.model, self.config, self.device = model, config, device
        if device.type == "cpu":
            pack_linears(model)  # oneDNN's packed GEMM (testbed.model.linear)
        self.args: ModelArgs = model.args
        self.block_size = config.block_size
        self.backend = select_backend(
            config.attention_backend, device, self.dtype, config.block_size, self.args.head_dim
        )
        self.graphs_wanted = decode_graphs_wanted(config.cuda_graphs, self.backend.name, decodes)
        self.num_blocks = self._pool_blocks(max_running, step_tokens or self.args.max_model_len)
        self.args = self._fit_max_model_len() if fit_max_model_len else self._check_max_model_len()
        # (blocks + 1, layers, 2, block_size, Hkv, D), block-major: one block's K and V of every layer
        # are one contiguous span, so moving a request's blocks (the ipc transport, the KV store) copies
        # a few large pieces, not 2 x layers small ones per block. The last block is scratch no sequence
        # owns (the padded rows of a graph-replayed decode write there).
        self.kv_cache = torch.zeros(
            self.num_blocks + 1, *kv_block_shape(self.args, self.block_size), dtype=self.dtype, device=device
        )
        self.kv_caches = layer_caches(self.kv_cache)
        self.block_stride = block_stride(self.kv_caches[0][0])  # rows of (Hkv, D) per block: slot_mapping's unit
        self.graphs: DecodeGraphs | None = None

    def enable_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Decode-only steps of up to `max_batch` sequences replay CUDA graphs (engine.cuda_graphs);
        without capture the same padded static path runs eagerly (CPU tests)."""
        max_blocks = -(-self.args.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            max_batch,
            max_blocks,
            self.num_blocks,
            self.block_stride,
            self.device,
            capture,
        )

    def adopt_pool(self, pool: torch.Tensor) -> None:
        """Move the KV pool into `pool` (same shape and dtype: e.g. shared memory another process
        maps); before serving, since earlier views of the old pool are not updated."""
        assert pool.shape == self.kv_cache.shape and pool.dtype == self.dtype, "the new pool differs in shape"
        assert self.graphs is None, "captured graphs hold the old pool"
        pool.copy_(self.kv_cache)
        self.kv_cache = pool
        self.kv_caches = layer_caches(pool)

    @property
    def block_bytes(self) -> int:
        return self.args.kv_bytes_per_token * self.block_size * self.dtype.itemsize

    def _pool_blocks(self, max_running: int | None, step_tokens: int) -> int:
        # the memory is read only when it sizes the pool (an explicit size needs none)
        kind, memory = self.device.type, {}
        if sized_from_memory(self.config) and kind == "cuda":
            sampled = min(step_tokens, max_running or step_tokens)
            profiles = [lambda: self.profile_step(step_tokens, sampled)]
            if self.graphs_wanted:  # the graphs' private pool, captured after the KV pool
                largest = buckets(max_running or 1)[-1]
                profiles.append(lambda: self.profile_step(largest, largest))
            memory = cuda_memory(self.device, profiles)
        elif sized_from_memory(self.config):
            per_seq = -(-self.args.max_model_len // self.block_size)
            memory = dict(free_bytes=host_available_bytes(), max_blocks=max_running * per_seq if max_running else None)
        return pool_blocks(self.config, self.block_bytes, device_type=kind, **memory)

    @torch.inference_mode()
    def profile_step(self, tokens: int, sampled: int) -> None:
        """A step of `tokens` fresh prompt tokens (prompts of up to max_model_len) and the logits of
        `sampled` rows, before the pool exists: what its activations take at their peak. The KV goes
        to a one-block scratch cache, attention through SDPA (the Triton backend's prefill path)."""
        length = min(tokens, self.args.max_model_len)
        q_lens = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
        a, device = self.args, self.device
        scratch = torch.zeros(1, self.block_size, a.num_kv_heads, a.head_dim, dtype=self.dtype, device=device)
        cu = torch.tensor(list(accumulate(q_lens, initial=0)), dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            q_lens=q_lens,
            kv_lens=q_lens,
            num_single=0,
            slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
            block_tables=torch.zeros(len(q_lens), 1, dtype=torch.int32, device=device),
            kv_lens_t=torch.tensor(q_lens, dtype=torch.int32, device=device),
            cu_q=cu,
            cu_kv=cu,
        )
        positions = torch.cat([torch.arange(n, device=device) for n in q_lens])
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        hidden = self.model(ids, positions, [(scratch, scratch)] * a.num_layers, meta, TorchAttention())
        self.model.logits(hidden[:sampled])

    def _check_max_model_len(self) -> ModelArgs:
        checked_pool(self.num_blocks, self.block_size, self.args.max_model_len)
        return self.args

    def _fit_max_model_len(self) -> ModelArgs:
        held = self.num_blocks * self.block_size
        if held >= self.args.max_model_len or held < 2:  # fits, or too small to fit anything: refuse
            return self._check_max_model_len()
        log.warning(
            "model.max_model_len lowered from %d to %d: what the KV pool of %d blocks x %d tokens holds "
            "(raise engine.kv_cache_mib / engine.num_kv_blocks / engine.*_memory_utilization for more)",
            self.args.max_model_len,
            held,
            self.num_blocks,
            self.block_size,
        )
        args = dataclasses.replace(self.args, max_model_len=held)
        self.model.args = args  # one max_model_len for everything that reads the model's shape
        return args

    def prepare(self, batch: Batch) -> PreparedBatch:
        """Order: single-token items first (the backends' batched decode path), then chunks."""
        order = sorted(range(len(batch.items)), key=lambda i: batch.items[i][1] != 1)
        input_ids, positions, slots, tables, q_lens, kv_lens, sample_rows = [], [], [], [], [], [], []
        bs, stride = self.block_size, self.block_stride
        for i in order:
            seq, n = batch.items[i]
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # a decode: no per-token lists (most items of most steps)
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * stride + start % bs)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += [table[p // bs] * stride + p % bs for p in range(start, end)]
            tables.append(table)
            q_lens.append(n)
            kv_lens.append(end)
            if end == seq.num_tokens:  # this chunk reaches the end: sample the next token
                sample_rows.append(len(input_ids) - 1)
        width = max(len(t) for t in tables)
        cu_q = list(accumulate(q_lens, initial=0))
        cu_kv = list(accumulate(kv_lens, initial=0))
        meta = AttentionMetadata(
            q_lens=q_lens,
            kv_lens=kv_lens,
            num_single=q_lens.count(1),
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(padded_rows(tables, width), torch.int32).view(len(tables), width),
            kv_lens_t=self._to_device(kv_lens, torch.int32),
            cu_q=self._to_device(cu_q, torch.int32),
            cu_kv=self._to_device(cu_kv, torch.int32),
        )
        cached = after_cache(q_lens, kv_lens, meta.num_single) if isinstance(self.backend, TorchAttention) else []
        if cached:  # the SDPA backends' chunk indices: once a step, not once a layer
            meta.chunks = chunk_plan(q_lens, kv_lens, cached, self._to_device)
        ids = self._to_device(input_ids, torch.int64)
        return PreparedBatch(order, ids, self._to_device(positions, torch.int64), meta, sample_rows)

    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        """Host ints to the device, through an array (several times faster than torch.tensor of a
        list). On CUDA from pinned memory (the caching host allocator), so the copy is queued
        without waiting: the step's only host sync stays the sampled tokens."""
        code = ARRAY_CODES[dtype]
        if not len(data):
            host = torch.empty(0, dtype=dtype)
        else:  # an array of the right type already (padded_rows) is read as it is
            same = isinstance(data, array.array) and data.typecode == code
            host = torch.frombuffer(data if same else array.array(code, data), dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, prepared: PreparedBatch, after_layer=None) -> torch.Tensor:
        ids, pos, meta, rows = prepared.input_ids, prepared.positions, prepared.meta, prepared.sample_rows
        if self.graphs is not None and after_layer is None and self.graphs.fits(meta):
            hidden = self.graphs.run(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, self.backend, after_layer)
        if len(rows) < hidden.shape[0]:  # else every row, in order (a decode-only step)
            hidden = hidden[rows]
        return self.model.logits(hidden)  # (num sampled, vocab), float32

    def run(self, batch: Batch) -> tuple[list[int | None], torch.Tensor]:
        """Sampled token per batch item (None for a chunk that stops short of the sequence end),
        and the logits of the sampled rows in batch order."""
        prepared = self.prepare(batch)
        logits = self.forward(prepared)
        sampled = self.scatter(batch, prepared.order, self.sample(logits))
        sampled_order = [i for i in prepared.order if sampled[i] is not None]
        by_item = sorted(range(len(sampled_order)), key=lambda k: sampled_order[k])
        return sampled, logits[by_item]

    @staticmethod
    def scatter(batch: Batch, order: list[int], tokens: list[int]) -> list[int | None]:
        sampled: list[int | None] = [None] * len(batch.items)
        it = iter(tokens)
        for i in order:
            seq, n = batch.items[i]
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled[i] = next(it)
        return sampled

    @staticmethod
    def sample(logits: torch.Tensor) -> list[int]:
        return logits.argmax(dim=-1).tolist()  # the one host sync of a step

    # -- KV in and out, for the connector ----------------------------------------------------
    def _token_rows(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """Row of each token's K in layer 0 of the pool seen as rows of (Hkv, D); (layer, K or V) adds
        its slab's `_slab_offset`."""
        blocks = torch.tensor(block_table[: -(-num_tokens // self.block_size)], device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks[:, None] * self.block_stride + offsets).flatten()[:num_tokens]

    def _slab_offset(self, layer: int, kv: int) -> int:
        return (2 * layer + kv) * self.block_size

    def block_kv(self, block_id: int) -> torch.Tensor:
        """One block's KV, (layers, 2, block_size, Hkv, D): a contiguous view into the pool."""
        return self.kv_cache[block_id]

    def kv_shape(self, num_tokens: int, layer: int | None = None, heads: slice | None = None) -> tuple[int, ...]:
        """A part's shape; `heads`: a slice of this pool's KV heads (a tensor-parallel rank's piece)."""
        a = self.args
        num_heads = len(range(a.num_kv_heads)[heads]) if heads is not None else a.num_kv_heads
        per_layer = (num_tokens, num_heads, a.head_dim)
        return (2, *per_layer) if layer is not None else (2, a.num_layers, *per_layer)

    def _slabs(self, layer: int | None) -> list[tuple[int, int]]:
        layers = range(self.args.num_layers) if layer is None else [layer]
        return [(kv, i) for kv in range(2) for i in layers]

    def read_tokens(
        self,
        block_table: list[int],
        num_tokens: int,
        layer: int | None = None,
        out: torch.Tensor | None = None,
        start: int = 0,
        heads: slice | None = None,
    ) -> torch.Tensor:
        """The KV of tokens [start, start + num_tokens) packed into one buffer of `kv_shape`: per
        (K or V, layer), a plain row gather from the pool seen as rows of (Hkv, D); `heads`: only
        those of the pool's KV heads."""
        base = self._token_rows(block_table, start + num_tokens)[start:]
        out = (
            torch.empty(self.kv_shape(num_tokens, layer, heads), dtype=self.dtype, device=self.device)
            if out is None
            else out
        )
        rows = self._rows(heads)
        for kv, i in self._slabs(layer):
            torch.index_select(
                rows, 0, base + self._slab_offset(i, kv), out=out[kv] if layer is not None else out[kv, i]
            )
        return out

    def _rows(self, heads: slice | None) -> torch.Tensor:
        """The pool as rows of (Hkv, D), or a view of some of its heads (written through)."""
        rows = self.kv_cache.view(-1, *self.kv_cache.shape[-2:])
        return rows if heads is None else rows[:, heads]

    def write_tokens(
        self,
        block_table: list[int],
        data: torch.Tensor,
        layer: int | None = None,
        start: int = 0,
        heads: slice | None = None,
    ) -> None:
        base = self._token_rows(block_table, start + data.shape[-3])[start:]
        rows = self._rows(heads)
        for kv, i in self._slabs(layer):
            rows.index_copy_(0, base + self._slab_offset(i, kv), data[kv] if layer is not None else data[kv, i])


def decode_graphs_wanted(cuda_graphs: bool, backend: str, decodes: bool) -> bool:
    """Decode steps replay CUDA graphs where engine.cuda_graphs is on, the worker decodes (a
    prefill-only worker would never replay them: capture would cost start-up time and memory on a
    GPU it may share), and the backend is not torch (its static decode reads every sequence's
    whole table width: at long contexts and large batches that copy outgrows the memory)."""
    return bool(cuda_graphs) and decodes and backend != "torch"


def cuda_memory(device: torch.device, profiles) -> dict:
    """What a CUDA pool sized from the memory is planned from (kv_pool.pool_blocks): the weights as
    this process's allocator reserves them once its cache is released (reserved, not allocated:
    cached blocks are not free to other allocations), and the peak each of `profiles` (callables
    that run a step) allocates beyond them, summed (the CUDA-graph pool is held beside a step's)."""
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved(device)
    reserve = 0
    for profile in profiles:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        reserve += torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()  # the profile's activations go back: free for the pool to be counted
    free, total = torch.cuda.mem_get_info(device)
    return dict(free_bytes=free, total_bytes=total, used_bytes=used, reserve_bytes=reserve)


def padded_rows(rows: list[list[int]], width: int) -> array.array:
    """Lists of ints as one flat int32 array of rows `width` long, each padded with 0."""
    flat = array.array("i")
    for row in rows:
        flat.extend(row)
        flat.extend([0] * (width - len(row)))
    return flat


def layer_caches(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) views of each layer of a block-major pool, each (blocks, block_size, Hkv, D)."""
    return [(pool[:, i, 0], pool[:, i, 1]) for i in range(pool.shape[1])]
