"""Profile one engine on this device: python -m testbed.measure.step_profile --model tiny --out p.json [--quick]

Step time is measured with a real `Engine` (chunked policy, so one step can hold decodes and
prefill chunks): sequences are staged directly in the scheduler in the state a shape needs (a
prefill chunk after k cached tokens, decodes of a given context), then one `engine.step()` is
timed, scheduling and postprocessing included, as a worker's step is. Median of a few repeats
after one warm-up. On the CPU the engine runs on one thread, as CPU workers do.

KV transfer is measured by `testbed.measure.transfer_profile` (two gloo / NCCL processes, or the
pack + unpack of the connector in quick mode). The profile is JSON: model shape, device, dtype,
versions, raw samples, the fitted cost model and its relative error on the samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
from testbed.errors import ConfigError, TestbedError
from testbed.measure.transfer_profile import measure_ipc, measure_transfer
from testbed.model.config import ModelConfig
from testbed.model.loader import build_model, resolve_dtype
from testbed.sim.cost_model import attended_context, fit_profile

PROFILE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Shape:
    """One measured step: prefill chunks as (new tokens, cached tokens) and decode contexts."""

    chunks: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n + k for n, k in self.chunks) + sum(self.decodes) + len(self.decodes)


def shapes(max_len: int, token_budget: int, quick: bool) -> list[Shape]:
    """Prefill sizes x cached context, decode batch x context, and mixed steps, all within the
    model's length and a KV budget (`token_budget` tokens staged at once)."""
    sizes = (32, 256, max_len // 2) if quick else (16, 64, 256, 1024, max_len // 2)
    cached = (0, max_len // 2) if quick else (0, max_len // 4, max_len // 2)
    batches = (1, 16, 64) if quick else (1, 4, 16, 64, 128)
    contexts = (128, max_len // 2) if quick else (64, 256, max_len // 4, max_len // 2)
    out = [
        Shape(chunks=((n, k),)) for n in sorted(set(sizes)) for k in sorted(set(cached)) if 0 < n and n + k <= max_len
    ]
    out += [Shape(decodes=(c,) * b) for b in batches for c in sorted(set(contexts)) if b * c <= token_budget and c >= 2]
    mix_context = max(2, min(256, max_len // 4))
    for b in (16,) if quick else (8, 32):
        for n in (128,) if quick else (64, 512):
            if n <= max_len and b * mix_context + n <= token_budget:
                out.append(Shape(chunks=((n, 0),), decodes=(mix_context,) * b))
    return out


def stage(engine: Engine, shape: Shape) -> list[Sequence]:
    """Sequences RUNNING in the scheduler whose next step is exactly `shape`."""
    staged, bm, vocab = [], engine.block_manager, engine.args.vocab_size
    for i, (new, cached) in enumerate(shape.chunks):
        seq = Sequence(i, [t % vocab for t in range(cached + new)], max_tokens=2)
        bm.allocate(seq, cached + new)
        seq.num_computed_tokens = cached
        staged.append(seq)
    for i, context in enumerate(shape.decodes, start=len(shape.chunks)):
        seq = Sequence(i, [t % vocab for t in range(context - 1)], max_tokens=context)
        seq.append_token(0)  # one output token: the sequence is decoding
        bm.allocate(seq, context)
        seq.num_computed_tokens = context - 1
        staged.append(seq)
    for seq in staged:
        engine.scheduler.add_running(seq)
    return staged


def time_shape(engine: Engine, shape: Shape, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms caches and allocator
        staged = stage(engine, shape)
        record = engine.step().record
        assert record.prefill_tokens == sum(n for n, _ in shape.chunks) and record.decode_seqs == len(shape.decodes)
        for seq in staged:
            engine.abort(seq.seq_id)
        assert engine.num_used_blocks == 0
        times.append(record.end - record.start)
    return statistics.median(times[1:])


def sample_row(shape: Shape, seconds: float, causal: bool) -> dict:
    return {
        "prefill_tokens": sum(n for n, _ in shape.chunks),
        "prefill_context": attended_context(shape.chunks, causal),
        "decode_seqs": len(shape.decodes),
        "decode_context": sum(shape.decodes),
        "seconds": seconds,
        "chunks": [list(c) for c in shape.chunks],
    }


# the share of the memory left after the weights that staged KV may take: the rest is for a 16K-token
# prefill's activations and the allocator's slack (Llama-3-8B on an 80 GB GPU: about 300K tokens)
KV_SHARE = 0.6


def kv_token_budget(args, dtype: torch.dtype, block_size: int, free: int | None, quick: bool) -> int:
    """Tokens of KV staged at once: 64K (16K quick), 8x that on CUDA, at most what fits in
    KV_SHARE of the free memory (free: bytes after the model loaded; None on CPU)."""
    want = 1 << 14 if quick else 1 << 16
    if free is None:
        return want
    holds = int(free * KV_SHARE) // (args.kv_bytes_per_token * dtype.itemsize)
    fits = holds - args.max_model_len - 256 * block_size  # build_engine's extra blocks
    if fits < args.max_model_len:
        raise ConfigError(
            f"profile at model.max_model_len={args.max_model_len}: {KV_SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free after the weights holds KV for {holds} tokens, and profiling "
            f"needs {2 * args.max_model_len + 256 * block_size}; lower model.max_model_len or free the "
            "device"
        )
    return min(8 * want, fits)


def build_engine(
    model: ModelConfig, engine: EngineConfig, device: torch.device, quick: bool
) -> tuple[Engine, int | None, int]:
    """The profiling engine, on CUDA the free memory after the model loaded (what the KV pool of a
    serving worker would be carved from), and the KV budget in tokens (`kv_token_budget`)."""
    args = model.args()
    dtype = resolve_dtype(model.dtype, device)
    net = build_model(args, device, dtype, path=model.path, seed=model.seed)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    token_budget = kv_token_budget(args, dtype, engine.block_size, free, quick)
    blocks = -(-token_budget // engine.block_size) + 256  # room for every staged shape
    pool = dataclasses.replace(
        engine, num_kv_blocks=max(blocks, -(-args.max_model_len // engine.block_size)), enable_prefix_caching=False
    )
    budget = token_budget + args.max_model_len
    scheduler = SchedulerConfig(max_batched_tokens=budget, chunk_size=budget, max_running=1024)
    return Engine(net, pool, scheduler, "chunked", device), free, token_budget


def profile_engine(
    model: ModelConfig, engine: EngineConfig, device: str = "cpu", *, quick: bool = False, measure_kv: bool = True
) -> dict:
    """Measure step and KV-transfer times on `device`; the profile dict (JSON-ready)."""
    device = torch.device(device)
    engine = engine.for_device(device.type)  # the block size this device's workers get
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a CPU worker process runs
    args = model.args()
    runner_engine, free, token_budget = build_engine(model, engine, device, quick)
    repeats = 3 if quick else 7
    backend = runner_engine.runner.backend.name
    causal = backend == "flash"  # the torch backend computes a chunk's whole masked matrix
    started = time.perf_counter()
    with torch.inference_mode():
        steps = [
            sample_row(s, time_shape(runner_engine, s, repeats), causal)
            for s in shapes(args.max_model_len, token_budget, quick)
        ]
    dtype = runner_engine.runner.dtype
    transfer, transfer_source = measure_transfer(runner_engine.runner, quick=quick or not measure_kv)
    transfer_ipc, ipc_source = measure_ipc(runner_engine.runner, repeats=3)
    profile = {
        "version": PROFILE_VERSION,
        "model_name": model.name,
        "model": dataclasses.asdict(args),
        "device": str(device),
        "device_name": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_bytes": dtype.itemsize,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "block_size": engine.block_size,
        "attention_backend": backend,
        "causal_attention": causal,
        "kv_free_bytes": free,
        "transfer_source": transfer_source,
        "quick": quick,
        "transfer_ipc_source": ipc_source,
        "samples": {"step": steps, "transfer": transfer, "transfer_ipc": transfer_ipc},
        "profile_s": time.perf_counter() - started,
    }
    profile["cost_model"], profile["fit"] = fit_profile(profile)
    return profile


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a preset name (testbed/model/config.py)")
    parser.add_argument("--model-path", default=None, help="a local Hugging Face directory instead of a preset")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--block-size", type=int, default=None, help="default: the device's (16, or 256 for flash-attn)"
    )
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats; KV from pack + unpack only")
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    model = ModelConfig(name=a.model, path=a.model_path, dtype=a.dtype, max_model_len=a.max_model_len)
    engine = EngineConfig(block_size=a.block_size, attention_backend=a.attention_backend)
    try:
        profile = profile_engine(model, engine, a.device, quick=a.quick)
    except TestbedError as error:  # bad input: one line, as python -m testbed says it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]
    print(
        f"{len(profile['samples']['step'])} step samples, {len(profile['samples']['transfer'])} transfer samples "
        f"({profile['transfer_source']}) in {profile['profile_s']:.1f} s"
    )
    print(
        f"step fit relative error: mean {fit['step_relative_error']['mean']:.1%}, "
        f"max {fit['step_relative_error']['max']:.1%}; transfer: mean {fit['transfer_relative_error']['mean']:.1%}; "
        f"ipc ({profile['transfer_ipc_source']}): mean {fit['ipc_relative_error']['mean']:.1%}"
    )
    for key, value in profile["cost_model"].items():
        print(f"  {key:>28} {value}" if isinstance(value, bool) else f"  {key:>28} {value:.4g}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
