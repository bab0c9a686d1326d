"""The simulator's tensor-parallel step time against the roofline split by hand:
python -m testbed.bench.tp [--models llama3_8b llama3_70b] [--gpu h100_sxm] [--tp 1 2 4 8]

For each model and TP degree the simulator runs one colocated worker of that degree on that many
simulated GPUs (executor=sim, the analytical GPU), and two of its steps are read off its steps
table: a prefill of 2048 tokens (one request alone) and a decode step of 32 sequences at context
2048 (32 prompts of 2047 tokens prefilled together, then one decode each). Each is divided by a
reference computed here, apart from the simulator's code path: the one-device roofline's kernel
time divided by tp (a perfect split), plus the host time (which no rank splits), plus 2 x layers
ring all-reduces of tokens x hidden x 2 bytes over the GPU table's NVLink, 2(tp-1)/tp x bytes /
(bandwidth x share) + 2(tp-1) x hop latency. The ratio is 1 at TP1 by construction; above 1 it is
what a perfect split leaves out: the norms and residuals every rank runs whole, the embedding
and KV heads replicated where there are fewer than ranks (none at 8 KV heads up to TP8).
"""

from __future__ import annotations

import argparse

from testbed.config import compose_config
from testbed.errors import ConfigError
from testbed.model.config import preset
from testbed.perf.gpus import gpu
from testbed.perf.resolve import analytical
from testbed.sim.executor import simulate

PREFILL, BATCH, CONTEXT = 2048, 32, 2048


def run_steps(model: str, spec: str, tp: int, prompt: int, requests: int) -> list:
    """The simulated steps table of `requests` prompts of `prompt` tokens arriving at once, two
    output tokens each, on one colocated worker of TP `tp`."""
    fixed = lambda key, n: [f"{key}.dist=fixed", f"{key}.mean={n}", f"{key}.min={n}", f"{key}.max={n}"]  # noqa: E731
    cfg = compose_config(
        [
            "executor=sim",
            "mode=colocated",
            f"model={model}",
            f"sim.profile={spec}",
            f"cluster.tp={tp}",
            "cluster.num_workers=1",
            f"hardware.num_devices={tp}",
            "hardware=cpu",
            "workload.arrival=constant",
            "workload.rate=1e7",  # all at once: the first prefill alone, then the rest together
            f"workload.num_requests={requests}",
            *fixed("workload.input_len", prompt),
            *fixed("workload.output_len", 2),
            f"scheduler.max_batched_tokens={max(prompt * requests, 2048)}",
        ]
    )
    return simulate(cfg.serving, cfg.sim)["steps"]


def reference_s(model: str, spec: str, tp: int, tokens: int, context: float, seqs: int, decode_context: int) -> float:
    """Host time + the one-device kernels / tp + 2 x layers ring all-reduces (module docstring)."""
    one, _ = analytical(spec, preset(model), 2)
    parts = one.breakdown(tokens, context, seqs, decode_context)
    host = parts["overhead"] + parts["host_per_seq"] + parts["launch"]
    kernels = sum(v for k, v in parts.items() if k not in ("overhead", "host_per_seq", "launch", "all_reduce"))
    g, steps = gpu(spec), 2 * (tp - 1)
    nbytes = (tokens + seqs) * preset(model).hidden_size * 2
    ring = steps / tp * nbytes / (g.nvlink_bytes_per_s * g.nvlink_share) + steps * g.nvlink_hop_latency_s
    return host + kernels / tp + 2 * preset(model).num_layers * ring


def measure(model: str, spec: str, tp: int) -> dict:
    """Simulated and reference seconds of the two steps; a decode batch the group's KV pool cannot
    hold at once (Llama-3-70B at TP2) is None."""
    prefill = run_steps(model, spec, tp, PREFILL, 1)
    decode = run_steps(model, spec, tp, CONTEXT - 1, BATCH)
    p = prefill[prefill["prefill_tokens"] == PREFILL].iloc[0]
    d = decode[(decode["decode_seqs"] == BATCH) & (decode["prefill_tokens"] == 0)]
    context = analytical(spec, preset(model), 2)[0].prefill_context([(PREFILL, 0)])
    out = {
        "prefill_s": float(p["end_s"] - p["start_s"]),
        "prefill_ref_s": reference_s(model, spec, tp, PREFILL, context, 0, 0),
        "decode_s": None,
        "decode_ref_s": None,
    }
    if len(d):
        out["decode_s"] = float(d["end_s"].iloc[0] - d["start_s"].iloc[0])
        out["decode_ref_s"] = reference_s(model, spec, tp, 0, 0.0, BATCH, int(d["decode_context"].iloc[0]))
    return out


def row(model: str, tp: int, m: dict) -> str:
    cells = [model, str(tp)]
    for step in ("prefill", "decode"):
        sim, ref = m[f"{step}_s"], m[f"{step}_ref_s"]
        if sim is None:
            cells += [f"the pool holds fewer than {BATCH} x {CONTEXT} tokens", "-"]
        else:
            cells += [f"{1e3 * sim:.2f} / {1e3 * ref:.2f}", f"{sim / ref:.3f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3_8b", "llama3_70b"])
    parser.add_argument("--gpu", default="h100_sxm")
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4, 8])
    a = parser.parse_args(argv)
    print(f"{a.gpu}: prefill {PREFILL} tokens; decode {BATCH} sequences at context {CONTEXT}")
    print("| model | TP | prefill ms: sim / ref | ratio | decode ms: sim / ref | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in a.models:
        for tp in a.tp:
            try:
                m = measure(model, a.gpu, tp)
            except ConfigError as error:  # a degree the model's weights do not fit: say so, go on
                print(f"| {model} | {tp} | {str(error).split(': ')[0]} | - | - | - |")
                continue
            print(row(model, tp, m))


if __name__ == "__main__":
    main()
