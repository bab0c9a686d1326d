"""The engine against the device's own ceilings: python -m testbed.bench.gpu [--model llama3_8b] [--device cuda:0]

Two ceilings measured first, on this device: HBM bandwidth (a large device-to-device copy_,
bytes read plus written) and the matrix rate (a large product in the model's dtype, random data).
Then, on the model's shape with dummy weights:
  decode   step time at batch 1, 16 and 64 (context --context tokens each), CUDA graphs on and off,
           against the HBM roofline: every weight and every sequence's KV read once per step, of an
           untied embedding table only the batch's rows
  prefill  tokens/s of one --prefill-lens prompt, against the matrix rate: 2 x the layers' parameters
           FLOPs per token, the LM head's for the one sampled token, plus causal attention's
           (2 x 2 x layers x hidden x L^2 / 2 for L tokens)
Each figure is the median of --repeats timed runs after a warm-up; the ratios are measured/ideal
(1.0 would be the ceiling itself). On CPU it runs too (float32, no graphs): a check of the method.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
from testbed.model.config import PRESETS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: lazy initialisation, autotuning, first-touch
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hbm_bytes_per_s(device: torch.device, repeats: int, mib: int = 1024) -> float:
    src = torch.randn(mib << 18, device=device)  # random, never zeros: they can run faster
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src), device, repeats)


def matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / median_s(lambda: a @ b, device, repeats)


def build(model: str, device: torch.device, context: int, max_batch: int, graphs: bool) -> Engine:
    args = dataclasses.replace(PRESETS[model], max_model_len=context + 64)
    budget = max(max_batch * 1024, context)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return Engine.build(
        args,
        EngineConfig(cuda_graphs=graphs and device.type == "cuda"),
        SchedulerConfig(max_batched_tokens=budget, chunk_size=budget, max_running=max_batch),
        "colocated",
        device,
        dtype=dtype,
    )


def weight_bytes(engine: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def decode_weight_bytes(engine: Engine, batch: int) -> int:
    """The weight bytes a decode step of `batch` sequences reads: all of them, but of the embedding
    table only the looked-up rows (unless the LM head, tied to it, reads it whole)."""
    model = engine.runner.model
    if model.args.tie_embeddings:
        return weight_bytes(engine)
    table = model.embed_tokens.weight
    row_bytes = table.shape[1] * table.element_size()
    return weight_bytes(engine) - table.shape[0] * row_bytes + batch * row_bytes


def decode_step_s(engine: Engine, batch: int, context: int, steps: int, graphs: bool) -> float:
    """Median decode step time of `batch` sequences of `context` tokens (prefilled untimed)."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.args.vocab_size, (context,), generator=g).tolist()
        engine.add(Sequence(i, prompt, steps + 2))
    saved = engine.runner.graphs
    engine.runner.graphs = saved if graphs else None  # the same engine, replayed or eager
    records = []
    try:
        while len(records) < steps:  # the prefill step(s) first, untimed
            record = engine.step().record
            if record.prefill_tokens == 0 and record.decode_seqs == batch:
                records.append(record)
    finally:
        engine.runner.graphs = saved
    while engine.has_work():
        engine.step()
    return statistics.median(r.end - r.start for r in records)


def prefill_s(engine: Engine, tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):
        prompt = torch.randint(0, engine.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(r))
        engine.add(Sequence(r, prompt.tolist(), 1))
        record = engine.step().record
        assert record.prefill_tokens == tokens, "the prompt did not fit one step"
        while engine.has_work():
            engine.step()
        times.append(record.end - record.start)
    return statistics.median(times[1:])  # the first is the warm-up


def prefill_flops(engine: Engine, tokens: int, sequences: int = 1) -> float:
    """A prefill of `sequences` prompts, `tokens` in all (each tokens / sequences long): every layer's
    parameters once per token, the LM head only for each prompt's last token (the one sampled), and
    causal attention. No embedding FLOPs (a lookup)."""
    a = engine.args
    layers = sum(p.numel() for p in engine.runner.model.layers.parameters())
    length = tokens / sequences
    attention = 2 * 2 * a.num_layers * a.num_heads * a.head_dim * length * length / 2 * sequences
    return 2 * layers * tokens + 2 * a.vocab_size * a.hidden_size * sequences + attention


def run(model: str, device: str, context: int, batches, prefill_lens, repeats: int, steps: int) -> dict:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    big = device.type == "cuda"  # sizes that fill a GPU; on CPU enough to check the method
    hbm = hbm_bytes_per_s(device, repeats, mib=1024 if big else 64)
    mma = matmul_flops(device, dtype, repeats, n=8192 if big else 512)
    engine = build(model, device, max(context, *prefill_lens), max(batches), graphs=True)
    kv_token = engine.args.kv_bytes_per_token * engine.runner.dtype.itemsize
    rows = []
    for batch in batches:
        ideal = (decode_weight_bytes(engine, batch) + batch * context * kv_token) / hbm
        for graphs in [True, False] if engine.runner.graphs is not None else [False]:
            step = decode_step_s(engine, batch, context, steps, graphs)
            rows.append(
                {
                    "what": "decode",
                    "batch": batch,
                    "tokens": context,
                    "graphs": graphs,
                    "seconds": step,
                    "ideal_s": ideal,
                    "ratio": ideal / step,
                }
            )
    for tokens in prefill_lens:
        seconds = prefill_s(engine, tokens, repeats)
        ideal = prefill_flops(engine, tokens) / mma
        rows.append(
            {
                "what": "prefill",
                "batch": 1,
                "tokens": tokens,
                "graphs": False,
                "seconds": seconds,
                "ideal_s": ideal,
                "ratio": ideal / seconds,
                "tok_s": tokens / seconds,
            }
        )
    return {
        "model": model,
        "device": str(device),
        "backend": engine.runner.backend.name,
        "block_size": engine.runner.block_size,
        "hbm_gbps": hbm / 1e9,
        "matmul_tflops": mma / 1e12,
        "rows": rows,
    }


def lines(result: dict) -> list[str]:
    out = [
        f"{result['model']} on {result['device']} ({result['backend']} attention, {result['block_size']}-token "
        f"blocks): HBM {result['hbm_gbps']:.0f} GB/s (copy), matmul {result['matmul_tflops']:.1f} TFLOP/s",
        f"{'what':>8} {'batch':>5} {'tokens':>6} {'graphs':>6} {'ms':>9} {'ideal ms':>9} {'of ideal':>8}",
    ]
    for r in result["rows"]:
        out.append(
            f"{r['what']:>8} {r['batch']:>5} {r['tokens']:>6} {str(r['graphs']):>6} {1000 * r['seconds']:>9.2f} "
            f"{1000 * r['ideal_s']:>9.2f} {r['ratio']:>8.2f}"
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=1024, help="tokens per decoding sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--json", help="also write the figures to this file")
    a = parser.parse_args(argv)
    result = run(a.model, a.device, a.context, a.batches, a.prefill_lens, a.repeats, a.steps)
    print("\n".join(lines(result)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
