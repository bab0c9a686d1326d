"""The same code paths on CUDA: skipped cleanly without a GPU (or without two for NCCL)."""

import dataclasses

import pytest
import torch

from testbed import LLM
from testbed.engine import BlockManager, EngineConfig, Scheduler, SchedulerConfig, Sequence
from testbed.engine.model_runner import ModelRunner
from testbed.engine.policies import make_policy
from testbed.model.attention import FLASH_ATTN_AVAILABLE
from testbed.model.config import PRESETS
from testbed.model.loader import build_model


def _paged_vs_dense(device: str, dtype: torch.dtype, backend: str, block_size: int, tolerance: float) -> None:
    args = dataclasses.replace(PRESETS["tiny"], max_model_len=1024)
    model = build_model(args, torch.device(device), dtype, seed=3)
    runner = ModelRunner(
        model, EngineConfig(block_size=block_size, num_kv_blocks=64, attention_backend=backend), torch.device(device)
    )
    scheduler = Scheduler(
        make_policy("chunked"), BlockManager(64, block_size), SchedulerConfig(chunk_size=96, max_running=4)
    )
    for i, length in enumerate((300, 17, 130)):
        scheduler.add(Sequence(i, [(7 * i + j) % 512 for j in range(length)], 6))
    while scheduler.has_work():
        batch = scheduler.schedule()
        sampled, logits = runner.run(batch)
        rows = iter(logits)
        for (seq, n), token in zip(batch.items, sampled):
            if token is not None:
                tokens = torch.tensor(seq.token_ids[: seq.num_computed_tokens + n], device=device)
                ref = model.dense_forward(tokens)[-1]
                err = (next(rows) - ref).abs().max().item() / ref.abs().max().item()
                assert err < tolerance, f"relative error {err:.2e} on {device} {dtype} {backend}"
        scheduler.postprocess(batch, sampled)
    assert scheduler.block_manager.num_used_blocks == 0


@pytest.mark.gpu
def test_paged_engine_matches_dense_on_cuda_float32():
    _paged_vs_dense("cuda:0", torch.float32, "torch", 16, 1e-4)


@pytest.mark.gpu
def test_paged_engine_matches_dense_on_cuda_bfloat16():
    _paged_vs_dense("cuda:0", torch.bfloat16, "torch", 16, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not FLASH_ATTN_AVAILABLE, reason="flash-attn is not installed (pip install -e '.[gpu]')")
def test_flash_backend_matches_dense():
    _paged_vs_dense("cuda:0", torch.bfloat16, "flash", 256, 3e-2)


@pytest.mark.gpu
def test_llm_on_cuda_matches_cpu_tokens_in_float32():
    prompts = [[1, 2, 3, 4] * 20, [9, 8, 7]]
    cpu = LLM("tiny", device="cpu", max_model_len=256, num_kv_blocks=64).generate(prompts, 8)
    gpu = LLM("tiny", device="cuda:0", dtype="float32", max_model_len=256, num_kv_blocks=64).generate(prompts, 8)
    assert gpu == cpu  # float32 and well-separated logits: the same greedy choices on both devices


@pytest.mark.multigpu
def test_tp2_over_nccl_produces_the_tp1_tokens(tmp_path):
    """A tensor-parallel worker over two GPUs (NCCL all-reduces; one GPU cannot pair two NCCL ranks,
    so this path needs two) takes one GPU's greedy tokens, and no rank keeps a block."""
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config

    common = ["workload.num_requests=8", "workload.rate=20", "model.max_model_len=512", "engine.num_kv_blocks=128"]
    common += ["hardware=gpu", "model.dtype=float32", "mode=colocated", "cluster.num_workers=1"]
    one = serve(make_config(*common), tmp_path / "tp1", progress=False)["requests"]
    two = serve(make_config(*common, "cluster.tp=2", "hardware.num_devices=2"), tmp_path / "tp2", progress=False)
    assert (two["requests"].status == "ok").all()
    assert list(two["requests"].output_token_ids.map(list)) == list(one.output_token_ids.map(list))
    assert all(v == 0 for v in two["summary"]["kv_blocks_leaked"].values())


@pytest.mark.multigpu
def test_disagg_over_nccl_produces_the_colocated_tokens(tmp_path):
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config

    common = [
        "workload.num_requests=8",
        "workload.rate=20",
        "model.max_model_len=512",
        "engine.num_kv_blocks=128",
        "hardware=gpu",
        "model.dtype=float32",
    ]
    colocated = serve(make_config(*common, "mode=colocated"), tmp_path / "colocated", progress=False)["requests"]
    disagg = serve(
        make_config(*common, "mode=disagg", "kv_transfer.granularity=layer", "kv_transfer.decode_binding=early"),
        tmp_path / "disagg",
        progress=False,
    )
    assert (disagg["requests"].status == "ok").all()
    assert list(disagg["requests"].output_token_ids.map(list)) == list(colocated.output_token_ids.map(list))
    assert all(v == 0 for v in disagg["summary"]["kv_blocks_leaked"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_matches_dense(block_size):
    pytest.importorskip("triton")
    _paged_vs_dense("cuda:0", torch.bfloat16, "triton", block_size, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_keep_greedy_tokens(dtype):
    """float32: the same tokens. bfloat16 (what real runs replay): a padded bucket's GEMM shapes may
    round differently from the eager batch's, so at least 90% of the tokens, and every first one."""
    prompts = [[(5 * i + j) % 500 + 1 for j in range(9 + 4 * i)] for i in range(11)]
    lengths = [4 + 3 * i for i in range(11)]  # finishing one by one: buckets 1..16 all replay
    options = dict(device="cuda:0", dtype=dtype, max_model_len=256, num_kv_blocks=128, max_running=16)
    eager = LLM("tiny", cuda_graphs=False, **options).generate(prompts, lengths)
    llm = LLM("tiny", cuda_graphs=True, **options)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    replayed = llm.generate(prompts, lengths)
    if dtype == "float32":
        assert replayed == eager
    else:
        same = sum(a == b for r, e in zip(replayed, eager) for a, b in zip(r, e)) / sum(lengths)
        assert same >= 0.9 and [r[0] for r in replayed] == [e[0] for e in eager], same
    assert llm.engine.num_used_blocks == 0


@pytest.mark.gpu
def test_a_memory_sized_pool_leaves_room_for_its_largest_step():
    """No explicit pool size: the weights (built in bf16), a profiled step of max_batched_tokens and
    the decode graphs' pool come off the device's share, and a step of that size then runs."""
    from testbed.engine import Engine

    torch.cuda.empty_cache()
    args = dataclasses.replace(PRESETS["small"], max_model_len=4096)
    engine = Engine.build(
        args,
        EngineConfig(),
        SchedulerConfig(max_batched_tokens=16384, max_running=16),
        "colocated",
        "cuda:0",
        dtype="bfloat16",
    )
    assert engine.runner.num_blocks * engine.runner.block_size >= args.max_model_len
    for i in range(4):  # four prompts of 4000 tokens: one step near max_batched_tokens
        engine.add(Sequence(i, [(i + j) % 4000 + 1 for j in range(4000)], 2))
    record = engine.step().record
    assert record.prefill_tokens == 16000
    engine.run_until_done()
    free, total = torch.cuda.mem_get_info(0)
    assert torch.cuda.max_memory_reserved(0) <= EngineConfig().gpu_memory_utilization * total


@pytest.mark.gpu
def test_disagg_on_one_gpu_over_ipc_produces_the_colocated_tokens(tmp_path):
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config

    common = [
        "workload.num_requests=8",
        "workload.rate=20",
        "model.max_model_len=512",
        "engine.num_kv_blocks=128",
        "hardware=gpu",
        "model.dtype=float32",
    ]
    colocated = serve(make_config(*common, "mode=colocated"), tmp_path / "colocated", progress=False)["requests"]
    disagg = serve(
        make_config(
            *common,
            "mode=disagg",
            "kv_transfer.backend=ipc",
            "cluster.prefill_devices=[0]",
            "cluster.decode_devices=[0]",
        ),
        tmp_path / "disagg",
        progress=False,
    )
    assert (disagg["requests"].status == "ok").all()
    assert list(disagg["requests"].output_token_ids.map(list)) == list(colocated.output_token_ids.map(list))
    assert all(v == 0 for v in disagg["summary"]["kv_blocks_leaked"].values())
