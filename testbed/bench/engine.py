"""Engine throughput and host overhead: python -m testbed.bench.engine [--models tiny small] [--device cpu]

Prints prefill tokens/s and decode tokens/s at batch 1, 8 and 32, and the share of a step spent
outside the model forward (scheduling, tensor preparation, sampling, postprocessing).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
from testbed.model.config import PRESETS

BATCHES = (1, 8, 32)


def build(model: str, device: str, context: int) -> Engine:
    args = dataclasses.replace(PRESETS[model], max_model_len=max(context * 2, 256))
    budget = 32 * context
    return Engine.build(args, EngineConfig(num_kv_blocks=32 * -(-2 * context // 16) + 64),
                        SchedulerConfig(max_batched_tokens=budget, chunk_size=budget, max_running=32),
                        "colocated", device)


def measure(engine: Engine, batch: int, prompt_len: int, decode_steps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.args.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add(Sequence(i, prompt, decode_steps + 1))
    _, prefill = engine.step()  # all prompts in one prefill step
    assert prefill.prefill_tokens == batch * prompt_len
    decodes = [engine.step()[1] for _ in range(decode_steps)]
    while engine.has_work():
        engine.step()
    assert engine.num_used_blocks == 0
    step_s = [r.end - r.start for r in decodes]
    outside = [(r.schedule_s + r.prepare_s + r.sample_s + r.postprocess_s) / (r.end - r.start) for r in decodes]
    return {"prefill_tok_s": prefill.prefill_tokens / (prefill.end - prefill.start),
            "decode_tok_s": batch / statistics.median(step_s),
            "decode_step_ms": 1000 * statistics.median(step_s),
            "outside_forward": statistics.median(outside)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    a = parser.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{'model':>6} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode step ms':>15} "
          f"{'outside forward':>16}")
    for model in a.models:
        engine = build(model, a.device, a.prompt_len + a.decode_steps + 1)
        measure(engine, 1, a.prompt_len, 4)  # warm-up
        for batch in BATCHES:
            m = measure(engine, batch, a.prompt_len, a.decode_steps)
            print(f"{model:>6} {batch:>5} {m['prefill_tok_s']:>14.0f} {m['decode_tok_s']:>13.1f} "
                  f"{m['decode_step_ms']:>15.2f} {100 * m['outside_forward']:>15.1f}%")


if __name__ == "__main__":
    main()
