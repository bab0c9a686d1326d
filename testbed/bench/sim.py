"""Simulator speed: python -m testbed.bench.sim [--requests 100000] [--prefill 16] [--decode 48] [--rate 8000]

Simulates a disaggregated cluster (default 16 P + 48 D = 64 workers) serving a Poisson workload
with the shipped tiny CPU profile, and prints the simulated events per second and the wall
time: the event loop alone, and with the tables and summary built. The rate defaults to just
under the prefill side's capacity, where batches are realistic (a nearly idle cluster steps
once per token, a saturated one drowns in queueing).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from testbed.config import compose_config
from testbed.sim.config import shipped_profile
from testbed.sim.executor import simulate

TINY_CPU = shipped_profile("tiny")


def bench_config(requests: int, prefill: int, decode: int, rate: float, seed: int, extra: list[str]):
    return compose_config(
        [
            "mode=disagg",
            f"cluster.num_prefill={prefill}",
            f"cluster.num_decode={decode}",
            "cluster.decode_dispatch=least_loaded",
            "cluster.dispatch=least_loaded",
            "hardware=cpu",
            f"workload.num_requests={requests}",
            f"workload.rate={rate}",
            f"seed={seed}",
            *extra,
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8000.0, help="requests per second (virtual)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=str(TINY_CPU))
    parser.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    a = parser.parse_args(argv)
    cfg = bench_config(a.requests, a.prefill, a.decode, a.rate, a.seed, a.overrides)
    result = simulate(cfg.serving, cfg.sim, json.loads(Path(a.profile).read_text()), num_devices=a.prefill + a.decode)
    s, sim = result["summary"], result["summary"]["sim"]
    tokens = int(result["requests"]["num_tokens"].sum())
    print(f"workers: {a.prefill}P + {a.decode}D = {a.prefill + a.decode}; requests: {s['num_requests']}")
    print(
        f"simulated: {s['throughput']['duration_s']:.1f} s virtual, {len(result['steps'])} steps, "
        f"{tokens} tokens, {len(result['transfers'])} KV transfers"
    )
    print(
        f"event loop: {sim['events']} events in {sim['loop_s']:.1f} s = {result['events_per_s']:,.0f} events/s "
        f"({tokens / sim['loop_s']:,.0f} tokens/s)"
    )
    print(f"wall time with tables and summary: {result['wall_s']:.1f} s")
    print(
        f"ttft p50 {s['ttft']['p50']:.4f} s p99 {s['ttft']['p99']:.4f} s; tpot p50 {s['tpot']['p50']:.5f} s; "
        f"KV blocks leaked: {sum(s['kv_blocks_leaked'].values())}"
    )


if __name__ == "__main__":
    main()
