"""Whole KV blocks copied from one pool into another in one Triton launch (the ipc transport on CUDA
when P and D share a GPU).

A pool is block-major, (blocks, layers, 2, block_size, Hkv, D): block b is one contiguous span, and
so is each layer's K and V within it. Copied block by block with torch, a request is one kernel
launch per run of consecutive blocks, and on one GPU the host issuing those launches is slower than
HBM copying the bytes. Here one launch copies every (block pair, slab, tile) of a write. Peer copies
(D on another GPU) stay with torch: there NVLink, not the launches, bounds the copy, and a kernel
writing into another GPU's memory needs peer access this module does not set up.
"""

from __future__ import annotations  # kernel annotations stay strings: the module imports without triton

import contextlib
import os
from typing import Optional

import torch

try:  # a binary mismatch raises more than ImportError
    import triton
    import triton.language as tl
    from triton.runtime import JITFunction

    AVAILABLE = int(triton.__version__.split(".")[0]) >= 3
except Exception:  # noqa: BLE001
    triton = tl = JITFunction = None
    AVAILABLE = False

TILE = 4096  # elements per program: 8 KiB of bf16
# the integers vary by pool and layer: not specialised on, so one compile serves every write of a
# dtype and block shape, and `warm_up` can make it before the first timed copy. Offsets are
# block x BLOCK + layer x CHUNK, both compile-time constants: the compiler sees them aligned and
# vectorises the loads and stores.
_INTS = ["num_pairs", "layer"]
_jit = triton.jit(do_not_specialize=_INTS) if AVAILABLE else (lambda fn: fn)


def usable(device) -> bool:
    """True on CUDA when triton imports; on CPU only under triton's interpreter (as for
    testbed/model/paged_decode.py: TRITON_INTERPRET=1 before triton is first imported)."""
    device = torch.device(device)
    if not AVAILABLE or device.type not in ("cuda", "cpu"):
        return False
    return device.type == "cuda" or (
        os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(_copy_kernel, JITFunction)
    )


@_jit
def _copy_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    num_pairs,
    layer,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,
    TILE: tl.constexpr,
):
    # one program: TILE elements of the CHUNK copied for one block pair (a whole block, or one layer's K and V)
    pair, tile = tl.program_id(0) // TILES, tl.program_id(0) % TILES
    s = tl.load(ids_ptr + pair).to(tl.int64)  # int64: a large pool's offsets pass 2**31
    d = tl.load(ids_ptr + num_pairs + pair).to(tl.int64)
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < CHUNK
    x = tl.load(src_ptr + s * BLOCK + layer * CHUNK + offs, mask=mask)
    tl.store(dst_ptr + d * BLOCK + layer * CHUNK + offs, x, mask=mask)


def copy_blocks(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids: list[int], dst_ids: list[int], layer: Optional[int] = None
) -> None:
    """dst_pool's blocks dst_ids[i] := src_pool's blocks src_ids[i], every layer or one, in one launch
    on the pools' device (both contiguous, on the same device, of one dtype and block shape)."""
    _check(src_pool, dst_pool, src_ids, dst_ids, layer)
    if not src_ids:
        return
    block = src_pool[0].numel()
    chunk = block if layer is None else src_pool[0, 0].numel()
    tiles = triton.cdiv(chunk, TILE)
    # one host-to-device copy; a row read by index, not a second tensor whose alignment varies with n
    # (triton compiles per pointer alignment)
    ids = torch.tensor(src_ids + dst_ids, dtype=torch.int64).to(src_pool.device, non_blocking=True)
    on_device = torch.cuda.device(src_pool.device) if src_pool.is_cuda else contextlib.nullcontext()
    with on_device:  # triton launches on the current device
        _copy_kernel[(len(src_ids) * tiles,)](
            src_pool, dst_pool, ids, len(src_ids), layer or 0, BLOCK=block, CHUNK=chunk, TILES=tiles, TILE=TILE
        )


def _check(src_pool, dst_pool, src_ids: list[int], dst_ids: list[int], layer: Optional[int]) -> None:
    """A wrong id would write past D's pool through the mapping, silently: refuse it first."""
    if src_pool.device != dst_pool.device or src_pool.dtype != dst_pool.dtype:
        raise ValueError(
            f"block copy needs one device and dtype, got {src_pool.device}/{src_pool.dtype} "
            f"and {dst_pool.device}/{dst_pool.dtype}"
        )
    if not (src_pool.is_contiguous() and dst_pool.is_contiguous()) or src_pool.shape[1:] != dst_pool.shape[1:]:
        raise ValueError(
            f"block copy needs contiguous pools of one layout, got {tuple(src_pool.shape)} and {tuple(dst_pool.shape)}"
        )
    if len(src_ids) != len(dst_ids) or (layer is not None and not 0 <= layer < src_pool.shape[1]):
        raise ValueError(
            f"block copy: {len(src_ids)} source and {len(dst_ids)} destination blocks, layer {layer} "
            f"of {src_pool.shape[1]}"
        )
    for ids, pool, side in ((src_ids, src_pool, "source"), (dst_ids, dst_pool, "destination")):
        if ids and not (0 <= min(ids) and max(ids) < pool.shape[0]):
            raise ValueError(f"block copy: {side} blocks {min(ids)}..{max(ids)} outside 0..{pool.shape[0] - 1}")


def warm_up(pool: torch.Tensor) -> None:
    """Compile the kernel for this pool's dtype and block shape (both modes), on two blocks of scratch."""
    scratch = torch.zeros(2, *pool.shape[1:], dtype=pool.dtype, device=pool.device)
    for layer in (None, 0):
        copy_blocks(scratch, scratch, [0], [1], layer)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
