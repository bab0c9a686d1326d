"""The analytical model against published measurements: python -m testbed.perf.check

Prints markdown tables (decode steps; prefill throughput; prefill chunks near the ridge) with the
model's prediction, the published figure and their ratio, and the model's own figures for
Llama-3-8B on every GPU: the tables of experiments/profile/README.md.
Two kinds of reference:
- engine end to end (the model's whole step, per-step overhead included): vLLM's nightly latency
  benchmark and a vLLM 0.23 concurrency sweep;
- GPU time of the non-attention layers (the model's GEMM + elementwise components, no overhead,
  no attention, no lm_head): Vidur's operator profiles, medians of every per-layer op but the
  embedding, summed and multiplied by the layer count. The matmul MFU of the table comes from
  these profiles too, so the prefill rows check the model's shape (per-GEMM roofline, elementwise
  traffic), not an independent factor; the decode rows test only the bandwidth share.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.model.config import PRESETS
from testbed.perf.gpus import GPUS
from testbed.perf.roofline import RooflineModel

LLAMA2_7B = PRESETS["llama2_7b"]
MODELS = {"llama3_8b": PRESETS["llama3_8b"], "llama2_7b": LLAMA2_7B}

VLLM_LATENCY = (
    "vLLM nightly latency benchmark, latency_llama8B_tp1 (batch 8, 32 in, 128 out), "
    "buildkite vllm/performance-benchmark build {}"
)
MUSGRAVE = "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23, 1024 in, concurrency 1: ~75 tok/s)"
VIDUR = "microsoft/vidur@7d47513 data/profiling/compute/{}/mlp.csv, non-attention layers"


@dataclass(frozen=True)
class Reference:
    model: str
    gpu: str
    batch: int  # decodes in the step, or prompt tokens
    published_ms: float
    what: str  # "e2e" (whole step), "vllm_latency" (the latency benchmark's mean step), "layers" (Vidur)
    source: str


# Vidur rows: per-layer milliseconds (medians of the layer's ops, summed) times 32 layers
DECODE = [
    Reference("llama3_8b", "a100_80g", 8, 1579.27 / 128, "vllm_latency", VLLM_LATENCY.format(9523)),
    Reference("llama3_8b", "h200", 8, 833.42 / 128, "vllm_latency", VLLM_LATENCY.format(9515)),
    Reference("llama3_8b", "a100_40g", 1, 1000 / 75, "e2e", MUSGRAVE),
    *(
        Reference("llama2_7b", "h100_sxm", n, 32 * ms, "layers", VIDUR.format("h100/meta-llama/Llama-2-7b-hf"))
        for n, ms in ((1, 0.175), (16, 0.181), (64, 0.183))
    ),
    *(
        Reference("llama3_8b", "a100_80g", n, 32 * ms, "layers", VIDUR.format("a100/meta-llama/Meta-Llama-3-8B"))
        for n, ms in ((1, 0.303), (16, 0.3165), (64, 0.351))
    ),
]
PREFILL = [
    *(
        Reference("llama2_7b", "h100_sxm", n, 32 * ms, "layers", VIDUR.format("h100/meta-llama/Llama-2-7b-hf"))
        for n, ms in ((2048, 1.2665), (4096, 2.592))
    ),
    *(
        Reference("llama3_8b", "a100_80g", n, 32 * ms, "layers", VIDUR.format("a100/meta-llama/Meta-Llama-3-8B"))
        for n, ms in ((2048, 4.431), (8192, 16.9565))
    ),
]
# Chunk-sized token counts, between the memory-bound and the compute-bound regime: where a max()
# roofline is most optimistic (neither bound is reached).
RIDGE = [
    *(
        Reference("llama2_7b", "h100_sxm", n, 32 * ms, "layers", VIDUR.format("h100/meta-llama/Llama-2-7b-hf"))
        for n, ms in ((256, 0.286), (512, 0.3745))
    ),
    *(
        Reference("llama3_8b", "a100_80g", n, 32 * ms, "layers", VIDUR.format("a100/meta-llama/Meta-Llama-3-8B"))
        for n, ms in ((128, 0.412), (256, 0.609))
    ),
]


def model_for(ref: Reference) -> RooflineModel:
    return RooflineModel(GPUS[ref.gpu], MODELS[ref.model], dtype_bytes=2)


def layers_s(model: RooflineModel, tokens: int) -> float:
    """GPU time of the non-attention layers for `tokens` tokens: what Vidur's op profiles sum to."""
    return model.model_args.num_layers * model.layer_gemms(tokens) + model.elementwise(tokens)


def vllm_latency_step_s(model: RooflineModel, batch: int = 8, prompt: int = 32, output: int = 128) -> float:
    """The latency benchmark's mean step: one prefill of the batch's prompts, then a decode step
    per further token, each sequence's context growing by one."""
    chunks = [(prompt, 0)] * batch
    total = model.step_time(batch * prompt, model.prefill_context(chunks), 0, 0)
    total += sum(model.step_time(0, 0.0, batch, batch * (prompt + i)) for i in range(1, output))
    return total / output


def predicted_ms(ref: Reference) -> float:
    model = model_for(ref)
    if ref.what == "layers":
        return 1e3 * layers_s(model, ref.batch)
    if ref.what == "vllm_latency":
        return 1e3 * vllm_latency_step_s(model, batch=ref.batch)
    context = 1024 + 64  # mid-way through a 1024-token prompt's 128 outputs
    return 1e3 * model.step_time(0, 0.0, ref.batch, ref.batch * context)


def decode_rows() -> list[list[str]]:
    rows = []
    for ref in DECODE:
        got = predicted_ms(ref)
        rows.append(
            [
                ref.model,
                ref.gpu,
                str(ref.batch),
                ref.what,
                f"{got:.2f}",
                f"{ref.published_ms:.2f}",
                f"{got / ref.published_ms:.2f}",
                ref.source,
            ]
        )
    return rows


def prefill_rows(refs: list[Reference] = PREFILL) -> list[list[str]]:
    rows = []
    for ref in refs:
        got = predicted_ms(ref)
        model = model_for(ref)
        full = model.step_time(ref.batch, model.prefill_context([(ref.batch, 0)]), 0, 0)
        rows.append(
            [
                ref.model,
                ref.gpu,
                str(ref.batch),
                f"{1e3 * ref.batch / got:,.0f}",
                f"{1e3 * ref.batch / ref.published_ms:,.0f}",
                f"{ref.published_ms / got:.2f}",
                f"{ref.batch / full:,.0f}",
                ref.source,
            ]
        )
    return rows


def prediction_rows(model_name: str = "llama3_8b") -> list[list[str]]:
    """The whole step of `model_name` on every GPU of the table: decodes at 1K context, lone prompts."""
    rows = []
    for name, gpu in GPUS.items():
        m = RooflineModel(gpu, MODELS[model_name], dtype_bytes=2)
        decode = [1e3 * m.step_time(0, 0.0, n, n * 1024) for n in (1, 16, 64)]
        prefill = [n / m.step_time(n, m.prefill_context([(n, 0)]), 0, 0) for n in (2048, 8192)]
        rows.append([model_name, name, *(f"{ms:.2f}" for ms in decode), *(f"{tps:,.0f}" for tps in prefill)])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    print("Decode step (ms); ratio = predicted / published")
    print(
        table(["model", "GPU", "batch", "compared", "predicted ms", "published ms", "ratio", "source"], decode_rows())
    )
    print("\nPrefill throughput of one prompt (tokens/s); ratio = predicted / published throughput")
    print(
        table(
            [
                "model",
                "GPU",
                "tokens",
                "predicted tok/s (layers)",
                "published tok/s",
                "ratio",
                "predicted tok/s (whole step)",
                "source",
            ],
            prefill_rows(),
        )
    )
    print("\nNear the ridge (chunks of 128-512 tokens): the same comparison as the prefill table")
    print(
        table(
            [
                "model",
                "GPU",
                "tokens",
                "predicted tok/s (layers)",
                "published tok/s",
                "ratio",
                "predicted tok/s (whole step)",
                "source",
            ],
            prefill_rows(RIDGE),
        )
    )
    print("\nThe whole step on each GPU (overhead included): decode ms at 1K context, prefill tokens/s of one prompt")
    print(
        table(
            ["model", "GPU", "decode b=1", "decode b=16", "decode b=64", "prefill 2K", "prefill 8K"], prediction_rows()
        )
    )


if __name__ == "__main__":
    main()
