"""The C paged decode kernel against SDPA over each sequence's tokens gathered one by one: head
dims of every compiled variant, GQA groups, a layer's strided view of a block-major pool, lengths
at and across block edges; RMSNorm, RoPE and SiLU-and-multiply against transformers' own modules;
the one-line refusals; and what happens without a C compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from testbed import LLM
from testbed.errors import ConfigError
from testbed.model import cpu_ops
from testbed.model.attention import select_backend

pytestmark = pytest.mark.skipif(
    not cpu_ops.supports("cpu", torch.float32), reason=f"C kernel unavailable: {cpu_ops.unavailable_reason()}"
)
BS = 4


def pool_views(num_blocks, kv_heads, dim, gen, layers=3):
    """Layer 1's K and V views of a (blocks, layers, 2, BS, Hkv, D) block-major pool."""
    pool = torch.randn(num_blocks, layers, 2, BS, kv_heads, dim, generator=gen)
    return pool[:, 1, 0], pool[:, 1, 1]


def reference(q, k_cache, v_cache, tables, kv_lens):
    out = []
    for i, (table, n) in enumerate(zip(tables, kv_lens)):
        rows = [(table[t // BS], t % BS) for t in range(n)]
        k = torch.stack([k_cache[b, r] for b, r in rows]).transpose(0, 1)  # (Hkv, S, D)
        v = torch.stack([v_cache[b, r] for b, r in rows]).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i][:, None], k, v, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dim", cpu_ops.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1), (6, 2)])
def test_kernel_matches_sdpa_over_gathered_tokens(dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(dim + heads)
    kv_lens = [1, BS - 1, BS, BS + 1, 3 * BS, 29]
    width = max(-(-n // BS) for n in kv_lens)
    num_blocks = len(kv_lens) * width + 2
    k_cache, v_cache = pool_views(num_blocks, kv_heads, dim, gen)
    ids = torch.randperm(num_blocks, generator=gen)[: len(kv_lens) * width].view(len(kv_lens), width)
    tables = [ids[i, : -(-n // BS)].tolist() for i, n in enumerate(kv_lens)]
    q = torch.randn(len(kv_lens), heads, dim, generator=gen)
    out = cpu_ops.paged_decode(q, k_cache, v_cache, ids.int(), torch.tensor(kv_lens, dtype=torch.int32))
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, kv_lens), rtol=1e-5, atol=1e-5)


def test_an_empty_sequence_yields_zeros_and_reads_no_block():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = pool_views(4, 2, 16, gen)
    tables = torch.tensor([[3], [10**6]], dtype=torch.int32)  # the second table is never read
    out = cpu_ops.paged_decode(
        torch.randn(2, 4, 16, generator=gen), k_cache, v_cache, tables, torch.tensor([2, 0], dtype=torch.int32)
    )
    assert out[1].abs().max() == 0 and out[0].abs().max() > 0


def test_refusals_name_what_is_wrong():
    k_cache = torch.zeros(2, BS, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.paged_decode(torch.zeros(1, 4, 16), k_cache.double(), k_cache.double(), tables, lens)
    with pytest.raises(ValueError, match="head_dim 24"):
        z = torch.zeros(2, BS, 2, 24)
        cpu_ops.paged_decode(torch.zeros(1, 4, 24), z, z, tables, lens)
    with pytest.raises(ConfigError, match="attention_backend=cpu needs a CPU device in float32"):
        select_backend("cpu", torch.device("cpu"), torch.bfloat16, 16, 16)


def test_without_a_compiler_auto_keeps_torch_and_cpu_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TESTBED_CACHE_DIR", str(tmp_path))  # nothing built here yet
    cpu_ops._library.cache_clear()
    try:
        assert "no C compiler" in cpu_ops.unavailable_reason()
        assert select_backend("auto", torch.device("cpu"), torch.float32, 16, 16).name == "torch"
        with pytest.raises(ConfigError, match="no C compiler"):
            select_backend("cpu", torch.device("cpu"), torch.float32, 16, 16)
    finally:
        cpu_ops._library.cache_clear()


def test_engine_tokens_equal_with_the_kernel_and_without():
    prompts = [[(5 * i + j) % 500 + 1 for j in range(3 + 4 * i)] for i in range(6)]
    options = dict(num_kv_blocks=64, max_model_len=128, max_running=6)
    kernel = LLM("tiny", attention_backend="cpu", **options)
    assert kernel.engine.runner.backend.name == "cpu"
    assert kernel.generate(prompts, 12) == LLM("tiny", attention_backend="torch", **options).generate(prompts, 12)


def test_elementwise_kernels_match_transformers_own_modules():
    """RMSNorm, RoPE and SiLU-and-multiply in C against transformers' LlamaRMSNorm, its rotary
    embedding with apply_rotary_pos_emb, and its SiLU activation, on the same inputs."""
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.models.llama import modeling_llama as hf

    from testbed.model.llama import Rotary

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen)
    norm = hf.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        torch.testing.assert_close(cpu_ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-6, atol=1e-6)

    config = transformers.LlamaConfig(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    positions = torch.randint(0, 256, (37,), generator=gen)
    q, k = torch.randn(1, 6, 37, 16, generator=gen), torch.randn(1, 2, 37, 16, generator=gen)
    cos, sin = hf.LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = hf.apply_rotary_pos_emb(q, k, cos, sin)
    qk = torch.cat((q[0], k[0])).transpose(0, 1)  # (T, 8 heads, D): q and k rotated together, as the model does
    out = cpu_ops.rotary(qk, positions, Rotary(16, 1e4, 256).cos_sin)
    torch.testing.assert_close(out, torch.cat((q_ref[0], k_ref[0])).transpose(0, 1), rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(37, 2 * 48, generator=gen)
    torch.testing.assert_close(
        cpu_ops.silu_mul(gate_up), ACT2FN["silu"](gate_up[:, :48]) * gate_up[:, 48:], rtol=1e-6, atol=1e-6
    )


# -- bounds: one line, never a read out of bounds --------------------------------------------------
BOUNDS_CASES = r"""
import torch
from testbed.model import cpu_ops

def decode(tables, lens, blocks=4, device="cpu"):
    k = torch.zeros(blocks, 4, 2, 16)
    q = torch.zeros(len(lens), 4, 16)
    return cpu_ops.paged_decode(q, k, k.clone(), torch.tensor(tables, dtype=torch.int32, device=device),
                                torch.tensor(lens, dtype=torch.int32))

table = torch.zeros(2, 8, 16)
cases = {
    "block id past the pool": lambda: decode([[0, 9]], [6]),
    "negative block id": lambda: decode([[-1]], [2]),
    "kv_len past the table": lambda: decode([[0, 1]], [4000]),
    "negative kv_len": lambda: decode([[0]], [-3]),
    "fewer lengths than queries": lambda: cpu_ops.paged_decode(torch.zeros(2, 4, 16), torch.zeros(4, 4, 2, 16),
                                                               torch.zeros(4, 4, 2, 16),
                                                               torch.zeros(2, 1, dtype=torch.int32),
                                                               torch.ones(1, dtype=torch.int32)),
    "position past the RoPE table": lambda: cpu_ops.rotary(torch.zeros(3, 2, 16), torch.tensor([0, 1, 8]), table),
    "negative position": lambda: cpu_ops.rotary(torch.zeros(1, 2, 16), torch.tensor([-1]), table),
    "a table of another head size": lambda: cpu_ops.rotary(torch.zeros(1, 2, 16), torch.tensor([0]),
                                                           torch.zeros(2, 8, 8)),
    "a short RMSNorm weight": lambda: cpu_ops.rms_norm(torch.zeros(2, 64), torch.ones(8), 1e-6),
    "a table on the meta device": lambda: decode([[0]], [2], device="meta"),
}
for name, call in cases.items():
    try:
        call()
        print(f"{name}: no error")
    except ValueError as error:
        print(f"{name}: {error}")
"""


def test_out_of_bounds_is_one_line_never_a_crash():
    """Each call would read outside its tensors (the old wrapper: garbage or SIGSEGV); run in a child
    process so that a crash fails this test instead of ending the run."""
    import subprocess
    import sys

    from tests.paths import ROOT

    run = subprocess.run([sys.executable, "-c", BOUNDS_CASES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert len(lines) == 10 and "no error" not in lines.values(), run.stdout
    assert "block id 9" in lines["block id past the pool"] and "[0, 4)" in lines["block id past the pool"]
    assert "kv_len 4000" in lines["kv_len past the table"] and "[0, 8]" in lines["kv_len past the table"]
    assert "position 8 of token 2" in lines["position past the RoPE table"]
    assert "CPU" in lines["a table on the meta device"]


ARGUMENT_CASES = """
import torch
from testbed.model import cpu_ops

def case(name, q, k, tables, lens):
    try:
        cpu_ops.paged_decode(q, k, k, tables, lens)
        print(name + ": no error")
    except ValueError as error:
        print(name + ": " + str(error))

q, k = torch.zeros(1, 4, 16), torch.zeros(4, 4, 2, 16)
i64 = torch.int64
i32 = torch.int32  # block_size 0 with an empty sequence: the kernel's loop bound divided by zero
case("block_size 0", q, torch.zeros(4, 0, 2, 16), torch.zeros(1, 1, dtype=i32), torch.zeros(1, dtype=i32))
case("an int64 id past int32", q, k, torch.tensor([[2**32 + 1]], dtype=i64), torch.ones(1, dtype=i64))
case("an int64 length past int32", q, k, torch.zeros(1, 1, dtype=i64), torch.tensor([2**32 + 2], dtype=i64))
case("a float table", q, k, torch.zeros(1, 1), torch.ones(1, dtype=i64))
out = cpu_ops.paged_decode(torch.ones(1, 4, 16), k + 1, k + 1, torch.tensor([[3]], dtype=i64), torch.ones(1, dtype=i64))
print("int64 in range: " + str(float(out.mean())))
"""


def test_block_size_0_and_wrapping_int64_ids_are_refused_never_a_crash():
    """block_size 0 divided by zero in the kernel (SIGFPE); int64 ids past int32 were wrapped into
    other blocks' ids. In a child process, so that a crash fails this test instead of the run."""
    import subprocess
    import sys

    from tests.paths import ROOT

    run = subprocess.run([sys.executable, "-c", ARGUMENT_CASES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert "block_size and KV heads must be >= 1" in lines["block_size 0"]
    assert "block_tables holds 4294967297, outside the kernel's int32 range" in lines["an int64 id past int32"]
    assert "kv_lens holds 4294967298" in lines["an int64 length past int32"]
    assert "must hold integers" in lines["a float table"]
    assert float(lines["int64 in range"]) == 1.0  # int64 within range is honoured


def test_loading_the_kernels_leaves_the_floating_point_mode_alone():
    """A -ffast-math shared library linked by gcc < 13 sets flush-to-zero for the whole process when
    it loads: every later float op of torch and numpy (and Hypothesis) would lose its subnormals."""
    import subprocess
    import sys

    from tests.paths import ROOT

    check = (
        "import sys, numpy; from testbed.model import cpu_ops; assert cpu_ops._library()[0] is not None; "
        "print(float(numpy.float32(1e-40)) != 0.0 and sys.float_info.min / 2 > 0)"
    )
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "True", run.stdout + run.stderr[-2000:]
