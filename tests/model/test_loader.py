"""Real checkpoints: what transformers writes loads into the engine and decodes its greedy tokens.

Every checkpoint here is written by transformers' save_pretrained (config.json in its current
layout + safetensors), and the engine's greedy tokens are compared with transformers' own
`generate` over 32 tokens, through `LLM` with default options and through a disagg 1P1D run.
"""

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from testbed import LLM
from testbed.errors import ConfigError
from testbed.model import linear
from testbed.model.config import ModelConfig
from testbed.model.llama import Rotary, checkpoint_tensors
from testbed.model.loader import build_model
from tests.cluster_helpers import make_config
from tests.hf_checkpoints import (
    KINDS,
    LLAMA3_ROPE,
    copy_with_config,
    hf_greedy,
    old_layout,
    random_prompts,
    read_config,
    served_tokens_match,
    write_checkpoint,
    write_config,
)

NEW_TOKENS = 32
PROMPT_LENGTHS = (1, 9, 40, 95)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """kind -> (checkpoint directory, prompts, transformers' greedy tokens); written once per kind."""
    cache = {}

    def get(kind):
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            model = write_checkpoint(kind, directory)
            prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size)
            cache[kind] = directory, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts], model
        return cache[kind][:3]

    get.model = lambda kind: cache[kind][3]
    return get


@pytest.mark.parametrize("kind", list(KINDS))
def test_llm_matches_transformers_greedy(kind, reference):
    directory, prompts, expected = reference(kind)
    assert all(len(set(tokens)) > NEW_TOKENS // 2 for tokens in expected), "degenerate reference outputs"
    llm = LLM(str(directory), device="cpu")
    assert llm.generate(prompts, NEW_TOKENS) == expected
    if kind == "wide" and linear.available():  # oneDNN's packed GEMM, and still transformers' tokens
        assert isinstance(llm.engine.runner.model.layers[0].mlp.gate_up_proj, linear.PackedLinear)


def test_written_configs_use_the_current_layout(reference):
    for kind in KINDS:
        config = read_config(reference(kind)[0])
        assert "rope_parameters" in config and "rope_theta" not in config and not config.get("rope_scaling"), kind
    assert read_config(reference("llama3")[0])["rope_parameters"] == LLAMA3_ROPE
    assert read_config(reference("gqa")[0])["head_dim"] == 32
    qwen = load_file(str(reference("qwen2")[0] / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen and "lm_head.weight" not in qwen  # biased, tied


@pytest.mark.parametrize(
    "kind, wrong_rope",
    [
        ("llama", None),  # the defect: no rope_parameters read, theta falls back to 10000
        ("llama3", {"rope_type": "default", "rope_theta": 500000.0}),  # the llama3 scaling left out
    ],
)
def test_a_wrong_rope_changes_the_tokens(kind, wrong_rope, reference, tmp_path):
    directory, prompts, expected = reference(kind)
    config = {k: v for k, v in read_config(directory).items() if k != "rope_parameters"}
    if wrong_rope:
        config["rope_parameters"] = wrong_rope
    wrong = copy_with_config(directory, tmp_path / "wrong", config)
    outputs = LLM(str(wrong), device="cpu").generate(prompts, NEW_TOKENS)
    assert sum(out != ref for out, ref in zip(outputs, expected)) >= len(prompts) - 1


def test_llama3_frequencies_equal_transformers_for_llama31_settings(tmp_path):
    """Llama-3.1-8B's RoPE (head_dim 128, theta 500000, factor 8, original 8192), bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=8,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    config.save_pretrained(tmp_path)
    args = ModelConfig(path=str(tmp_path)).args()
    ours = Rotary(128, args.rope_theta, 16, args.rope_scaling)
    theirs = LlamaRotaryEmbedding(config).inv_freq
    assert torch.equal(ours.inv_freq, theirs)
    assert not torch.equal(Rotary(128, 500000.0, 16).inv_freq, theirs)  # the scaling matters at these settings


@pytest.mark.parametrize("kind, type_key", [("llama", "rope_type"), ("llama3", "rope_type"), ("llama3", "type")])
def test_older_layout_reads_the_same_shape(kind, type_key, reference, tmp_path):
    directory = reference(kind)[0]
    old = copy_with_config(directory, tmp_path / "old", old_layout(read_config(directory), type_key))
    assert "rope_theta" in read_config(old) and "rope_parameters" not in read_config(old)
    assert ModelConfig(path=str(old)).args() == ModelConfig(path=str(directory)).args()


@pytest.mark.parametrize("layout", ["current", "older"])
@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_other_rope_types_are_refused_by_name(layout, rope_type, tmp_path):
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": rope_type, "rope_theta": 1e6, "factor": 4.0},
    }
    if layout == "older":
        config = old_layout(config, type_key="type")
    write_config(tmp_path, config)
    with pytest.raises(ConfigError, match=f"rope_type='{rope_type}' is not supported") as error:
        ModelConfig(path=str(tmp_path)).args()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "key, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"), ("partial_rotary_factor", 0.5)]
)
def test_options_the_model_lacks_are_refused_by_name(key, value, reference, tmp_path):
    directory = reference("llama")[0]
    write_config(tmp_path, {**read_config(directory), key: value})
    with pytest.raises(ConfigError, match=f"{key}={value!r} is not supported"):
        ModelConfig(path=str(tmp_path)).args()


def test_default_pool_caps_max_model_len_in_one_line(reference, caplog):
    directory = reference("llama3")[0]  # 131072 positions; a 64 MiB pool holds 65536 tokens
    with caplog.at_level(logging.WARNING, logger="testbed.engine.model_runner"):
        llm = LLM(str(directory), device="cpu", kv_cache_mib=64)
    assert llm.engine.args.max_model_len == 65536 and llm.engine.runner.num_blocks * 16 == 65536
    [record] = caplog.records
    assert "model.max_model_len lowered from 131072 to 65536" in record.getMessage()
    assert "\n" not in record.getMessage()
    with pytest.raises(ConfigError, match="exceeds model.max_model_len=65536"):
        llm.generate([[1] * 65530], max_new_tokens=8)
    # a length asked for explicitly is held to: the pool cannot hold it, so it is an error
    with pytest.raises(ConfigError, match="cannot hold one request of max_model_len=131072"):
        LLM(str(directory), device="cpu", kv_cache_mib=64, max_model_len=131072)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [[], ["cluster.prefill_tp=2", "hardware.num_devices=3"]], ids=["tp1", "p-tp2"])
def test_disagg_1p1d_matches_transformers_greedy(reference, tmp_path, tp):
    """At TP2 the prefill worker's two ranks each load the checkpoint and keep their shard, and the
    decode worker takes its KV heads from them."""
    directory, model = reference("gqa")[0], reference.model("gqa")
    cfg = make_config(
        "model=hf",
        f"model.path={directory}",
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=1",
        "hardware=cpu",
        *tp,
        "workload.num_requests=4",
        "workload.rate=40",
        "workload.input_len.min=5",
        "workload.input_len.max=80",
        f"workload.output_len.min={NEW_TOKENS}",
        f"workload.output_len.max={NEW_TOKENS}",
    )
    assert served_tokens_match(cfg, model, tmp_path / "run") == 4


def test_preset_head_dim_is_a_field(tmp_path):
    args = ModelConfig(name="tiny", head_dim=32).args()  # 4 heads x 32 != hidden 64
    assert (args.head_dim, args.kv_bytes_per_token) == (32, 2 * 2 * 2 * 32)
    assert ModelConfig(name="tiny", hidden_size=128).args().head_dim == 32  # re-derived from the override
    model = build_model(args, torch.device("cpu"), torch.float32)
    assert checkpoint_tensors(model)["layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert model.layers[0].self_attn.o_proj.weight.shape == (64, 128)
    llm = LLM("tiny", head_dim=32, num_kv_blocks=64)
    prompt = list(range(30))
    logits = llm.engine.runner.model.dense_forward(torch.tensor(prompt))
    assert llm.generate([prompt], max_new_tokens=1) == [[int(logits[-1].argmax())]]
    with pytest.raises(ConfigError, match="model.head_dim=7 must be even"):
        ModelConfig(name="tiny", head_dim=7).args()


def test_missing_tensor_is_named(reference, tmp_path):
    directory = reference("llama")[0]
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    args = ModelConfig(path=str(directory)).args()
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight"):
        build_model(args, torch.device("cpu"), torch.float32, path=str(tmp_path))


def test_mismatched_shape_is_named(reference):
    directory = reference("llama")[0]
    wrong = dataclasses.replace(ModelConfig(path=str(directory)).args(), intermediate_size=96)
    with pytest.raises(
        ConfigError,
        match=r"tensor model.layers.0.mlp.down_proj.weight has shape \(64, 128\), "
        r"the model expects \(64, 96\)",
    ):
        build_model(wrong, torch.device("cpu"), torch.float32, path=str(directory))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig(path=str(tmp_path)).args()
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="missing key"):
        ModelConfig(path=str(tmp_path)).args()
    args = ModelConfig(name="tiny").args()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        build_model(args, torch.device("cpu"), torch.float32, path=str(tmp_path))


def test_bad_presets_and_shapes_are_one_line_errors():
    with pytest.raises(ConfigError, match="not a preset"):
        ModelConfig(name="gpt5").args()
    with pytest.raises(ConfigError, match="model.num_heads=5 must divide model.hidden_size=64"):
        ModelConfig(name="tiny", num_heads=5).args()
    with pytest.raises(ConfigError, match="num_kv_heads=3 must divide"):
        ModelConfig(name="tiny", num_kv_heads=3).args()


def test_vs_transformers_benchmark_runs_both_engines_on_one_checkpoint():
    pytest.importorskip("transformers")
    from testbed.bench.engine_speed import vs_transformers

    rows = vs_transformers("tiny", batch=2, prompt_len=8, new_tokens=4, repeats=1)
    # LLM with its defaults, tuned to the batch, and with its defaults on torch's linear
    assert [r["setting"] for r in rows] == ["defaults", "tuned", "torch GEMM"]
    for result in rows:
        assert result["same_tokens"] == 2 and result["ratio"] > 0
        assert result["pair_ratio_min"] <= result["pair_ratio_median"] <= result["pair_ratio_max"]
