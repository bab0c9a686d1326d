"""A tensor-parallel group of real engines on this machine, one process per rank over gloo:
python -m testbed.bench.tp_group [--tp 1 2] [--batch 8] [--context 256] [--steps 20]

Each rank builds the full model (its seeded dummy weights, or a checkpoint's), keeps its shard
(testbed/model/tensor_parallel.py), and runs its own engine on the same requests, so every rank
takes the same schedule and the same greedy tokens; rank 0's are returned. `greedy` is what the
tests hold to TP1's tokens; `main` prints a decode step's time at each degree against TP1's, the
ratio measured in one run (on CPU ranks share the cores: it shows the all-reduces' cost, not a
GPU's speed-up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testbed.engine.config import EngineConfig, SchedulerConfig
from testbed.engine.engine import Engine
from testbed.engine.sequence import Sequence
from testbed.model.config import ModelArgs, preset
from testbed.model.loader import build_model
from testbed.model.tensor_parallel import check_shardable, shard_model
from testbed.ports import free_port


def greedy(args: ModelArgs, tp: int, prompts: list[list[int]], max_tokens: int, seed: int = 0, path=None):
    """Each prompt's greedy tokens from a group of `tp` ranks (tp=1: one engine in this process);
    `path`: a Hugging Face checkpoint's directory (else seeded dummy weights)."""
    check_shardable(args, tp)
    job = Job(args, prompts, max_tokens, seed, None if path is None else str(path))
    return (run_rank(0, 1, None, job) if tp == 1 else spawn(tp, job))["tokens"]


@dataclass(frozen=True)
class Job:
    """What every rank runs: the model, the requests, and how many decode steps to time."""

    args: ModelArgs
    prompts: list
    max_tokens: int
    seed: int = 0
    path: str | None = None
    decode_steps: int = 0


def spawn(tp: int, job: Job) -> dict:
    """Rank 0's result of a group of `tp` processes over gloo on the loopback."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank_main, args=(tp, free_port(), job, results), nprocs=tp, start_method="spawn")
    return results.get()  # start_processes joined every rank; a failed one raised with its traceback


def _rank_main(rank: int, tp: int, port: int, job: Job, results) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        out = run_rank(rank, tp, dist.group.WORLD, job)
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, tp: int, group, job: Job) -> dict:
    """One rank's engine on its shard, run until every request ends: its tokens and, when asked,
    the median of `job.decode_steps` decode-only steps' seconds."""
    args, prompts, max_tokens, decode_steps = job.args, job.prompts, job.max_tokens, job.decode_steps
    full = build_model(args, torch.device("cpu"), torch.float32, path=job.path, seed=job.seed)
    model = shard_model(full, rank, tp, group) if tp > 1 else full
    blocks = 4 * sum(-(-(len(p) + max_tokens) // 16) for p in prompts)
    engine = Engine(
        model,
        EngineConfig(num_kv_blocks=blocks, attention_backend="torch"),
        SchedulerConfig(max_running=len(prompts), max_batched_tokens=4096, chunk_size=4096),
        "colocated",
        torch.device("cpu"),
    )
    seqs = [Sequence(i, list(p), max_tokens) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    decode = []
    while engine.has_work():
        start = time.perf_counter()
        result = engine.step().result
        if result.scheduled and not any(prefill for _, _, prefill in result.scheduled):
            decode.append(time.perf_counter() - start)
    timed = decode[1 : 1 + decode_steps] if decode_steps else []  # the first decode step warms up
    return {"tokens": [s.output_token_ids for s in seqs], "decode_s": statistics.median(timed) if timed else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args(argv)
    args = replace(preset(a.model), max_model_len=a.context + a.steps + 8)
    prompts = [[(7 * i + j) % (args.vocab_size - 1) + 1 for j in range(a.context)] for i in range(a.batch)]
    times = {}
    for tp in a.tp:
        check_shardable(args, tp)
        job = Job(args, prompts, a.steps + 2, decode_steps=a.steps)
        times[tp] = (run_rank(0, 1, None, job) if tp == 1 else spawn(tp, job))["decode_s"]
    base = times[a.tp[0]]
    print(f"{a.model}: decode step, batch {a.batch} at context {a.context} (median of {a.steps}), CPU ranks over gloo")
    for tp, seconds in times.items():
        print(f"  TP{tp:<2} {1000 * seconds:8.2f} ms   {seconds / base:5.2f}x TP{a.tp[0]}")


if __name__ == "__main__":
    main()
