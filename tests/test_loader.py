"""Real weights: a random checkpoint in Hugging Face layout round-trips through the loader."""

import json

import pytest
import torch
from safetensors.torch import save_file

from testbed import LLM
from testbed.errors import ConfigError
from testbed.model.config import ModelArgs, ModelConfig
from testbed.model.llama import Transformer, init_dummy_weights
from testbed.model.loader import build_model

ARGS = ModelArgs(vocab_size=300, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                 num_kv_heads=2, max_model_len=256, rope_theta=50000.0, rms_norm_eps=1e-6)


def write_checkpoint(directory, args: ModelArgs, model_type="llama", drop=None):
    model = Transformer(args)
    init_dummy_weights(model, seed=7)
    tensors = {(n if n.startswith("lm_head") else f"model.{n}"): p.detach().clone()
               for n, p in model.named_parameters()}
    tensors.pop(drop, None)
    half = len(tensors) // 2  # two shards, as real checkpoints have
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:half]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(directory / "model-00002-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": model_type, "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "max_position_embeddings": args.max_model_len, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.rms_norm_eps, "tie_word_embeddings": args.tie_embeddings}))
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_loaded_checkpoint_reproduces_reference_logits(tmp_path, model_type):
    args = ModelArgs(**{**ARGS.__dict__, "qkv_bias": model_type == "qwen2"})
    reference = write_checkpoint(tmp_path, args, model_type)
    assert ModelConfig(path=str(tmp_path)).args() == args
    loaded = build_model(args, torch.device("cpu"), torch.float32, path=str(tmp_path))
    tokens = torch.arange(40) % args.vocab_size
    torch.testing.assert_close(loaded.dense_forward(tokens), reference.dense_forward(tokens), rtol=1e-5, atol=1e-5)
    # and the paged engine over the loaded weights generates the reference's greedy tokens
    ref_tokens, seq = [], tokens.tolist()
    for _ in range(6):
        ref_tokens.append(int(reference.dense_forward(torch.tensor(seq))[-1].argmax()))
        seq.append(ref_tokens[-1])
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64)
    assert llm.generate([tokens.tolist()], max_new_tokens=6) == [ref_tokens]


def test_missing_tensor_is_named(tmp_path):
    write_checkpoint(tmp_path, ARGS, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight"):
        build_model(ARGS, torch.device("cpu"), torch.float32, path=str(tmp_path))


def test_mismatched_shape_is_named(tmp_path):
    write_checkpoint(tmp_path, ARGS)
    wrong = ModelArgs(**{**ARGS.__dict__, "intermediate_size": 64})
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.mlp.down_proj.weight has shape \(48, 96\), the model expects \(48, 64\)"):
        build_model(wrong, torch.device("cpu"), torch.float32, path=str(tmp_path))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig(path=str(tmp_path)).args()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="missing key"):
        ModelConfig(path=str(tmp_path)).args()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        build_model(ARGS, torch.device("cpu"), torch.float32, path=str(tmp_path))


def test_bad_presets_and_shapes_are_one_line_errors():
    with pytest.raises(ConfigError, match="not a preset"):
        ModelConfig(name="gpt5").args()
    with pytest.raises(ConfigError, match="model.num_heads=5 must divide model.hidden_size=64"):
        ModelConfig(name="tiny", num_heads=5).args()
    with pytest.raises(ConfigError, match="num_kv_heads=3 must divide"):
        ModelConfig(name="tiny", num_kv_heads=3).args()
