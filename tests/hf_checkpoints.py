"""Tiny checkpoints written by transformers itself (config.json + safetensors), and its greedy tokens.

Weights are transformers' own random init with a larger std (and random q/k/v biases, which its
init zeroes), so greedy outputs vary from token to token and a RoPE or shape mistake shows up
in them. The llama3 checkpoint's original_max_position_embeddings is small so that its frequency
scaling changes tokens within a short prompt, and its max_position_embeddings exceeds what the
default 64 MiB KV pool holds, so loading it with default options exercises the pool sizing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INIT_STD = 0.3
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    initializer_range=INIT_STD,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (transformers class names, config keywords)
KINDS = {
    # a large theta: the default 10000 would change the tokens
    "llama": ("Llama", dict(max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # 4 KV heads x 16 x 2 layers x K,V x float32 = 1 KiB per token: 64 MiB holds 65536 < 131072 positions
    "llama3": ("Llama", dict(num_key_value_heads=4, max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE)),
    "qwen2": (
        "Qwen2",
        dict(
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # 512 wide: projections large enough for the CPU's packed GEMM (testbed.model.linear)
    "wide": (
        "Llama",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=4,
            initializer_range=0.05,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # Mixtral's sparse MoE: 4 experts of width 128, 2 per token, the router's weights random as the rest
    "mixtral": (
        "Mixtral",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # GQA with head_dim 32 != hidden 64 / 4 heads
    "gqa": (
        "Llama",
        dict(head_dim=32, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 2e5}),
    ),
}


def write_checkpoint(kind: str, directory: Path, seed: int = 0):
    """Save a random `kind` checkpoint with save_pretrained; returns the float32 model in eval mode."""
    import transformers

    family, extra = KINDS[kind]
    config = getattr(transformers, f"{family}Config")(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.eos_token_id = None  # greedy to the full length, as the engine runs
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def write_config(directory: Path, config: dict) -> None:
    (directory / "config.json").write_text(json.dumps(config))


def copy_with_config(src: Path, dst: Path, config: dict) -> Path:
    """The same weights under another config.json (a different RoPE layout or setting)."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.glob("*.safetensors"):
        (dst / file.name).symlink_to(file)
    write_config(dst, config)
    return dst


def old_layout(config: dict, type_key: str = "rope_type") -> dict:
    """The layout transformers 4.x wrote: a top-level rope_theta, rope_scaling for the rest."""
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    rope = dict(config["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    old["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **rope}
    return old


def served_tokens_match(cfg, model, out_dir: Path) -> int:
    """Serve `cfg`'s workload (real workers) and hold every request's tokens to transformers' greedy
    tokens of the same prompt and length; the number of requests checked."""
    from testbed.studies.real_cluster import serve
    from testbed.workload import build_workload

    requests = serve(cfg, out_dir, progress=False)["requests"].set_index("request_id")
    assert (requests.status == "ok").all(), requests.reason.unique()
    args = cfg.model.args()
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size, max_model_len=args.max_model_len)
    for request in workload.requests:
        expected = hf_greedy(model, list(request.prompt_token_ids), request.output_len)
        assert list(requests.loc[request.request_id, "output_token_ids"]) == expected, request.request_id
    return len(workload.requests)
