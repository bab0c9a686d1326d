"""testbed/model/tensor_parallel.py: a real tensor-parallel group of engines, one process per rank
over gloo (testbed/bench/tp_group.py), takes the greedy tokens of one unsharded engine: on seeded
dummy weights at TP 2 and 4 (4 ranks over 2 KV heads: each head replicated on two ranks, as vLLM
does), and on a checkpoint transformers wrote, whose TP1 tokens are transformers' own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from testbed.bench.tp_group import greedy
from testbed.model.config import preset
from testbed.model.llama import Transformer, checkpoint_tensors
from testbed.model.tensor_parallel import check_shardable, shard_args, slice_of
from tests.hf_checkpoints import hf_greedy, random_prompts, write_checkpoint

TINY = replace(preset("tiny"), max_model_len=256)  # 4 heads, 2 KV heads, 128-wide MLP
PROMPTS = [[(3 * i + j) % 500 + 1 for j in range(20 + 7 * i)] for i in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_group_takes_the_greedy_tokens_of_one_engine(tp):
    assert greedy(TINY, tp, PROMPTS, 12) == greedy(TINY, 1, PROMPTS, 12)


@pytest.mark.slow
def test_a_tp2_group_on_a_transformers_checkpoint_takes_transformers_tokens(tmp_path):
    from testbed.model.config import ModelConfig

    model = write_checkpoint("llama", tmp_path)
    prompts = random_prompts((5, 17), model.config.vocab_size)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    args = replace(ModelConfig(path=str(tmp_path)).args(), max_model_len=64)  # a pool sized to the prompts
    assert greedy(args, 2, prompts, 8, path=tmp_path) == expected


def test_the_shards_add_up_to_the_full_model():
    """Column-parallel rows and row-parallel columns of every rank tile the full tensors; a KV
    head is on the ranks whose query heads read it."""
    full = Transformer(TINY)
    for tp in (2, 4):
        tensors = checkpoint_tensors(full)
        shard = checkpoint_tensors(Transformer(shard_args(TINY, tp)))
        for name, tensor in tensors.items():
            parts = [slice_of(name, tensor, TINY, r, tp) for r in range(tp)]
            assert all(p.shape == shard[name].shape for p in parts), name
            if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
                assert torch.equal(torch.cat(parts), tensor), name
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                assert torch.equal(torch.cat(parts, dim=1), tensor), name
    assert [list(TINY.kv_heads_of(r, 2)) for r in range(2)] == [[0], [1]]
    assert [list(TINY.kv_heads_of(r, 4)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated


def test_degrees_the_shape_does_not_split_are_refused():
    check_shardable(TINY, 4)
    with pytest.raises(ValueError, match="tp=3 must divide num_heads=4"):
        check_shardable(TINY, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3: one must divide the other"):
        check_shardable(replace(TINY, num_heads=8, num_kv_heads=3, intermediate_size=128), 2)
