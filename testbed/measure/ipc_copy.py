"""The ipc KV transport against a plain copy of the same bytes (part of python -m testbed.measure.kv_transfer).

Two processes: D makes its KV pool shareable (shared memory on CPU, a CUDA IPC handle on GPUs)
and P maps it, as kv_transfer.backend=ipc does. In P, for each message size, alternating draws of
  ipc   P's blocks copied into D's blocks (both scattered, as in a busy pool), then synchronised
        (one Triton launch when P and D share a GPU, torch copies otherwise: kv_ipc.BlockCopier)
  copy  one contiguous buffer of the same bytes copied into D's pool: a memcpy on CPU, a
        device-to-device copy_ on GPUs (peer over NVLink when D has its own GPU)
The pools are block-major as the engine's (ModelRunner.kv_cache) in Llama-3-8B's KV geometry: 32
layers x 8 KV heads x head dim 128, 16-token blocks (4 MiB a block in float32, 2 MiB in bf16).
Messages are whole blocks: from 4 MiB up, at least one block.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

from testbed.cluster.kv_ipc import BlockCopier, attach_pool, export_pool, release, shared_pool, synchronize
from testbed.engine.kv_pool import kv_block_shape
from testbed.model.config import PRESETS

BLOCK = (PRESETS["llama3_8b"], 16)  # the model and block size whose KV blocks are moved


def pool_shape(blocks: int) -> tuple[int, ...]:
    return (blocks, *kv_block_shape(*BLOCK))


def block_bytes(dtype: torch.dtype) -> int:
    args, block_size = BLOCK
    return args.kv_bytes_per_token * block_size * dtype.itemsize


def sizes(max_mib: int, smallest: int) -> list[int]:
    """Message sizes from `smallest` bytes up to max_mib MiB, by factors of 4."""
    out, size = [], smallest
    while size <= max_mib << 20:
        out.append(size)
        size *= 4
    return out


def devices() -> tuple[torch.device, torch.device, str]:
    """(P's device, D's device, what the copy column is)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return torch.device("cuda:0"), torch.device("cuda:1"), "peer copy_ cuda:0 -> cuda:1"
    if count == 1:
        return torch.device("cuda:0"), torch.device("cuda:0"), "copy_ on cuda:0 (P and D share it)"
    return torch.device("cpu"), torch.device("cpu"), "memcpy into the shared pool"


def decode_side(device: torch.device, blocks: int, dtype: torch.dtype, handles, done) -> None:
    """D: export a pool and keep it alive until P has finished with it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        pool = torch.zeros(pool_shape(blocks), dtype=dtype, device=device)
        handle = export_pool(pool)
    else:
        pool, handle = shared_pool(pool_shape(blocks), dtype)
    handles.put(handle)
    done.wait()
    release(handle)


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def prefill_side(
    device: torch.device, dst_device: torch.device, max_mib: int, repeats: int, dtype: torch.dtype, handles, out
) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dst = attach_pool(handles.get())
    blocks = dst.shape[0]
    src = torch.randn(pool_shape(blocks), device=device).to(dtype)
    copier = BlockCopier(src, dst)  # as P keeps one per decode worker
    rows = []
    counts = sorted({max(size // block_bytes(dtype), 1) for size in sizes(max_mib, smallest=4 << 20)})
    for n in counts:
        size = n * block_bytes(dtype)
        src_blocks, dst_blocks = torch.randperm(blocks)[:n].tolist(), torch.randperm(blocks)[:n].tolist()
        # filled: an untouched buffer reads the zero page, which would flatter the copy
        flat = torch.randn(n * block_bytes(dtype) // dtype.itemsize, device=device).to(dtype)
        region = dst.view(-1)[: flat.numel()]  # the same bytes, contiguous, in D's memory
        copier.write(src_blocks, dst_blocks)  # untimed first touch of both sides
        assert torch.equal(dst[dst_blocks[-1]].to(device), src[src_blocks[-1]]), "ipc wrote elsewhere"
        # a small message is milliseconds, where one scheduler hiccup is the whole figure: draws
        # enough for about 1 GiB a column (3 to 20 x repeats)
        draws = repeats * min(20, max(3, (1 << 30) // size))
        ipc_s, copy_s = [], []
        for _ in range(draws):  # alternating, so a slow spell hits both
            ipc_s.append(_timed(lambda: copier.write(src_blocks, dst_blocks), dst_device))
            copy_s.append(_timed(lambda: region.copy_(flat), dst_device))
        rows.append(
            {"bytes": n * block_bytes(dtype), "ipc_s": statistics.median(ipc_s), "copy_s": statistics.median(copy_s)}
        )
    out.put(rows)


def measure_ipc(max_mib: int, repeats: int) -> dict:
    """{"copy": what the copy column is, "rows": [{bytes, ipc_s, copy_s, ipc_gbps, copy_gbps, ratio}]}"""
    p_dev, d_dev, what = devices()
    dtype = torch.bfloat16 if p_dev.type == "cuda" else torch.float32
    blocks = max(2 * (max_mib << 20) // block_bytes(dtype), 4)  # room to scatter the largest message into
    ctx = mp.get_context("spawn")
    handles, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    d = ctx.Process(target=decode_side, args=(d_dev, blocks, dtype, handles, done), daemon=True)
    p = ctx.Process(target=prefill_side, args=(p_dev, d_dev, max_mib, repeats, dtype, handles, out), daemon=True)
    d.start()
    p.start()
    try:
        rows = _wait(out, p)
    finally:
        done.set()
        p.join(60)
        d.join(60)
    for row in rows:
        row.update(
            ipc_gbps=row["bytes"] / row["ipc_s"] / 1e9,
            copy_gbps=row["bytes"] / row["copy_s"] / 1e9,
            ratio=row["copy_s"] / row["ipc_s"],
        )
    return {"copy": what, "dtype": str(dtype).removeprefix("torch."), "rows": rows}


def _wait(out, proc) -> list:
    """P's rows, or one error line when P ended without them."""
    import queue

    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the ipc benchmark's P process ended (exit code {proc.exitcode}) without figures")


def ipc_lines(results: dict, human) -> list[str]:
    lines = [
        f"ipc (P writes into D's blocks) against {results['copy']}, {results['dtype']}",
        f"{'message':>10} {'ipc GB/s':>9} {'copy GB/s':>10} {'ratio':>6}",
    ]
    for row in results["rows"]:
        lines.append(
            f"{human(row['bytes']):>10} {row['ipc_gbps']:>9.2f} {row['copy_gbps']:>10.2f} {row['ratio']:>6.2f}"
        )
    return lines
