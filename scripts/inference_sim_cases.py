"""The replay cases of vLLM 0.15.1 on H100 SXM, written from their per-stage figures.

    python scripts/inference_sim_cases.py            # rewrites tests/data/replay/inference_sim/*.json, *.setup.yaml

The figures (`vllm0151_h100_stages.csv`: one row per load stage, each with the source repository,
commit and path it was copied from) are inference-perf's lifecycle metrics of the public data set
inference-sim/training (`default_args/*/results/stage_N_lifecycle_metrics.json`). That client's
TPOT here counts stream events, two per generated token: (E2E - TTFT) / TPOT is twice the
generated tokens, and the tokens it gives match the workload's target length with `ignore_eos`
(CodeLlama 249-250 for 248; Llama-2-7B 248 where its re-tokenized count says 194-210). So the
case's TPOT is twice the client's (mean, median, p99) and its output length is the generated
tokens; TTFT and E2E are the client's (`converted` in each reference says so).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "replay" / "inference_sim"
EVENTS_PER_TOKEN = 2  # inference-perf's stream events per generated token in these runs (checked below)
# the model of each checkpoint: a preset, or the config.json copied beside the data
MODELS = {
    "llama2_7b": {"model": "llama2_7b", "dtype": "float16"},
    "llama2_70b": {"model_config": "llama2_70b/config.json", "dtype": "float16"},
    "codellama_34b": {"model_config": "codellama_34b/config.json", "dtype": "bfloat16"},
    "mixtral_8x7b": {"model": "mixtral_8x7b", "dtype": "bfloat16"},  # the preset is Mixtral-8x7B-v0.1's config.json
}
REQUESTS = 1000  # requests replayed a stage: past the warm-up of a stage of 3,000-12,000 (its mean is steady)


def rows() -> list[dict]:
    with open(DATA / "vllm0151_h100_stages.csv") as f:
        return list(csv.DictReader(f))


def generated_tokens(row: dict) -> float:
    """Tokens a request generated, from the client's own stream: its events over the two a token."""
    f = {k: float(row[k]) for k in ("e2e_mean_s", "ttft_mean_s", "tpot_event_mean_s")}
    return (f["e2e_mean_s"] - f["ttft_mean_s"]) / (EVENTS_PER_TOKEN * f["tpot_event_mean_s"]) + 1


def reference(row: dict) -> dict:
    """The stage in vLLM bench serve's summary keys (ms), TPOT per token."""
    tokens = generated_tokens(row)
    ms = lambda key: round(1000 * float(row[key]), 4)  # noqa: E731
    tpot = lambda key: round(1000 * EVENTS_PER_TOKEN * float(row[key]), 4)  # noqa: E731
    ok = int(row["ok"])
    return {
        "backend": "vllm",
        "client": "inference-perf (stage lifecycle metrics, converted)",
        "model_id": row["model"],
        "request_rate": float(row["rate"]),
        "num_prompts": int(row["sent"]),
        "completed": ok,
        "duration": round(ok / float(row["requests_per_s"]), 3),
        "request_throughput": round(float(row["requests_per_s"]), 4),
        "output_throughput": round(float(row["requests_per_s"]) * tokens, 2),
        "mean_ttft_ms": ms("ttft_mean_s"),
        "median_ttft_ms": ms("ttft_p50_s"),
        "p99_ttft_ms": ms("ttft_p99_s"),
        "mean_tpot_ms": tpot("tpot_event_mean_s"),
        "median_tpot_ms": tpot("tpot_event_p50_s"),
        "p99_tpot_ms": tpot("tpot_event_p99_s"),
        "mean_e2el_ms": ms("e2e_mean_s"),
        "median_e2el_ms": ms("e2e_p50_s"),
        "p99_e2el_ms": ms("e2e_p99_s"),
        "converted": f"TPOT x{EVENTS_PER_TOKEN} (stream events per token); output_throughput at "
        f"{tokens:.1f} generated tokens a request; source {row['source_repository']}@{row['source_commit'][:12]} "
        f"{row['source_path']}",
    }


def setup(row: dict) -> str:
    name = row["case"].rsplit("_s", 1)[0]
    model = MODELS[name.split("_tp")[0]]
    prompt, output = round(float(row["prompt_len_mean"])), round(generated_tokens(row))
    shared = int(row["system_prompt_len"])  # the stage's system prompt, a prefix-cache hit after its first request
    chosen = "\n".join(f"{k}: {v}" for k, v in model.items())
    return f"""# vLLM 0.15.1 serving {row["model"]} on H100 SXM at TP {row["tp"]}, inference-perf's {row["workload"]}
# workload (inference-sim/training, default_args; exp-config.yaml: the engine's settings below).
engine: vllm 0.15.1
gpu: h100_sxm
tp: {row["tp"]}
{chosen}
max_model_len: {row["max_model_len"]}
policy: chunked            # V1: chunked prefill always on, decodes first in the step's token budget
max_batched_tokens: {row["max_num_batched_tokens"]}
max_running: {row["max_num_seqs"]}
prefix_caching: true       # on in the engine: the {shared}-token system prompt is a hit after its first request
cuda_graphs: true
host_overhead_s: null      # the engine profile's (vllm_v1), or fitted (docs/validation.md)
host_overhead_per_seq_s: null
frontend_latency_s: null
workload:
  num_requests: {REQUESTS}
  arrival: constant          # inference-perf's constant load type: one request every 1/rate
  system_prompt_len: {shared}    # inference-perf's shared prefix, in the prompt's {prompt} tokens
  input_len: {{dist: fixed, mean: {prompt - shared}, min: 1, max: {prompt - shared}}}
  output_len: {{dist: fixed, mean: {output}, min: 1, max: {output}}}
unmodelled:
  - "one {shared}-token system prompt for all users (each group of users had its own: the same hits once cached)"
  - "the exact prompts (the stage's mean length; its lengths vary by a few percent)"
  - "{REQUESTS} requests of the stage's {row["sent"]}"
"""


def provenance(row: dict) -> str:
    return yaml.safe_dump(
        {
            "source": {k: row[f"source_{k}"] for k in ("repository", "commit", "path")},
            "engine": "vllm 0.15.1 (the data set's files do not name the version; the data set is described with it)",
            "client": "inference-perf (kubernetes-sigs/inference-perf), streaming completions, ignore_eos",
            "gpu": f"NVIDIA H100 SXM, tensor parallelism {row['tp']}",
            "model": row["model"],
            "file": f"{row['case']}.json: the stage's summary figures in vLLM bench serve's keys (ms), written by "
            "scripts/inference_sim_cases.py from vllm0151_h100_stages.csv; TPOT per token (twice the client's "
            "per-event figure)",
            "unknown": [
                "per-request figures (the per-request file is not copied; the stage's summary is)",
                "vLLM's exact commit and its flags beyond exp-config.yaml (defaults assumed)",
                "the prompts themselves (shared-prefix synthetic data; their mean length is known)",
            ],
        },
        sort_keys=False,
        width=110,
    )


def main() -> None:
    for row in rows():
        tokens = generated_tokens(row)
        target = float(row["output_len_target"])
        if abs(tokens - target) > 0.03 * target and int(row["failed"]) == 0:
            raise SystemExit(f"{row['case']}: {tokens:.0f} generated tokens, the target is {target:.0f}")
        (DATA / f"{row['case']}.json").write_text(json.dumps(reference(row), indent=1) + "\n")
        (DATA / f"{row['case']}.provenance.yaml").write_text(provenance(row))
        (DATA / f"{row['case'].rsplit('_s', 1)[0]}.setup.yaml").write_text(setup(row))


if __name__ == "__main__":
    main()
