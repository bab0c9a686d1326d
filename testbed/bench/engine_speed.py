"""Engine throughput and host overhead: python -m testbed.bench.engine_speed [--models tiny small] [--device cpu]

Prints prefill tokens/s and decode tokens/s at batch 1, 8 and 32, and the share of a step spent
outside the model forward (scheduling, tensor preparation, sampling, postprocessing).

`--linear`: each projection of each shape of --models at 1, 32 and 4096 rows (one thread), torch's
linear against the packed oneDNN GEMM the engine swaps in on CPU (testbed.model.linear): time
per call, their ratio, and the largest difference from a float64 product relative to its scale.

`--vs-transformers`: LLM.generate against transformers' generate on one checkpoint that
transformers itself writes (float32, one thread, batch 32, 128 prompt + 64 new tokens, greedy),
for each shape of --models, in --repeats alternating rounds, `LLM` with its defaults, tuned to
the batch, and with its defaults on torch's linear (transformers' GEMM): output tokens/s of both sides (best
run), their ratio, the spread of the rounds'
ratios, and whether the tokens agree.
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
    return Engine.build(
        args,
        EngineConfig(num_kv_blocks=32 * -(-2 * context // 16) + 64),
        SchedulerConfig(max_batched_tokens=budget, chunk_size=budget, max_running=32),
        "colocated",
        device,
    )


def measure(engine: Engine, batch: int, prompt_len: int, decode_steps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.args.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add(Sequence(i, prompt, decode_steps + 1))
    prefill = engine.step().record  # all prompts in one prefill step
    assert prefill.prefill_tokens == batch * prompt_len
    decodes = [engine.step().record for _ in range(decode_steps)]
    while engine.has_work():
        engine.step()
    assert engine.num_used_blocks == 0
    step_s = [r.end - r.start for r in decodes]
    outside = [(r.schedule_s + r.prepare_s + r.sample_s + r.postprocess_s) / (r.end - r.start) for r in decodes]
    return {
        "prefill_tok_s": prefill.prefill_tokens / (prefill.end - prefill.start),
        "decode_tok_s": batch / statistics.median(step_s),
        "decode_step_ms": 1000 * statistics.median(step_s),
        "outside_forward": statistics.median(outside),
    }


def vs_transformers(
    shape: str,
    batch: int = 32,
    prompt_len: int = 128,
    new_tokens: int = 64,
    repeats: int = 5,
    attention_backend: str = "auto",
) -> list[dict]:
    """Both engines on a checkpoint `save_pretrained` wrote with this preset's shape, in `repeats`
    alternating rounds (neither side alone pays first-use costs or a slow spell): `LLM` with its
    defaults, `LLM` tuned to the batch (running sequences, batched tokens and chunk the batch's
    size, a pool that holds it exactly), `LLM` with its defaults on torch's linear (the GEMM
    transformers runs), then transformers. One row per `LLM` setting: the best
    run of each side, and the spread of the rounds' ratios (a round runs back to back, so a slow
    spell of the machine slows both)."""
    import tempfile
    import time

    import transformers

    from testbed.llm import LLM
    from testbed.model import linear

    a = PRESETS[shape]
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).float().eval()
    reference.generation_config.eos_token_id = None  # greedy to the full length, as the engine runs
    prompts = torch.randint(0, a.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        reference.save_pretrained(directory)
        llms = {
            "defaults": LLM(directory, attention_backend=attention_backend),
            "tuned": LLM(
                directory,
                max_running=batch,
                max_batched_tokens=batch * prompt_len,
                chunk_size=batch * prompt_len,
                num_kv_blocks=batch * (-(-(prompt_len + new_tokens) // 16)) + 16,
                attention_backend=attention_backend,
            ),
            "torch GEMM": LLM(directory, attention_backend=attention_backend),
        }
        # defaults, but torch's linear as transformers runs it: what the engine gains besides the GEMM
        linear.unpack_linears(llms["torch GEMM"].engine.runner.model)
        runs = {name: (lambda llm=llm: llm.generate(prompts.tolist(), new_tokens)) for name, llm in llms.items()}
        runs["transformers"] = lambda: reference.generate(
            prompts, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts)
        )[:, prompt_len:].tolist()
        seconds: dict = {name: [] for name in runs}
        tokens: dict = {}
        for _ in range(repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                tokens[name] = run()
                seconds[name].append(time.perf_counter() - start)
    theirs = seconds["transformers"]
    rows = []
    for name, llm in llms.items():
        ours = seconds[name]
        pairs = sorted(t / o for o, t in zip(ours, theirs))
        same = sum(x == y for x, y in zip(tokens[name], tokens["transformers"]))
        rows.append(
            {
                "setting": name,
                "testbed_tok_s": batch * new_tokens / min(ours),
                "transformers_tok_s": batch * new_tokens / min(theirs),
                "ratio": min(theirs) / min(ours),
                "pair_ratio_median": statistics.median(pairs),
                "pair_ratio_min": pairs[0],
                "pair_ratio_max": pairs[-1],
                "same_tokens": same,
                "batch": batch,
                "backend": llm.engine.runner.backend.name,
                "kv_blocks": llm.engine.runner.num_blocks,
            }
        )
    return rows


def linear_rows(shape: str, rows=(1, 32, 4096)) -> list[dict]:
    """torch's F.linear against testbed.model.linear's packed GEMM on the shape's projections."""
    import time

    import torch.nn.functional as F

    from testbed.model import linear

    a = PRESETS[shape]
    q_kv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    projections = {
        "qkv": (a.hidden_size, q_kv),
        "o": (a.num_heads * a.head_dim, a.hidden_size),
        "gate_up": (a.hidden_size, 2 * a.intermediate_size),
        "down": (a.intermediate_size, a.hidden_size),
        "lm_head": (a.hidden_size, a.vocab_size),
    }

    def per_call(fn, calls: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    out = []
    for name, (inputs, outputs) in projections.items():
        plain = torch.nn.Linear(inputs, outputs, bias=False)
        packed = linear.PackedLinear.from_linear(plain)
        for n in rows:
            x = torch.randn(n, inputs)
            calls = max(3, int(2e8 // (n * inputs * outputs)))
            with torch.inference_mode():
                exact = F.linear(x.double(), plain.weight.double())
                error = (packed(x).double() - exact).abs().max().item() / exact.abs().max().item()
                torch_s, packed_s = per_call(lambda: plain(x), calls), per_call(lambda: packed(x), calls)
            out.append(
                {
                    "shape": shape,
                    "projection": name,
                    "rows": n,
                    "in": inputs,
                    "out": outputs,
                    "torch_us": 1e6 * torch_s,
                    "packed_us": 1e6 * packed_s,
                    "ratio": torch_s / packed_s,
                    "rel_error": error,
                }
            )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--repeats", type=int, default=5, help="--vs-transformers: alternating pairs of runs")
    parser.add_argument("--attention-backend", default="auto", help="--vs-transformers: the engine's backend")
    parser.add_argument("--linear", action="store_true", help="torch's linear vs the packed oneDNN GEMM, one thread")
    parser.add_argument(
        "--vs-transformers",
        action="store_true",
        help="LLM.generate vs transformers' generate (one thread; transformers from the dev extra)",
    )
    a = parser.parse_args(argv)
    if a.threads or a.vs_transformers or a.linear:
        torch.set_num_threads(a.threads or 1)
    if a.linear:
        print(
            f"{'shape':>6} {'projection':>10} {'rows':>5} {'in x out':>11} {'torch us':>9} {'packed us':>10} "
            f"{'ratio':>6} {'rel. error':>10}"
        )
        for model in a.models:
            for r in linear_rows(model):
                print(
                    f"{model:>6} {r['projection']:>10} {r['rows']:>5} {r['in']:>5}x{r['out']:<5} {r['torch_us']:>9.1f} "
                    f"{r['packed_us']:>10.1f} {r['ratio']:>6.2f} {r['rel_error']:>10.1e}"
                )
        return
    if a.vs_transformers:
        print(
            f"{'shape':>6} {'backend':>8} {'LLM':>10} {'testbed tok/s':>14} {'transformers tok/s':>19} "
            f"{'ratio':>6} {'rounds: median [min, max]':>26} {'same tokens':>12}"
        )
        for model in a.models:
            for r in vs_transformers(model, repeats=a.repeats, attention_backend=a.attention_backend):
                print(
                    f"{model:>6} {r['backend']:>8} {r['setting']:>10} {r['testbed_tok_s']:>14.0f} "
                    f"{r['transformers_tok_s']:>19.0f} {r['ratio']:>6.2f} {r['pair_ratio_median']:>11.2f} "
                    f"[{r['pair_ratio_min']:.2f}, {r['pair_ratio_max']:.2f}] {r['same_tokens']:>8}/{r['batch']}"
                )
        return
    print(
        f"{'model':>6} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode step ms':>15} "
        f"{'outside forward':>16}"
    )
    for model in a.models:
        engine = build(model, a.device, a.prompt_len + a.decode_steps + 1)
        measure(engine, 1, a.prompt_len, 4)  # warm-up
        for batch in BATCHES:
            m = measure(engine, batch, a.prompt_len, a.decode_steps)
            print(
                f"{model:>6} {batch:>5} {m['prefill_tok_s']:>14.0f} {m['decode_tok_s']:>13.1f} "
                f"{m['decode_step_ms']:>15.2f} {100 * m['outside_forward']:>15.1f}%"
            )


if __name__ == "__main__":
    main()
