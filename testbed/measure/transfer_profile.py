"""KV-transfer samples (bytes, seconds) for the cost model.

- `wire` (the default): two processes in one torch.distributed group time the connector's own
  path, gather from a paged pool, isend -> irecv, scatter into the receiver's blocks
  (`testbed.measure.kv_transfer.run_rank`): gloo between CPU processes, NCCL between two GPUs.
- `pack` (quick mode, or a single GPU, where there is no peer): the same gather and scatter on
  this device with a device copy standing for the wire. It leaves the link out, so it is a lower
  bound on the transfer time; the profile says which source it used.
- `ipc` (always, beside the above, for kv_transfer.backend=ipc): whole blocks copied from the pool
  into a pool of the kind D exports (shared memory on CPU, CUDA memory on GPUs): the ipc
  transport's one copy (`measure_ipc`).
"""

from __future__ import annotations

import statistics
import time

import torch

from testbed.engine.model_runner import ModelRunner
from testbed.ports import free_port

WIRE_MAX_MIB = {"cpu": 16, "cuda": 256}


def measure_transfer(runner: ModelRunner, *, quick: bool) -> tuple[list[dict], str]:
    """(samples, source): samples are {"bytes", "seconds"} rows."""
    device = runner.device
    has_peer = device.type == "cpu" or torch.cuda.device_count() >= 2
    if quick or not has_peer:
        return measure_pack(runner, repeats=3), "pack"
    return measure_wire(device, repeats=3), "wire-nccl" if device.type == "cuda" else "wire-gloo"


def measure_wire(device: torch.device, repeats: int) -> list[dict]:
    # process code (spawn, the benchmark's ranks) is imported only when a wire is measured
    import torch.multiprocessing as mp

    from testbed.measure.kv_transfer import run_rank

    use_cuda = device.type == "cuda"
    out = mp.get_context("spawn").Queue()
    mp.start_processes(
        run_rank, args=(free_port(), WIRE_MAX_MIB[device.type], repeats, use_cuda, out), nprocs=2, start_method="spawn"
    )
    results = {}
    while not out.empty():
        results.update(out.get())
    return [
        {"bytes": row["bytes"], "seconds": row["connector_s"], "raw_seconds": row["raw_s"]} for row in results["rows"]
    ]


def measure_pack(runner: ModelRunner, repeats: int) -> list[dict]:
    """Gather a request's KV out of the pool, copy it, scatter it into other blocks."""
    bs = runner.block_size
    per_token = runner.args.kv_bytes_per_token * runner.dtype.itemsize
    half = runner.num_blocks // 2
    rows = []
    for tokens in sorted({16, 128, 1024, min(runner.args.max_model_len, half * bs)}):
        if tokens > half * bs:
            continue
        blocks = -(-tokens // bs)
        src, dst = list(range(blocks)), list(range(half, half + blocks))
        times = []
        for _ in range(repeats + 1):
            _sync(runner.device)
            start = time.perf_counter()
            packed = runner.read_tokens(src, tokens)
            runner.write_tokens(dst, packed.clone())
            _sync(runner.device)
            times.append(time.perf_counter() - start)
        rows.append({"bytes": tokens * per_token, "seconds": statistics.median(times[1:])})
    return rows


def measure_ipc(runner: ModelRunner, repeats: int, max_tokens: int = 1 << 15) -> tuple[list[dict], str]:
    """(samples, source) of kv_transfer.backend=ipc: P's blocks of a request copied into the blocks D
    reserved in its mapped pool, both scattered as in a busy pool, until the copy has landed. D's pool
    is a shared-memory file on CPU; on CUDA a pool on the next GPU (peer copy) when there is one,
    else on this GPU (P and D sharing it)."""
    from testbed.cluster.kv_ipc import BlockCopier, release, shared_pool, synchronize

    own, bs = runner.kv_cache, runner.block_size
    tokens_list = sorted({16, 128, 1024, 8192, min(runner.args.max_model_len, max_tokens, runner.num_blocks * bs)})
    tokens_list = [t for t in tokens_list if t <= runner.num_blocks * bs]
    largest = -(-tokens_list[-1] // bs)
    shape = (largest + largest // 4 + 1, *own.shape[1:])  # a quarter more: room to scatter into
    if runner.device.type == "cpu":
        peer, handle = shared_pool(shape, own.dtype)
        release(handle)  # the mapping stays valid; nothing is left in /dev/shm
        source = "ipc-shm"
    else:
        index = runner.device.index or 0
        other = (index + 1) % torch.cuda.device_count()
        peer = torch.empty(shape, dtype=own.dtype, device=torch.device("cuda", other))
        source = "ipc-peer" if other != index else "ipc-same-gpu"
    copier = BlockCopier(own, peer)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in tokens_list:
        blocks = -(-tokens // bs)
        src = torch.randperm(runner.num_blocks, generator=gen)[:blocks].tolist()
        dst = torch.randperm(shape[0], generator=gen)[:blocks].tolist()
        times, nbytes = [], 0
        for _ in range(repeats + 1):  # the first touches both sides
            synchronize(peer.device)
            start = time.perf_counter()
            nbytes = copier.write(src, dst)
            synchronize(peer.device)
            times.append(time.perf_counter() - start)
        rows.append({"bytes": nbytes, "seconds": statistics.median(times[1:])})
    return rows, source


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
