"""python scripts/handoff_mechanisms.py [GPU]: one simulated 1P1D point under each KV hand-off
mechanism (docs/control-plane.md, "The KV hand-off as connectors do it").

Llama-3-8B on two analytical GPUs (default h100_sxm), 200 requests at 4/s, prompts 2,000-6,000
tokens, D bound early (a push needs it). Prints P's TTFT (the testbed's), the TTFT a client behind a
disaggregating proxy sees (D's first token), and the hand-off's span (a push's starts inside the
prefill it overlaps). Seconds of CPU; the same numbers on every machine.
"""

from __future__ import annotations

import sys

import numpy as np

from testbed.sim.executor import simulate
from testbed.sizing import compose_sized

BASE = [
    "executor=sim",
    "model=llama3_8b",
    "mode=disagg",
    "hardware=cpu",
    "hardware.num_devices=2",
    "workload.num_requests=200",
    "workload.rate=4",
    "workload.input_len.min=2000",
    "workload.input_len.max=6000",
    "workload.output_len.min=50",
    "workload.output_len.max=150",
    "scheduler.max_batched_tokens=8192",
    "kv_transfer.decode_binding=early",
]
PULL = "kv_transfer.mechanism=pull"
CASES = {
    "send": [],
    "pull, 16-token blocks": [PULL],
    "pull, 64-token blocks": [PULL, "engine.block_size=64"],
    "pull, 128-token blocks": [PULL, "engine.block_size=128"],
    "push_layerwise": ["kv_transfer.mechanism=push_layerwise"],
    "pull + 170 ms D path": [PULL, "kv_transfer.first_token_path_s=0.17"],
    "send over tcp": ["kv_transfer.link=tcp"],
    "pull over tcp": [PULL, "kv_transfer.link=tcp"],
    "push_layerwise over tcp": ["kv_transfer.mechanism=push_layerwise", "kv_transfer.link=tcp"],
}


def row(name: str, overrides: list[str]) -> str:
    cfg = compose_sized(overrides)
    run = simulate(cfg.serving, cfg.sim)
    ok = run["requests"][run["requests"].status == "ok"]
    d_first = np.array([list(t)[1] for t in ok.token_times]) - ok.arrival_s.to_numpy()
    span = (run["transfers"].end_s - run["transfers"].start_s).to_numpy()
    ms = 1e3
    return (
        f"{name:24s} TTFT(P) p50 {ok.ttft.median() * ms:6.1f}  TTFT(D first) p50 {np.median(d_first) * ms:6.1f} "
        f"p99 {np.percentile(d_first, 99) * ms:6.1f}  hand-off p50 {np.median(span) * ms:6.1f}  (ms)"
    )


def main(gpu: str = "h100_sxm") -> None:
    for name, extra in CASES.items():
        print(row(name, [*BASE, f"sim.profile={gpu}", *extra]))


if __name__ == "__main__":
    main(*sys.argv[1:2])
