"""Paged decode attention in Triton, for CUDA devices where flash-attn does not run.

One new query token per sequence attends to that sequence's cached K and V. The kernel reads them
straight out of the block pool through the block table. It makes no gathered or padded copy, and
it never reads a device tensor on the host, so it can be captured in a CUDA graph. Each program
handles one (sequence, KV head, split). The g = H / Hkv query heads that share the KV head are the
rows of one tile, so each K/V block is loaded once per KV head. Scores, softmax and the weighted
sum of V are in float32, with an online (running max) softmax in base 2.
"""

from __future__ import annotations  # kernel annotations stay strings: the module imports without triton

import functools
import math
import os

import torch

try:  # a binary mismatch raises more than ImportError
    import triton
    import triton.language as tl
    from triton.runtime import JITFunction

    AVAILABLE = int(triton.__version__.split(".")[0]) >= 3  # 3.0 (torch 2.4): tl.dot's input_precision
except Exception:  # noqa: BLE001
    triton = tl = JITFunction = None
    AVAILABLE = False

TILE = 64  # KV tokens per loop step; a tile may span blocks (each token looks up its own block)
MIN_ROWS = 16  # the query group is padded to at least 16 rows: see the tl.dot note in _decode_kernel
# SPLITS is a compile-time constant, so each value is a kernel variant: only these few, all compiled
# by `warm_up` before serving, so no JIT compile lands in a timed step
SPLIT_BUCKETS = (1, 2, 4, 8, 16)
MAX_SPLITS = SPLIT_BUCKETS[-1]
# strides vary with the batch (a block table's width) and the pool: triton would specialise each
# on == 1 and % 16, a compile per new combination; not specialised, one compile serves them all
_STRIDES = [
    "stride_qn",
    "stride_qh",
    "stride_kb",
    "stride_ks",
    "stride_kh",
    "stride_vb",
    "stride_vs",
    "stride_vh",
    "stride_tn",
    "stride_on",
    "stride_oh",
]


def _jit(*strides: str):
    # names only of the kernel's own parameters (triton 3.0 looks each up); without triton: plain, never called
    return triton.jit(do_not_specialize=list(strides)) if AVAILABLE else (lambda fn: fn)


_launched: set = set()  # variant keys launched in this process (`jit_compiles`)


def usable(device) -> bool:
    """True on CUDA when triton imports; on CPU only under triton's interpreter. That needs
    TRITON_INTERPRET=1 set before triton is first imported, not just before a kernel is decorated:
    triton.language jits its own helpers (tl.sum, tl.max, tl.cdiv) on import, and an interpreted
    kernel cannot call compiled ones ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    device = torch.device(device)
    if not AVAILABLE or device.type not in ("cuda", "cpu"):
        return False
    return device.type == "cuda" or (
        os.environ.get("TRITON_INTERPRET") == "1"
        and not isinstance(tl.cdiv, JITFunction)
        and not isinstance(_decode_kernel, JITFunction)
    )


@_jit(*_STRIDES)
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    scale,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tn,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + rows; rows >= GROUP are padding
    dims = tl.arange(0, DIM_PAD)  # dims >= HEAD_DIM pad head_dim up to a power of two (tl.arange needs one)
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_qn + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)  # (GROUP_PAD, DIM_PAD)
    if DOT_FP32:  # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584): fp32 operands there
        q = q.to(tl.float32)

    # this split's share of the sequence in whole tiles, from the length read here on the device
    kv_len = tl.load(lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, TILE), SPLITS)
    start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, kv_len)  # start >= end: an empty split

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max score (base 2)
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)  # running sum of exp2(score - m) * v
    offs = tl.arange(0, TILE)
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs
        ok = pos < end
        # int64 block ids: block * stride passes 2**31 elements in a large pool
        block = tl.load(table_ptr + seq * stride_tn + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_ok = ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=kv_ok,
            other=0.0,
        )  # (TILE, DIM_PAD)
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=kv_ok,
            other=0.0,
        )
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # tl.dot rather than a broadcast multiply and sum: the broadcast's (GROUP, TILE, DIM) product
        # lives in registers and spills on GPU, and tl.dot runs on the tensor cores. Their tile is
        # 16 rows high anyway, and older triton releases assert M >= 16, hence the padded rows (free:
        # their q loads are masked, and the kernel is bound by K/V reads). The interpreter runs tl.dot
        # with numpy. fp32 caches take "ieee": tf32 would leave the torch backend's results by ~1e-3.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (GROUP_PAD, TILE)
        s = tl.where(ok[None, :], s, float("-inf"))
        # each tile holds a valid token, so m_new is finite: no inf - inf, alpha is 0 on the first tile
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if SPLITS == 1:  # normalize here; an empty sequence (l == 0) writes zeros rather than 0 / 0
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(
            out_ptr + seq * stride_on + heads[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:  # unnormalized partials for _reduce_kernel: part (n, H, SPLITS, DIM_PAD), stats (n, H, SPLITS, 2)
        idx = (seq * tl.num_programs(1) * GROUP + heads) * SPLITS + split  # (GROUP_PAD,)
        tl.store(part_ptr + idx[:, None] * DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + idx * 2, m, mask=row_ok)
        tl.store(stats_ptr + idx * 2 + 1, l, mask=row_ok)


@_jit("stride_on", "stride_oh")
def _reduce_kernel(
    part_ptr,
    stats_ptr,
    out_ptr,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # one program per (sequence, query head): rescale each split's partials to the common max and sum
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, SPLITS_PAD), tl.arange(0, DIM_PAD)
    idx = (seq * tl.num_programs(1) + head) * SPLITS + splits
    ok = splits < SPLITS
    m = tl.load(stats_ptr + idx * 2, mask=ok, other=float("-inf"))  # -inf for empty and padded splits
    l = tl.load(stats_ptr + idx * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(part_ptr + idx[:, None] * DIM_PAD + dims[None, :], mask=ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # 0 for empty splits; all empty: no NaN
    total = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_on + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def bucket(splits: int) -> int:
    """The largest of SPLIT_BUCKETS not above `splits` (at least 1): the variant that runs."""
    return max(b for b in SPLIT_BUCKETS if b <= max(1, splits))


def default_splits(n: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits over the KV length from shapes only (a captured graph keeps them): enough programs for
    two per multiprocessor when n * Hkv is small, each split with at least 4 tiles of a full table,
    rounded down to a bucket."""
    want = -(-2 * _multiprocessors(device) // max(1, n * kv_heads))
    return bucket(min(want, MAX_SPLITS, max_len // (4 * TILE)))


def _compiled(fn) -> int | None:
    """Variants in a jitted kernel's in-memory cache (triton 3.3+: device_caches; 3.0-3.2: cache);
    None where not readable (the interpreter compiles nothing)."""
    caches = getattr(fn, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(c[0]) for c in caches.values())
    cache = getattr(fn, "cache", None)
    if isinstance(cache, dict):
        return sum(len(c) for c in cache.values())
    return None


def jit_compiles() -> int:
    """Kernel variants compiled in this process so far: the JIT caches' sizes where readable (CUDA),
    else the variants launched (each one's first launch is where the JIT would compile it)."""
    counts = [_compiled(fn) for fn in (_decode_kernel, _reduce_kernel)] if AVAILABLE else [None]
    if None not in counts:
        return sum(counts)
    return len(_launched) + sum(1 for key in _launched if key[-1] > 1)  # a split variant runs the reduce too


def variants(max_splits: int = MAX_SPLITS) -> list[tuple[str, int]]:
    """The fixed variant set: (kernel, SPLITS) for one model shape, dtype and block size."""
    splits = [b for b in SPLIT_BUCKETS if b <= max_splits]
    return [("decode", s) for s in splits] + [("reduce", s) for s in splits if s > 1]


def warm_up(k_cache, v_cache, num_heads: int, dtype: torch.dtype) -> None:
    """Compile every variant for these caches (one layer's) and query dtype: a one-token decode per
    bucket, reading block 0 and writing only scratch outputs."""
    if not usable(k_cache.device):
        return
    q = torch.zeros(1, num_heads, k_cache.shape[3], dtype=dtype, device=k_cache.device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=k_cache.device)
    lens = torch.ones(1, dtype=torch.int32, device=k_cache.device)
    for splits in SPLIT_BUCKETS:
        paged_decode(q, k_cache, v_cache, table, lens, num_splits=splits)
    if k_cache.device.type == "cuda":
        torch.cuda.synchronize(k_cache.device)


def paged_decode(q, k_cache, v_cache, block_tables, kv_lens, scale=None, num_splits=None) -> torch.Tensor:
    """q (n, H, D); k_cache, v_cache (num_blocks, block_size, Hkv, D); block_tables (n, max_blocks)
    int32 padded with 0; kv_lens (n,) int32 cached tokens including the new one -> (n, H, D) in q's
    dtype. kv_len 0 gives zeros. num_splits: None picks default_splits; any value gives the same output
    (rounded down to a bucket of SPLIT_BUCKETS)."""
    if not AVAILABLE:
        raise RuntimeError("paged_decode needs triton, which does not import here")
    if not usable(q.device):
        raise RuntimeError(
            f"paged_decode runs on CUDA, or on CPU under TRITON_INTERPRET=1 set before triton is "
            f"imported; got {q.device.type}"
        )
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_decode needs the last dimension of q, the caches and block_tables contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    group = heads // kv_heads
    splits = (
        bucket(num_splits) if num_splits else default_splits(n, kv_heads, block_tables.shape[1] * block_size, q.device)
    )
    _launched.add((q.device.type, q.dtype, k_cache.dtype, group, dim, block_size, splits))
    dim_pad = triton.next_power_of_2(dim)
    scale = (1.0 / math.sqrt(dim) if scale is None else scale) * math.log2(math.e)  # the softmax runs in base 2
    part = stats = out  # unused when splits == 1
    if splits > 1:
        part = torch.empty((n, heads, splits, dim_pad), dtype=torch.float32, device=q.device)
        stats = torch.empty((n, heads, splits, 2), dtype=torch.float32, device=q.device)
    _decode_kernel[(n, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        out,
        part,
        stats,
        scale,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE=TILE,
        SPLITS=splits,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",  # tf32 only matters for fp32 inputs
        DOT_FP32=not isinstance(_decode_kernel, JITFunction),  # interpreted: bf16 operands upcast
        num_warps=8 if dim_pad >= 256 else 4,
    )  # head_dim 256 on 4 warps fills all 255 registers (ptxas, sm_90)
    if splits > 1:
        _reduce_kernel[(n, heads)](
            part,
            stats,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=dim,
            DIM_PAD=dim_pad,
            SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
