"""Attention backends and decode graphs on CPU: the torch backend's batched chunks against a plain
per-sequence reference; the flash backend's calls against flash-attn's documented semantics (a
reference of them stands in for the library, which needs CUDA); which backend and block size each
device gets; CUDA-graph bookkeeping (buckets, padding, scratch block) with tokens unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from testbed import LLM
from testbed.engine.config import EngineConfig
from testbed.engine.cuda_graphs import buckets
from testbed.errors import ConfigError
from testbed.model import attention, cpu_ops
from testbed.model.attention import AttentionMetadata, FlashAttention, TorchAttention, select_backend, write_kv
from testbed.model.kv_layout import default_block_size

BS, HKV, GROUP, DIM = 4, 2, 3, 8


def reference(q, k_cache, v_cache, tables, q_lens, kv_lens):
    """Per sequence: its keys gathered token by token, softmax with a lower-right causal mask."""
    out, row = [], 0
    for table, q_len, kv_len in zip(tables, q_lens, kv_lens):
        slots = [table[t // BS] * BS + t % BS for t in range(kv_len)]
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(GROUP, 1)  # (S, H, D)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(GROUP, 1)
        qs = q[row : row + q_len]
        scores = torch.einsum("qhd,shd->hqs", qs, k) / math.sqrt(DIM)
        seen = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
        scores = scores.masked_fill(~seen, float("-inf"))
        out.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v))
        row += q_len
    return torch.cat(out)


def batch(q_lens, kv_lens, seed=0, block_major=False):
    """A pool with scattered blocks, this step's new K/V written, and its metadata. block_major: the
    caches are layer 1's views of a (blocks, 3 layers, 2, BS, Hkv, D) pool, as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in kv_lens) + 3
    if block_major:
        pool = torch.randn(num_blocks, 3, 2, BS, HKV, DIM, generator=gen)
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    else:
        k_cache, v_cache = (torch.randn(num_blocks, BS, HKV, DIM, generator=gen) for _ in range(2))
    stride = attention.block_stride(k_cache)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in kv_lens:
        tables.append(ids[used : used + -(-n // BS)])
        used += len(tables[-1])
    t = sum(q_lens)
    q = torch.randn(t, HKV * GROUP, DIM, generator=gen)
    k, v = torch.randn(t, HKV, DIM, generator=gen), torch.randn(t, HKV, DIM, generator=gen)
    slots = [tab[p // BS] * stride + p % BS for tab, ql, kl in zip(tables, q_lens, kv_lens) for p in range(kl - ql, kl)]
    width = max(len(x) for x in tables)
    meta = AttentionMetadata(
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        num_single=sum(1 for x in q_lens if x == 1),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        kv_lens_t=torch.tensor(kv_lens, dtype=torch.int32),
        cu_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        cu_kv=torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32),
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta, tables


# decodes first, then: fresh chunks of two lengths, chunks after cached KV of different lengths
CASES = {
    "decodes": ([1, 1, 1], [5, 1, 9]),
    "fresh": ([1, 6, 6, 3], [7, 6, 6, 3]),
    "after-cache": ([1, 5, 2, 7], [4, 13, 2, 9]),
    "mixed": ([1, 1, 4, 4, 3, 1], [2, 8, 4, 11, 3, 6]),
}


@pytest.mark.parametrize("block_major", [False, True], ids=["own-cache", "block-major-pool"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_a_per_sequence_reference(case, block_major):
    q_lens, kv_lens = CASES[case]
    order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] != 1)  # the runner's order: decodes first
    q_lens, kv_lens = [q_lens[i] for i in order], [kv_lens[i] for i in order]
    q, k, v, k_cache, v_cache, meta, tables = batch(q_lens, kv_lens, block_major=block_major)
    got = TorchAttention()(q, k_cache, v_cache, meta, k=k, v=v)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, q_lens, kv_lens))


def test_write_kv_into_a_block_major_pool_touches_only_its_layers_rows():
    """A layer's K and V land in that layer's slabs of the right blocks, nowhere else."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(5, 3, 2, BS, HKV, DIM, generator=gen)
    before = pool.clone()
    k, v = torch.randn(4, HKV, DIM, generator=gen), torch.randn(4, HKV, DIM, generator=gen)
    tokens = [(4, 1), (0, 0), (0, 1), (0, 2)]  # (block, offset) of each new token
    stride = attention.block_stride(pool[:, 1, 0])
    write_kv(pool[:, 1, 0], pool[:, 1, 1], k, v, torch.tensor([b * stride + o for b, o in tokens]))
    want = before.clone()
    for row, (b, o) in enumerate(tokens):
        want[b, 1, 0, o] = k[row]
        want[b, 1, 1, o] = v[row]
    assert torch.equal(pool, want)


def test_static_decode_metadata_reads_the_whole_table_and_matches():
    q, k, v, k_cache, v_cache, meta, tables = batch([1, 1, 1], [5, 1, 9])
    meta.static = True
    got = TorchAttention()(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, [1, 1, 1], [5, 1, 9]))


# flash-attn's documented semantics, as its paged calls are made: causal is aligned bottom-right
def fake_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal):
    assert q.dim() == 4 and q.shape[1] == 1 and causal
    tables = [row[: -(-int(n) // BS)].tolist() for row, n in zip(block_table, cache_seqlens)]
    lens = cache_seqlens.tolist()
    return reference(q[:, 0], k_cache, v_cache, tables, [1] * len(lens), lens)[:, None]


def fake_varlen(q, k_cache, v_cache, cu_q, cu_kv, max_q, max_kv, causal, block_table):
    q_lens, kv_lens = cu_q.diff().tolist(), cu_kv.diff().tolist()
    assert causal and max_q == max(q_lens) and max_kv == max(kv_lens) and len(block_table) == len(q_lens)
    tables = [row[: -(-n // BS)].tolist() for row, n in zip(block_table, kv_lens)]
    return reference(q, k_cache, v_cache, tables, q_lens, kv_lens)


@pytest.mark.parametrize("case", list(CASES))
def test_flash_backend_calls_match_the_torch_backend(case, monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", fake_with_kvcache, raising=False)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", fake_varlen, raising=False)
    q_lens, kv_lens = CASES[case]
    order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] != 1)
    q_lens, kv_lens = [q_lens[i] for i in order], [kv_lens[i] for i in order]
    q, k, v, k_cache, v_cache, meta, _ = batch(q_lens, kv_lens)
    torch.testing.assert_close(
        FlashAttention()(q, k_cache, v_cache, meta, k=k, v=v), TorchAttention()(q, k_cache, v_cache, meta, k=k, v=v)
    )


def test_backend_and_block_size_per_device(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, torch.float32, 16, 16).name == (
        "cpu" if cpu_ops.supports(cpu, torch.float32) else "torch"
    )
    assert select_backend("auto", cpu, torch.bfloat16, 16, 16).name == "torch"  # the C kernel is float32 only
    assert select_backend("auto", cpu, torch.float32, 16, 24).name == "torch"  # no variant for head_dim 24
    assert default_block_size("cpu", flash_importable=True) == 16
    assert default_block_size("cuda", flash_importable=True) == 256
    assert default_block_size("cuda", flash_importable=False) == 16
    with pytest.raises(ConfigError, match="attention_backend=flash needs flash-attn"):
        select_backend("flash", cpu, torch.float32, 256)
    monkeypatch.setattr(attention.paged_decode, "usable", lambda device: False)
    with pytest.raises(ConfigError, match="attention_backend=triton needs triton"):
        select_backend("triton", cpu, torch.float32, 16)
    assert EngineConfig().for_device("cpu").block_size == 16
    assert EngineConfig().for_device("cpu").cuda_graphs is False
    with pytest.raises(ConfigError, match="engine.cuda_graphs=true needs a CUDA device"):
        EngineConfig(cuda_graphs=True).for_device("cpu")


# docs/gpu-readiness.md's table: (device, flash-attn imports, dtype) -> auto's backend, block size
BLOCK_TABLE = [
    ("cuda", True, torch.bfloat16, "flash", 256),
    ("cuda", True, torch.float16, "flash", 256),
    ("cuda", True, torch.float32, "triton", 16),
    ("cuda", False, torch.bfloat16, "triton", 16),
    ("cuda", False, torch.float32, "triton", 16),
    ("cpu", True, torch.float32, "cpu", 16),
    ("cpu", True, torch.bfloat16, "torch", 16),
]


@pytest.mark.parametrize("device, flash, dtype, backend, block", BLOCK_TABLE)
def test_block_size_rule_follows_the_table_for_every_dtype(monkeypatch, device, flash, dtype, backend, block):
    """The block size left unset is the one the backend auto picks can run: float32 on CUDA with
    flash-attn importable runs Triton, on 16-token blocks (it was given flash-attn's 256)."""
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", flash)
    monkeypatch.setattr(attention.paged_decode, "usable", lambda d: True)
    monkeypatch.setattr(attention.cpu_ops, "supports", lambda d, t, h=None: d.type == "cpu" and t == torch.float32)
    name = str(dtype).removeprefix("torch.")
    assert default_block_size(device, flash, name) == default_block_size(device, flash, dtype) == block
    assert EngineConfig().for_device(device, dtype).block_size == block
    assert select_backend("auto", torch.device(device), dtype, block, 64).name == backend
    assert EngineConfig(attention_backend="triton").for_device(device, dtype).block_size == 16  # flash not asked for


def test_the_documented_block_size_table_is_the_rule():
    from tests.paths import ROOT

    text = (ROOT / "docs" / "gpu-readiness.md").read_text()
    rows = [
        [c.strip(" `") for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| cuda") or line.startswith("| cpu")
    ]
    yes = {"yes": True, "no": False}
    documented = {(r[0], yes[r[1]], r[2], r[3], int(r[4])) for r in rows}
    assert documented == {(d, f, str(t).removeprefix("torch."), b, n) for d, f, t, b, n in BLOCK_TABLE}


def test_buckets_cover_every_batch_size():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(20)[-1] >= 20
    for max_batch in (1, 3, 8, 9, 100):
        assert all(any(b >= n for b in buckets(max_batch)) for n in range(1, max_batch + 1))


def test_graph_bookkeeping_keeps_greedy_tokens(monkeypatch):
    """Decode batches of 1..7 sequences padded to buckets 1, 2, 4, 8, padding writing the scratch
    block: the tokens equal the eager engine's, and every real block is freed at the end."""
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(7)]
    lengths = [3 + 2 * i for i in range(7)]  # sequences finish one by one: every batch size runs
    options = dict(num_kv_blocks=64, max_model_len=128, max_running=8)
    eager = LLM("tiny", **options).generate(prompts, lengths)
    llm = LLM("tiny", **options)
    llm.engine.runner.enable_graphs(max_batch=8, capture=False)
    runs = []
    graphs = llm.engine.runner.graphs
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, pos, meta: runs.append(len(meta.q_lens)) or real_run(ids, pos, meta))
    assert llm.generate(prompts, lengths) == eager
    assert set(runs) == set(range(1, 8)), "every decode batch size went through the padded static path"
    assert llm.engine.num_used_blocks == 0
    scratch = llm.engine.runner.kv_cache[llm.engine.runner.num_blocks]
    assert scratch.abs().sum() > 0, "padded rows wrote into the scratch block"
