"""KV-transfer bandwidth: python -m testbed.measure.kv_transfer [--max-mib 1024] [--repeats 3]

Two processes (P and D) in one torch.distributed group: gloo on CPU, NCCL on two GPUs. For each
message size (4 KiB up to --max-mib) it times, in the same run:
  raw        one contiguous tensor, isend -> irecv
  connector  the connector's path: gather the tokens' KV out of P's paged pool into one buffer,
             header, isend -> irecv, scatter into D's blocks
and prints both bandwidths and their ratio. On GPUs it also times a device-to-device copy_,
the link's ceiling. Times are on one clock (perf_counter is CLOCK_MONOTONIC for every process).
Then the ipc transport against a plain copy of the same bytes (testbed/measure/ipc_copy.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testbed.cluster.completion import BufferPool, CompletionTracker
from testbed.cluster.kv_wire import receive_part, send_part, unpack_arrived
from testbed.engine import EngineConfig
from testbed.engine.model_runner import ModelRunner
from testbed.measure.ipc_copy import ipc_lines, measure_ipc, sizes
from testbed.model.config import ModelArgs
from testbed.model.llama import Transformer
from testbed.net.rendezvous import host_store, store_client

# 2 layers x 2 KV heads x head dim 64, float32: 2 KiB of K and V per token
SHAPE = ModelArgs(
    vocab_size=16, hidden_size=128, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=2, max_model_len=16
)
BLOCK = 16


def make_runner(device: torch.device, tokens: int) -> ModelRunner:
    with torch.device(device):
        model = Transformer(SHAPE)
    blocks = -(-tokens // BLOCK)
    return ModelRunner(model, EngineConfig(block_size=BLOCK, num_kv_blocks=blocks), device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_pair(rank: int, device, send, recv) -> float:
    """Seconds from P's start to D's completion."""
    dist.barrier()
    # on P's device: an NCCL group moves CUDA tensors only
    start = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
    if rank == 0:
        send()
        sync(device)
        dist.send(start, dst=1)
        return 0.0
    recv()
    sync(device)
    end = time.perf_counter()
    dist.recv(start, src=0)
    return end - start.item()


def run_rank(rank: int, port: int, max_mib: int, repeats: int, use_cuda: bool, out) -> None:
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = store_client("127.0.0.1", port, 600)  # the parent's, on the loopback alone
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=dist.PrefixStore("kv", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=600),
    )
    per_token = SHAPE.kv_bytes_per_token * 4
    runner = make_runner(device, (max_mib << 20) // per_token + BLOCK)
    table = torch.randperm(runner.num_blocks).tolist()  # scattered blocks, as in a busy pool
    pool = BufferPool(device, runner.dtype, max_bytes=4 << 30)
    tracker = CompletionTracker(timeout_s=600)
    rows = []
    warm_up(rank, device, runner, table, pool, tracker, per_token)
    for size in sizes(max_mib, smallest=4 << 10):
        tokens = max(size // per_token, 1)
        raw = torch.ones(tokens * per_token // 4, device=device)
        connector_send, connector_recv = connector_pair(runner, table, tokens, pool, tracker, device)

        # messages up to 16 MiB cost at most milliseconds, where one scheduler hiccup is the whole
        # figure: more draws, raw and connector alternating so that a slow spell hits both
        draws = repeats * 5 if size <= 16 << 20 else repeats
        raw_s, conn_s = [], []
        for _ in range(draws):
            raw_s.append(timed_pair(rank, device, lambda: dist.send(raw, dst=1), lambda: dist.recv(raw, src=0)))
            conn_s.append(timed_pair(rank, device, connector_send, connector_recv))
        if rank == 1:
            # the median is the figure; the best draw is the cost with no hiccup in it, the one a
            # loaded machine still measures
            rows.append(
                {
                    "bytes": tokens * per_token,
                    "raw_s": statistics.median(raw_s),
                    "connector_s": statistics.median(conn_s),
                    "raw_best_s": min(raw_s),
                    "connector_best_s": min(conn_s),
                }
            )
    if rank == 0 and use_cuda:
        out.put({"ceiling": copy_ceiling(max_mib, repeats)})
    if rank == 1:
        out.put({"rows": rows})
    dist.destroy_process_group()


def connector_pair(runner, table, tokens: int, pool, tracker, device):
    """P's and D's side of one transfer on the connector's own functions; the header stands for
    its queue message."""
    header = torch.zeros(8, dtype=torch.int64, device=device)

    def send():
        dist.send(header, dst=1)
        part = send_part(runner, table, tokens, None, 1, pool, tracker)
        while not part.settled():
            time.sleep(0)
        pool.put(part.buffer)

    def recv():
        dist.recv(header, src=0)
        part = receive_part(runner.kv_shape(tokens), 0, pool, tracker)
        while not unpack_arrived(runner, table, part, None):
            time.sleep(0)
        pool.put(part.buffer)

    return send, recv


def warm_up(rank: int, device, runner, table, pool, tracker, per_token: int) -> None:
    """One untimed raw send and connector transfer, so that neither path's first-use costs
    (connection set-up, buffer allocation) land in the smallest message's figure."""
    tokens = 2
    raw = torch.ones(tokens * per_token // 4, device=device)
    send, recv = connector_pair(runner, table, tokens, pool, tracker, device)
    if rank == 0:
        dist.send(raw, dst=1)
        send()
    else:
        dist.recv(raw, src=0)
        recv()
    sync(device)


def copy_ceiling(max_mib: int, repeats: int) -> float:
    """cuda:0 -> cuda:1 copy_ of the largest message: the link's bandwidth without NCCL."""
    src = torch.ones(max_mib << 18, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - t)
    return src.numel() * 4 / statistics.median(times)


def measure(max_mib: int, repeats: int, ipc: bool = True) -> dict:
    """{"backend", "rows": [{bytes, raw_s, connector_s, raw_gbps, connector_gbps, ratio, and the best
    draws' raw_best_s, connector_best_s, ratio_best}], "ceiling"?,
    "ipc"?: testbed.measure.ipc_copy.measure_ipc's figures}"""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = host_store("127.0.0.1", 0, None, 600)  # the group's rendezvous, on the loopback alone
    mp.start_processes(run_rank, args=(store.port, max_mib, repeats, use_cuda, out), nprocs=2, start_method="spawn")
    del store
    results = {"backend": "nccl (cuda:0 -> cuda:1)" if use_cuda else "gloo (CPU processes)"}
    while not out.empty():
        results.update(out.get())
    for row in results["rows"]:
        raw, conn = row["bytes"] / row["raw_s"] / 1e9, row["bytes"] / row["connector_s"] / 1e9
        row.update(
            raw_gbps=raw, connector_gbps=conn, ratio=conn / raw, ratio_best=row["raw_best_s"] / row["connector_best_s"]
        )
    if ipc:
        results["ipc"] = measure_ipc(max_mib, repeats)
    return results


def report_lines(results: dict) -> list[str]:
    lines = [f"backend: {results['backend']}", f"{'message':>10} {'raw GB/s':>9} {'connector GB/s':>15} {'ratio':>6}"]
    for row in results["rows"]:
        lines.append(
            f"{_human(row['bytes']):>10} {row['raw_gbps']:>9.2f} {row['connector_gbps']:>15.2f} {row['ratio']:>6.2f}"
        )
    if "ceiling" in results:
        lines.append(f"device-to-device copy_ ceiling: {results['ceiling'] / 1e9:.1f} GB/s")
    if "ipc" in results:
        lines += ipc_lines(results["ipc"], _human)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--no-ipc", action="store_true", help="skip the ipc transport's figures")
    parser.add_argument("--only-ipc", action="store_true", help="only the ipc transport's figures")
    a = parser.parse_args(argv)
    if a.only_ipc:
        results = {"ipc": measure_ipc(a.max_mib, a.repeats)}
        print("\n".join(ipc_lines(results["ipc"], _human)))
    else:
        results = measure(a.max_mib, a.repeats, ipc=not a.no_ipc)
        print("\n".join(report_lines(results)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


if __name__ == "__main__":
    main()
