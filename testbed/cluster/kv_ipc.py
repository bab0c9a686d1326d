"""The ipc KV transport (kv_transfer.backend=ipc): P writes a prompt's KV straight into the blocks
D reserved, through D's KV pool mapped into P's address space.

    D at start: export its pool once (KVPoolExport to every P)    P: attach it (KVPoolAttached)
    D: Reserve -> blocks -> Ready(blocks) to P                      P: KVBegin, then copy its blocks
                                                                       into D's, synchronise, KVDone
    D: KVDone -> install (no unpack)

One copy, no staging buffer on either side: runs of consecutive block ids on both sides become
one strided copy each. On CPU the pool lives in a shared-memory file (removed once every P has
mapped it, so a killed run leaves nothing behind); on CUDA it is exported with a CUDA IPC handle
(P and D on one GPU, or on two with peer access: NVLink). KVDone leaves only after the copy's
stream is synchronised, so D never reads a block P is still writing.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

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

    return PoolHandle("cuda", tuple(pool.shape), str(pool.dtype).removeprefix("torch."),
                      payload=pickle.dumps(reduce_tensor(pool)))


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


def write_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_blocks: list[int], dst_blocks: list[int],
                 layer: Optional[int] = None) -> int:
    """Copy whole blocks of P's pool into D's (pools: (2, layers, blocks, block_size, Hkv, D));
    one layer or all. Returns the bytes copied. The caller synchronises before saying so."""
    src = src_pool if layer is None else src_pool[:, layer : layer + 1]
    dst = dst_pool if layer is None else dst_pool[:, layer : layer + 1]
    runs = block_runs(src_blocks, dst_blocks)
    # one call for every run: the per-copy cost stays in C++ (strided copies of 2 x layers chunks)
    torch._foreach_copy_([dst[:, :, d : d + n] for _, d, n in runs], [src[:, :, s : s + n] for s, _, n in runs])
    per_block = src[:, :, 0].numel() * src.element_size()
    return per_block * len(src_blocks)


def synchronize(device: torch.device) -> None:
    """The copy has landed: on CUDA wait for this device's stream, on CPU it already has."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PeerPools:
    """P's side: the decode workers' pools it has mapped, by rank."""

    def __init__(self):
        self.pools: dict[int, torch.Tensor] = {}

    def attach(self, rank: int, handle: PoolHandle) -> None:
        self.pools[rank] = attach_pool(handle)

    def __contains__(self, rank: int) -> bool:
        return rank in self.pools

    def __getitem__(self, rank: int) -> torch.Tensor:
        return self.pools[rank]
