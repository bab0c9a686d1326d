"""Paged attention backends: flash-attn when it imports and runs on this device, else torch SDPA.

The KV pool of one layer is a pair of tensors (num_blocks, block_size, num_kv_heads, head_dim),
the layout flash-attn's paged API expects. A batch packs every sequence's new tokens; sequences
with one new token (decodes, or prefill chunks of one token) come first, then longer chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from testbed.errors import ConfigError

try:  # a binary mismatch raises more than ImportError
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    FLASH_ATTN_AVAILABLE = True
except Exception:  # noqa: BLE001
    FLASH_ATTN_AVAILABLE = False

FLASH_BLOCK_MULTIPLE = 256  # upstream flash-attn's paged KV needs page sizes divisible by 256


@dataclass
class AttentionMetadata:
    """Host-side lengths (Python ints: no device sync to read them) plus device index tensors."""

    q_lens: list[int]  # new tokens per sequence; the first num_single entries are 1
    kv_lens: list[int]  # cached + new tokens per sequence after this step
    num_single: int  # leading sequences with exactly one new token
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    kv_lens_t: torch.Tensor  # (B,) int32
    cu_q: torch.Tensor  # (B + 1,) int32 prefix sums of q_lens
    cu_kv: torch.Tensor  # (B + 1,) int32 prefix sums of kv_lens


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: (T, Hkv, D) scattered into the flat (num_blocks * block_size, Hkv, D) view
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """SDPA on every device and dtype, with no per-sequence loop where it can be avoided:
    - decodes: one batched SDPA, the query heads of each KV head taken as its queries (no KV
      expansion for GQA), over each sequence's blocks copied out whole (index_select of blocks);
    - fresh prefills (nothing cached before the chunk) of equal length: one causal SDPA over the
      chunk's own K and V, straight from the projections;
    - the rest (chunks after a cached prefix): one SDPA per chunk over its gathered blocks."""

    name = "torch"

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, k=None, v=None) -> torch.Tensor:
        # q: (T, H, D) -> out (T, H, D); k, v: this step's new (T, Hkv, D), when the caller has them
        out = torch.empty_like(q)
        n = meta.num_single
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta)
        starts = list(accumulate(meta.q_lens[n:], initial=n))  # first row of each chunk
        fresh: dict[int, list[int]] = {}  # q_len -> items with nothing cached before the chunk
        for i in range(n, len(meta.q_lens)):
            if k is not None and meta.kv_lens[i] == meta.q_lens[i]:
                fresh.setdefault(meta.q_lens[i], []).append(i)
            else:
                rows = slice(starts[i - n], starts[i - n + 1])
                out[rows] = self._chunk(q[rows], k_cache, v_cache, meta, i)
        for q_len, items in fresh.items():
            rows = torch.cat([torch.arange(starts[i - n], starts[i - n] + q_len) for i in items]).to(q.device)
            out[rows] = self._fresh(q[rows], k[rows], v[rows], len(items), q_len)
        return out

    @staticmethod
    def _blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        # (num_blocks, bs, Hkv, D) and (B, nblocks) -> (B, nblocks * bs, Hkv, D): whole blocks copied
        rows = torch.index_select(cache.flatten(1), 0, tables.flatten().long())
        return rows.view(*tables.shape, *cache.shape[1:]).flatten(1, 2)

    def _decode(self, q, k_cache, v_cache, meta):
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        tables = meta.block_tables[:n, : -(-max(meta.kv_lens[:n]) // k_cache.shape[1])]
        k = self._blocks(k_cache, tables).transpose(1, 2)  # (n, Hkv, S, D)
        v = self._blocks(v_cache, tables).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        mask = None
        if min(meta.kv_lens[:n]) < k.shape[2]:
            mask = (positions[None, :] < meta.kv_lens_t[:n, None])[:, None, None, :]  # (n, 1, 1, S)
        # GQA without expanding K and V: the g = H / Hkv query heads of a KV head are its g queries
        o = F.scaled_dot_product_attention(q.view(n, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask)
        return o.reshape(n, heads, dim)

    @staticmethod
    def _fresh(q, k, v, batch: int, q_len: int):
        # (batch * L, H, D) of equal-length chunks with no cached prefix: plain causal attention
        def heads_first(x):
            return x.view(batch, q_len, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(batch * q_len, *q.shape[1:])

    def _chunk(self, q, k_cache, v_cache, meta, i):
        q_len, kv_len = meta.q_lens[i], meta.kv_lens[i]
        table = meta.block_tables[i : i + 1, : -(-kv_len // k_cache.shape[1])]
        k = self._blocks(k_cache, table)[0, :kv_len].transpose(0, 1)  # (Hkv, S, D)
        v = self._blocks(v_cache, table)[0, :kv_len].transpose(0, 1)
        # lower-right causal: query j sees keys up to kv_len - q_len + j (SDPA's is_causal is top-left)
        rows = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
        return o.transpose(0, 1)


class FlashAttention:
    """flash-attn: paged decode with flash_attn_with_kvcache, paged varlen for prefill chunks."""

    name = "flash"

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, k=None, v=None) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_single
        if n:
            out[:n] = flash_attn_with_kvcache(
                q[:n, None], k_cache, v_cache, cache_seqlens=meta.kv_lens_t[:n],
                block_table=meta.block_tables[:n], causal=True)[:, 0]
        if n < len(meta.q_lens):
            cu_q = meta.cu_q[n:] - meta.cu_q[n]
            cu_kv = meta.cu_kv[n:] - meta.cu_kv[n]
            out[n:] = flash_attn_varlen_func(
                q[n:], k_cache, v_cache, cu_q, cu_kv, max(meta.q_lens[n:]), max(meta.kv_lens[n:]),
                causal=True, block_table=meta.block_tables[n:])
        return out


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int):
    """`auto` takes flash-attn where it can run (CUDA, half precision, 256-multiple pages)."""
    flash_ok = FLASH_ATTN_AVAILABLE and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        requested = "flash" if flash_ok and block_size % FLASH_BLOCK_MULTIPLE == 0 else "torch"
    if requested == "torch":
        return TorchAttention()
    if requested != "flash":
        raise ConfigError(f"engine.attention_backend={requested!r} is not one of auto, flash, torch")
    if not flash_ok or block_size % FLASH_BLOCK_MULTIPLE:
        raise ConfigError(
            f"engine.attention_backend=flash needs flash-attn (importable: {FLASH_ATTN_AVAILABLE}), a CUDA "
            f"device in fp16/bf16 (got {device.type}/{str(dtype).removeprefix('torch.')}) and engine.block_size "
            f"divisible by {FLASH_BLOCK_MULTIPLE} (got {block_size}); engine.attention_backend=torch works everywhere")
    return FlashAttention()
