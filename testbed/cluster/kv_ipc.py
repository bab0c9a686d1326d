"""The ipc KV transport (kv_transfer.backend=ipc): P writes a prompt's KV straight into the blocks
D reserved, through D's KV pool mapped into P's address space.

    D at start: export its pool once (KVPoolExport to every P)    P: attach it (KVPoolAttached)
    D: Reserve -> blocks -> Ready(blocks) to P                      P: KVBegin, then copy its blocks
                                                                       into D's, synchronise, KVDone
    D: KVDone -> install (no unpack)

One copy, no staging buffer on either side. The pools are block-major (ModelRunner.kv_cache): a
block's KV of every layer is one contiguous span, and runs of consecutive block ids on both sides
become one contiguous copy each; with P and D on one GPU, one Triton launch copies them all. On CPU the
pool lives in a shared-memory file (removed once every P has mapped it, so a killed run leaves
nothing behind); on CUDA it is exported with a CUDA IPC handle (P and D on one GPU, or on two with
peer access: NVLink). KVDone leaves only after the copy's stream is synchronised, so D never reads
a block P is still writing.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

from testbed.cluster import block_copy

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolHandle:
    """What P needs to map D's pool: a shared-memory file (CPU) or a pickled CUDA IPC handle."""

    kind: str  # shm | cuda
    shape: tuple
    dtype: str
    path: str = ""  # shm: the file
    payload: bytes = b""  # cuda: torch's (rebuild function, arguments) for the pool's storage


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def shared_pool(shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, PoolHandle]:
    """A zeroed CPU tensor backed by a shared-memory file another process can map."""
    directory = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="testbed-kv-", dir=directory)
    numel = 1
    for n in shape:
        numel *= n
    try:
        os.ftruncate(fd, numel * dtype.itemsize)  # a sparse file reads as zeros
    finally:
        os.close(fd)
    pool = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    return pool, PoolHandle("shm", tuple(shape), str(dtype).removeprefix("torch."), path=path)


def export_pool(pool: torch.Tensor) -> PoolHandle:
    """The handle of a CUDA pool (a CPU pool is made shared from the start: `shared_pool`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return PoolHandle(
        "cuda", tuple(pool.shape), str(pool.dtype).removeprefix("torch."), payload=pickle.dumps(reduce_tensor(pool))
    )


def attach_pool(handle: PoolHandle) -> torch.Tensor:
    """D's pool, mapped here. Only between processes of one run on one box (the handle is ours)."""
    if handle.kind == "shm":
        numel = 1
        for n in handle.shape:
            numel *= n
        return torch.from_file(handle.path, shared=True, size=numel, dtype=_dtype(handle.dtype)).view(handle.shape)
    rebuild, args = pickle.loads(handle.payload)  # noqa: S301 - made by this run's D, passed on its queues
    return rebuild(*args)


def release(handle: Optional[PoolHandle]) -> None:
    """Remove the shared-memory file; mappings already made stay valid."""
    if handle is not None and handle.kind == "shm":
        try:
            os.unlink(handle.path)
        except FileNotFoundError:
            pass


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both block lists go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BlockCopier:
    """Copies whole blocks of one pool into another (pools: (blocks, layers, 2, block_size, Hkv, D)),
    every layer or one. Both pools on one GPU: one Triton launch per write (testbed/cluster/block_copy.py).
    Otherwise torch copies, one per run of consecutive blocks; each block's view is made once (at
    16-token blocks a view made per copy costs a fifth of the copy itself)."""

    def __init__(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, kernel: Optional[bool] = None):
        self.src, self.dst = src_pool, dst_pool
        self.block_bytes = src_pool[0].numel() * src_pool.element_size()
        one_gpu = src_pool.device == dst_pool.device and src_pool.device.type == "cuda"
        self.kernel = (one_gpu and block_copy.usable(src_pool.device)) if kernel is None else kernel

    @functools.cached_property
    def src_blocks(self) -> tuple[torch.Tensor, ...]:  # made on the torch path's first use only
        return self.src.unbind(0)

    @functools.cached_property
    def dst_blocks(self) -> tuple[torch.Tensor, ...]:
        return self.dst.unbind(0)

    def write(
        self, src_blocks: list[int], dst_blocks: list[int], layer: Optional[int] = None, heads: Optional[tuple] = None
    ) -> int:
        """Returns the bytes copied; the caller synchronises before saying the copy is done.
        `heads`: (a slice of the source pool's KV heads, where they go in the destination's), a
        tensor-parallel rank's piece; None: every head."""
        layers = 1 if layer is None else self.src.shape[1]
        if heads is not None:
            return self._write_heads(src_blocks, dst_blocks, layer, *heads)
        if self.kernel:
            block_copy.copy_blocks(self.src, self.dst, src_blocks, dst_blocks, layer)
            return self.block_bytes * len(src_blocks) // layers
        dst, src = [], []
        # in P's block order: reads stream through P's pool (a few percent over a random order)
        pairs = sorted(zip(src_blocks, dst_blocks))
        for s, d, n in block_runs([p for p, _ in pairs], [q for _, q in pairs]):
            if n == 1 and layer is None:
                dst.append(self.dst_blocks[d])
                src.append(self.src_blocks[s])
            elif layer is None:
                dst.append(self.dst[d : d + n])
                src.append(self.src[s : s + n])
            else:
                dst.append(self.dst[d : d + n, layer])
                src.append(self.src[s : s + n, layer])
        torch._foreach_copy_(dst, src)  # one call: the per-copy cost stays in C++
        return self.block_bytes * len(src_blocks) // layers

    def _write_heads(self, src_blocks, dst_blocks, layer, src_heads, dst_heads) -> int:
        """Some KV heads of each block, (blocks, layers, 2, block_size, Hkv, D) sliced on Hkv."""
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        src_index = torch.tensor(src_blocks, device=self.src.device)
        src = self.src.index_select(0, src_index)[:, layers, :, :, src_heads or slice(None)]
        dst = self.dst[:, layers, :, :, dst_heads or slice(None)]  # a view: the copy writes through
        dst.index_copy_(0, torch.tensor(dst_blocks, device=self.dst.device), src.to(self.dst.device))
        return src.numel() * src.element_size()


def synchronize(device: torch.device) -> None:
    """The copy has landed: on CUDA wait for this device's stream, on CPU it already has."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PeerPools:
    """P's side: a copier from its own pool into each decode worker's mapped pool, by rank."""

    def __init__(self):
        self.copiers: dict[int, BlockCopier] = {}

    def attach(self, rank: int, handle: PoolHandle, own_pool: torch.Tensor) -> None:
        copier = BlockCopier(own_pool, attach_pool(handle))
        if copier.kernel:
            block_copy.warm_up(own_pool)  # compiled now, not inside the first transfer's timed window
        self.copiers[rank] = copier

    def __getitem__(self, rank: int) -> BlockCopier:
        return self.copiers[rank]
