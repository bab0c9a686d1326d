"""The paged engine's logits equal a dense full-recompute forward (float32, CPU)."""

import dataclasses

import pytest
import torch

from testbed.engine import BlockManager, EngineConfig, Scheduler, SchedulerConfig, Sequence
from testbed.engine.model_runner import ModelRunner
from testbed.engine.policies import make_policy
from testbed.model.config import PRESETS
from testbed.model.loader import build_model

RTOL = 1e-4
# tiny with grouped-query attention (4 heads, 2 KV heads) plus a variant with q/k/v biases and tied embeddings
ARGS = {
    "tiny": dataclasses.replace(PRESETS["tiny"], max_model_len=80),
    "qwen_like": dataclasses.replace(
        PRESETS["tiny"], max_model_len=80, qkv_bias=True, tie_embeddings=True, num_kv_heads=1
    ),
}


def make(args, policy, block_size=4, num_blocks=256, **sched):
    model = build_model(args, torch.device("cpu"), torch.float32, seed=1)
    runner = ModelRunner(model, EngineConfig(block_size=block_size, num_kv_blocks=num_blocks), torch.device("cpu"))
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=sched.pop("prefix", False))
    return model, runner, Scheduler(make_policy(policy), bm, SchedulerConfig(**sched))


def assert_close(got, ref):
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < RTOL, f"relative error {err:.2e}"


def drive(model, runner, scheduler, arrivals=None):
    """Step until idle; every sampled logit row is checked against the dense reference."""
    arrivals = arrivals or {}
    checked, step = 0, 0
    while scheduler.has_work() or any(k >= step for k in arrivals):
        for seq in arrivals.pop(step, []):
            scheduler.add(seq)
        step += 1
        batch = scheduler.schedule()
        if not batch.items:
            continue
        sampled, logits = runner.run(batch)
        rows = iter(logits)
        for (seq, n), token in zip(batch.items, sampled):
            if token is None:
                continue
            ref = model.dense_forward(torch.tensor(seq.token_ids[: seq.num_computed_tokens + n]))[-1]
            assert_close(next(rows), ref)
            checked += 1
        scheduler.postprocess(batch, sampled)
    assert scheduler.block_manager.num_used_blocks == 0
    return checked


def prompt(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(ARGS))
def test_whole_prefill_then_decode(name):
    model, runner, sched = make(ARGS[name], "colocated", max_batched_tokens=512)
    seq = Sequence(0, prompt(45), max_tokens=21)
    assert drive(model, runner, sched, {0: [seq]}) == 21
    assert len(seq.output_token_ids) == 21


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_then_20_decodes(chunk):
    model, runner, sched = make(ARGS["tiny"], "colocated", max_batched_tokens=chunk)
    seq = Sequence(0, prompt(59, seed=chunk), max_tokens=21)  # 80 tokens: max_model_len
    assert drive(model, runner, sched, {0: [seq]}) == 21


@pytest.mark.parametrize("name", list(ARGS))
def test_mixed_batch_of_sequences_at_different_stages(name):
    model, runner, sched = make(ARGS[name], "chunked", chunk_size=24, max_running=6)
    arrivals = {
        0: [Sequence(0, prompt(50, 1), 20), Sequence(1, prompt(3, 2), 20)],
        2: [Sequence(2, prompt(33, 3), 12)],
        5: [Sequence(3, prompt(1, 4), 20), Sequence(4, prompt(60, 5), 5)],
    }
    assert drive(model, runner, sched, arrivals) == 20 + 20 + 12 + 20 + 5


def test_preemption_under_a_tiny_pool_keeps_logits_exact():
    # 20 blocks of 4 tokens: three sequences of up to 40 tokens cannot all stay resident
    model, runner, sched = make(ARGS["tiny"], "chunked", num_blocks=20, chunk_size=32, max_running=3)
    seqs = [Sequence(i, prompt(20, i), 20) for i in range(3)]
    assert drive(model, runner, sched, {0: seqs}) == 60
    assert sum(s.num_preemptions for s in seqs) > 0


def test_prefix_cache_hits_share_blocks_and_keep_logits_exact():
    model, runner, sched = make(ARGS["tiny"], "chunked", chunk_size=64, max_running=4, prefix=True)
    shared = prompt(17, 9)
    first, second = Sequence(0, shared + [1, 2, 3], 4), Sequence(1, shared + [4, 5], 4)
    drive(model, runner, sched, {0: [first], 3: [second]})
    assert second.num_cached_tokens == 16  # four full blocks of the shared 17 tokens


@pytest.mark.parametrize("name", list(ARGS))
def test_equal_fresh_prompts_batched_beside_decodes_keep_logits_exact(name):
    # three 25-token prompts go through one causal SDPA, beside a 12-token prompt and a decode
    model, runner, sched = make(ARGS[name], "colocated", max_batched_tokens=512, max_running=8)
    arrivals = {
        0: [Sequence(0, prompt(30, 1), 10)],
        3: [
            Sequence(1, prompt(25, 2), 6),
            Sequence(2, prompt(25, 3), 6),
            Sequence(3, prompt(25, 4), 6),
            Sequence(4, prompt(12, 5), 6),
        ],
    }
    assert drive(model, runner, sched, arrivals) == 10 + 4 * 6
