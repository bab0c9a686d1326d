"""Paged attention backends: flash-attn where it imports and runs (CUDA, fp16/bf16, 256-token
blocks), else a Triton paged decode kernel beside SDPA's fused prefill (CUDA with Triton); on CPU in
float32 a C paged decode kernel beside SDPA's prefill (where a C compiler builds it); else torch
SDPA everywhere.

The KV cache of one layer is a pair of tensors (num_blocks, block_size, num_kv_heads, head_dim),
the layout flash-attn's paged API expects; each may be a layer's view of a block-major pool (one
block of every layer contiguous), where one block starts `block_stride` rows after the previous. A batch packs
every sequence's new tokens; sequences
with one new token (decodes, or prefill chunks of one token) come first, then longer chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F

from testbed.errors import ConfigError
from testbed.model import cpu_ops, paged_decode
from testbed.model.kv_layout import ATTENTION_BACKENDS, FLASH_BLOCK_MULTIPLE
from testbed.model.ops import CpuOps, TorchOps

try:  # a binary mismatch raises more than ImportError
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    FLASH_ATTN_AVAILABLE = True
except Exception:  # noqa: BLE001
    FLASH_ATTN_AVAILABLE = False


@dataclass
class AttentionMetadata:
    """Host-side lengths (Python ints: no device sync to read them) plus device index tensors."""

    q_lens: list[int]  # new tokens per sequence; the first num_single entries are 1
    kv_lens: list[int]  # cached + new tokens per sequence after this step
    num_single: int  # leading sequences with exactly one new token
    # (T,) int64: each new token's row in its layer's cache seen as rows of (Hkv, D) (`cache_rows`):
    # block_id * block_stride + offset; block_stride is block_size for a cache of its own
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    kv_lens_t: torch.Tensor  # (B,) int32
    cu_q: torch.Tensor  # (B + 1,) int32 prefix sums of q_lens
    cu_kv: torch.Tensor  # (B + 1,) int32 prefix sums of kv_lens
    # decode shapes fixed by the tensors alone (no host lengths): what a captured CUDA graph replays
    static: bool = False
    # the chunks after cached KV and their index tensors, built once per step (ModelRunner.prepare);
    # None: built where needed (a caller that makes its own metadata)
    chunks: "ChunkPlan | None" = None


@dataclass
class ChunkPlan:
    """What TorchAttention gathers the chunks that follow cached KV with (one masked SDPA for all):
    built once per step, copied from pinned memory without a sync. Per layer, two pageable copies
    and two boolean-mask indexings each stalled the host on CUDA."""

    items: list[int]  # the chunks' items in the step
    items_t: torch.Tensor  # (B,) int64: the same, to pick their rows of block_tables
    rows: torch.Tensor | slice  # their query rows in the step
    real: torch.Tensor  # (sum of q_lens,) int64: each query row's place in the padded (B x max_q) layout
    q_lens_t: torch.Tensor  # (B,) int64
    kv_lens_t: torch.Tensor  # (B,) int64
    max_q: int


def host_to(device) -> Callable[[list[int], torch.dtype], torch.Tensor]:
    """A plain copy of host ints to `device` (ModelRunner has a pinned, non-blocking one)."""
    return lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)


def after_cache(q_lens: list[int], kv_lens: list[int], num_single: int) -> list[int]:
    """The items whose chunk follows KV already in the pool (the rest are decodes and fresh prompts)."""
    return [i for i in range(num_single, len(q_lens)) if kv_lens[i] != q_lens[i]]


def chunk_plan(q_lens: list[int], kv_lens: list[int], items: list[int], to_device) -> ChunkPlan:
    """The plan of the chunks of `items`; `to_device(ints, dtype)` copies host ints to the step's device."""
    starts = list(accumulate(q_lens, initial=0))
    lens = [q_lens[i] for i in items]
    max_q = max(lens)
    real = [b * max_q + j for b, n in enumerate(lens) for j in range(n)]
    return ChunkPlan(
        items,
        to_device(items, torch.int64),
        row_index([starts[i] for i in items], lens, to_device),
        to_device(real, torch.int64),
        to_device(lens, torch.int64),
        to_device([kv_lens[i] for i in items], torch.int64),
        max_q,
    )


def row_index(starts: list[int], lens: list[int], to_device) -> torch.Tensor | slice:
    """Rows [start, start + len) of each item: a slice when they follow one another (a whole-batch
    prefill), so reading and writing them copies nothing; else an index tensor."""
    if all(a + n == b for a, n, b in zip(starts, lens, starts[1:])):
        return slice(starts[0], starts[-1] + lens[-1])
    return to_device([r for a, n in zip(starts, lens) for r in range(a, a + n)], torch.int64)


def block_stride(cache: torch.Tensor) -> int:
    """Rows of (Hkv, D) from one block's start to the next's in a (num_blocks, block_size, Hkv, D)
    cache: block_size when it is a tensor of its own, layers x 2 x block_size in a block-major pool."""
    return cache.stride(0) // cache.stride(1)


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as rows of (Hkv, D) from its first element, other layers' rows included: the
    view slot_mapping indexes (a layer's view of a block-major pool has no flat view of its own)."""
    rows = (cache.shape[0] - 1) * block_stride(cache) + cache.shape[1]
    return cache.as_strided((rows, *cache.shape[2:]), cache.stride()[1:])


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k, v: (T, Hkv, D) scattered into the caches' rows
    cache_rows(k_cache).index_copy_(0, slot_mapping, k)
    cache_rows(v_cache).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """SDPA on every device and dtype, with no per-sequence loop where it can be avoided:
    - decodes: one batched SDPA, the query heads of each KV head taken as its queries (no KV
      expansion for GQA), over each sequence's blocks copied out whole (index_select of blocks);
    - fresh prefills (nothing cached before the chunk) of equal length: one causal SDPA over the
      chunk's own K and V, straight from the projections;
    - the rest (chunks after a cached prefix): one SDPA per chunk over its gathered blocks."""

    name = "torch"
    ops = TorchOps  # the elementwise steps of the forward around this backend's attention

    def warm_up(self, k_cache, v_cache, num_heads: int, dtype: torch.dtype) -> None:
        """Compile what a first timed step would (the JIT kernels' every variant); nothing here."""

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, k=None, v=None) -> torch.Tensor:
        # q: (T, H, D) -> out (T, H, D); k, v: this step's new (T, Hkv, D), when the caller has them
        out = torch.empty_like(q)
        n = meta.num_single
        if n:
            out[:n] = self.decode(q[:n], k_cache, v_cache, meta)
        starts = list(accumulate(meta.q_lens[n:], initial=n))  # first row of each chunk
        fresh: dict[int, list[int]] = {}  # q_len -> items with nothing cached before the chunk
        cached: list[int] = []  # items whose chunk follows KV already in the pool
        for i in range(n, len(meta.q_lens)):
            if k is not None and meta.kv_lens[i] == meta.q_lens[i]:
                fresh.setdefault(meta.q_lens[i], []).append(i)
            else:
                cached.append(i)
        for q_len, items in fresh.items():
            rows = row_index([starts[i - n] for i in items], [q_len] * len(items), host_to(q.device))
            out[rows] = self._fresh(q[rows], k[rows], v[rows], len(items), q_len)
        if cached:
            plan = meta.chunks
            if plan is None or plan.items != cached:  # no plan from prepare (a caller's own metadata)
                plan = chunk_plan(meta.q_lens, meta.kv_lens, cached, host_to(q.device))
            out[plan.rows] = self._chunks(q[plan.rows], k_cache, v_cache, meta, plan)
        return out

    @staticmethod
    def _blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        # (num_blocks, bs, Hkv, D) and (B, nblocks) -> (B, nblocks * bs, Hkv, D): whole blocks copied
        rows = torch.index_select(cache.flatten(1), 0, tables.flatten().long())
        return rows.view(*tables.shape, *cache.shape[1:]).flatten(1, 2)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        # static: every block of the table (a captured graph's shapes cannot follow the lengths)
        width = meta.block_tables.shape[1] if meta.static else -(-max(meta.kv_lens[:n]) // k_cache.shape[1])
        tables = meta.block_tables[:n, :width]
        k = self._blocks(k_cache, tables).transpose(1, 2)  # (n, Hkv, S, D)
        v = self._blocks(v_cache, tables).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        mask = None
        if meta.static or min(meta.kv_lens[:n]) < k.shape[2]:
            mask = (positions[None, :] < meta.kv_lens_t[:n, None])[:, None, None, :]  # (n, 1, 1, S)
        # GQA without expanding K and V: the g = H / Hkv query heads of a KV head are its g queries
        o = F.scaled_dot_product_attention(q.view(n, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask)
        return o.reshape(n, heads, dim)

    @staticmethod
    def _fresh(q, k, v, batch: int, q_len: int):
        # (batch * L, H, D) of equal-length chunks with no cached prefix: plain causal attention
        def heads_first(x):
            return x.view(batch, q_len, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(batch * q_len, *q.shape[1:])

    def _chunks(self, q, k_cache, v_cache, meta, plan: ChunkPlan):
        """Chunks that follow cached KV, one SDPA for all: queries padded to the longest chunk,
        keys to the longest context, a lower-right causal mask per sequence (SDPA's is_causal is
        top-left). Padded query rows see their sequence's keys, so no row is all masked (NaN).
        Index tensors only (the plan's), no boolean-mask indexing: nothing here waits on the device."""
        width = -(-max(meta.kv_lens[i] for i in plan.items) // k_cache.shape[1])
        tables = meta.block_tables.index_select(0, plan.items_t)[:, :width]
        k = self._blocks(k_cache, tables).transpose(1, 2)  # (B, Hkv, S, D)
        v = self._blocks(v_cache, tables).transpose(1, 2)
        batch, lq, device = len(plan.items), plan.max_q, q.device
        padded = q.new_zeros(batch * lq, *q.shape[1:]).index_copy_(0, plan.real, q).view(batch, lq, *q.shape[1:])
        qlen_t, kvlen_t = plan.q_lens_t[:, None, None], plan.kv_lens_t[:, None, None]
        rows = torch.arange(lq, device=device)[None, :, None] + (kvlen_t - qlen_t)  # (B, Lq, 1) last key seen
        keys = torch.arange(k.shape[2], device=device)[None, None, :]
        mask = (keys <= rows) & (keys < kvlen_t)  # (B, Lq, S)
        o = F.scaled_dot_product_attention(padded.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True)
        return o.transpose(1, 2).reshape(batch * lq, *q.shape[1:]).index_select(0, plan.real)


class FlashAttention:
    """flash-attn: paged decode with flash_attn_with_kvcache, paged varlen for prefill chunks."""

    name = "flash"
    ops = TorchOps
    warm_up = TorchAttention.warm_up  # prebuilt kernels: nothing to compile

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, k=None, v=None) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_single
        if n:
            out[:n] = flash_attn_with_kvcache(
                q[:n, None],
                k_cache,
                v_cache,
                cache_seqlens=meta.kv_lens_t[:n],
                block_table=meta.block_tables[:n],
                causal=True,
            )[:, 0]
        if n < len(meta.q_lens):
            cu_q = meta.cu_q[n:] - meta.cu_q[n]
            cu_kv = meta.cu_kv[n:] - meta.cu_kv[n]
            out[n:] = flash_attn_varlen_func(
                q[n:],
                k_cache,
                v_cache,
                cu_q,
                cu_kv,
                max(meta.q_lens[n:]),
                max(meta.kv_lens[n:]),
                causal=True,
                block_table=meta.block_tables[n:],
            )
        return out


class KernelAttention(TorchAttention):
    """Decodes through a paged kernel that reads K and V in place through the block table;
    prefills and chunks as TorchAttention (SDPA's fused kernels). Each backend names its kernel:
    (q, k_cache, v_cache, block_tables, kv_lens) -> out, as a staticmethod."""

    kernel: Callable[..., torch.Tensor]

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = q.shape[0]
        return self.kernel(q, k_cache, v_cache, meta.block_tables[:n], meta.kv_lens_t[:n])


class TritonAttention(KernelAttention):
    """The Triton paged decode kernel (testbed/model/paged_decode.py), graph-safe."""

    name = "triton"
    kernel = staticmethod(paged_decode.paged_decode)

    def warm_up(self, k_cache, v_cache, num_heads: int, dtype: torch.dtype) -> None:
        paged_decode.warm_up(k_cache, v_cache, num_heads, dtype)  # every SPLITS bucket


class CpuAttention(KernelAttention):
    """The C paged decode kernel and elementwise steps (testbed/model/cpu_ops.py)."""

    name = "cpu"
    ops = CpuOps
    kernel = staticmethod(cpu_ops.paged_decode)


def jit_compiles() -> int:
    """Attention kernel variants JIT-compiled in this process so far (testbed/model/paged_decode.py);
    a count that grows during a timed step means a compile landed in it."""
    return paged_decode.jit_compiles() if paged_decode.AVAILABLE else 0


def select_backend(
    requested: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int | None = None
):
    """`auto`: flash-attn where it can run (CUDA, half precision, 256-multiple pages), else the
    Triton decode kernel on CUDA, else the C decode kernel on CPU in float32, else torch SDPA."""
    flash_ok = FLASH_ATTN_AVAILABLE and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        if flash_ok and block_size % FLASH_BLOCK_MULTIPLE == 0:
            requested = "flash"
        else:
            requested = (
                "triton"
                if device.type == "cuda" and paged_decode.usable(device)
                else "cpu"
                if cpu_ops.supports(device, dtype, head_dim)
                else "torch"
            )
    if requested == "torch":
        return TorchAttention()
    if requested == "cpu":
        if not cpu_ops.supports(device, dtype, head_dim):
            why = cpu_ops.unavailable_reason()
            raise ConfigError(
                f"engine.attention_backend=cpu needs a CPU device in float32 with head_dim in "
                f"{cpu_ops.HEAD_DIMS} and a C compiler (got {device.type}/"
                f"{str(dtype).removeprefix('torch.')}, head_dim {head_dim}{'; ' + why if why else ''}); "
                "engine.attention_backend=torch works everywhere"
            )
        return CpuAttention()
    if requested == "triton":
        if not paged_decode.usable(device):
            raise ConfigError(
                f"engine.attention_backend=triton needs triton on a CUDA device (importable: "
                f"{paged_decode.AVAILABLE}, device {device.type}); engine.attention_backend=torch "
                "works everywhere"
            )
        return TritonAttention()
    if requested != "flash":
        raise ConfigError(f"engine.attention_backend={requested!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if not flash_ok or block_size % FLASH_BLOCK_MULTIPLE:
        raise ConfigError(
            f"engine.attention_backend=flash needs flash-attn (importable: {FLASH_ATTN_AVAILABLE}), a CUDA "
            f"device in fp16/bf16 (got {device.type}/{str(dtype).removeprefix('torch.')}) and engine.block_size "
            f"divisible by {FLASH_BLOCK_MULTIPLE} (got {block_size}); engine.attention_backend=torch works everywhere"
        )
    return FlashAttention()
