"""Mixtral's sparse MoE in the engine (testbed/model/moe.py): a checkpoint transformers writes
decodes transformers' greedy tokens in every serving mode, the router spreads tokens over every
expert, the paged path equals the dense one on a MoE preset's dummy weights, and what the engine
does not run is one line."""

from __future__ import annotations

import pytest
import torch

from testbed import LLM
from testbed.errors import ConfigError
from testbed.model.config import ModelConfig
from testbed.model.tensor_parallel import check_shardable
from tests.cluster_helpers import make_config
from tests.hf_checkpoints import random_prompts, read_config, served_tokens_match, write_checkpoint, write_config

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    return directory, write_checkpoint("mixtral", directory)


def test_the_router_spreads_tokens_over_every_expert(mixtral):
    directory, _ = mixtral
    llm = LLM(str(directory), device="cpu")
    args = llm.engine.args
    assert (args.num_experts, args.experts_per_token) == (4, 2)
    moe = llm.engine.runner.model.layers[0].block_sparse_moe
    hidden = llm.engine.runner.model.embed_tokens(torch.tensor(random_prompts((64,), args.vocab_size)[0]))
    chosen, weights = moe.route(hidden)
    assert set(chosen.flatten().tolist()) == {0, 1, 2, 3}
    assert torch.allclose(weights.sum(-1), torch.ones(64))


@pytest.mark.parametrize("mode", ["colocated", "chunked", "disagg"])
def test_every_mode_serves_transformers_greedy_tokens(mixtral, mode, tmp_path):
    directory, model = mixtral
    disagg = ["cluster.num_prefill=1", "cluster.num_decode=1"] if mode == "disagg" else []
    cfg = make_config(
        "model=hf",
        f"model.path={directory}",
        f"mode={mode}",
        *disagg,
        "hardware=cpu",
        "workload.num_requests=3",
        "workload.rate=40",
        "workload.input_len.min=5",
        "workload.input_len.max=60",
        f"workload.output_len.min={NEW_TOKENS}",
        f"workload.output_len.max={NEW_TOKENS}",
    )
    assert served_tokens_match(cfg, model, tmp_path / "run") == 3


def test_a_moe_preset_runs_paged_as_it_runs_dense():
    llm = LLM("tiny", num_experts=4, experts_per_token=2, num_kv_blocks=64)
    prompt = list(range(1, 40))
    tokens = llm.generate([prompt], max_new_tokens=8)[0]
    model = llm.engine.runner.model
    for i, token in enumerate(tokens):  # each greedy token is the dense recompute's argmax
        logits = model.dense_forward(torch.tensor(prompt + tokens[:i]))
        assert int(logits[-1].argmax()) == token


def test_what_the_engine_does_not_run_is_one_line(mixtral, tmp_path):
    directory, _ = mixtral
    with pytest.raises(ConfigError, match="num_shared_experts=1: the engine runs Mixtral's sparse MoE"):
        LLM("tiny", num_experts=4, experts_per_token=2, num_shared_experts=1, num_kv_blocks=64)
    problem = "cluster.prefill_tp=2 with a Mixture-of-Experts model: the engine does not shard experts"
    with pytest.raises(ConfigError, match=problem) as error:
        make_config(
            "model=hf", f"model.path={directory}", "mode=disagg", "cluster.prefill_tp=2", "hardware.num_devices=3"
        )
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="does not shard"):
        check_shardable(ModelConfig(path=str(directory)).args(), 2)
    write_config(tmp_path, {**read_config(directory), "sliding_window": 4096})
    with pytest.raises(ConfigError, match="sliding_window=4096 is not supported"):
        ModelConfig(path=str(tmp_path)).args()
    tp2 = ("mode=disagg", "cluster.prefill_tp=2")
    simulated = make_config("executor=sim", "model=hf", f"model.path={directory}", *tp2)
    assert simulated.model.args().is_moe  # the simulator models experts under tensor parallelism
