"""The one-launch block copy (testbed/cluster/block_copy.py) against torch's block-by-block copy:
on CPU under triton's interpreter (in a child process, as tests/model/test_paged_decode.py explains), and
on CUDA (gpu marker) through BlockCopier, which takes it when both pools share the GPU."""

import os
import subprocess
import sys

import pytest
import torch

from testbed.cluster import block_copy
from testbed.cluster.kv_ipc import BlockCopier
from tests.paths import ROOT

# (layers, src blocks, dst blocks, block_size, kv heads, head dim): a chunk under one tile, and
# one of two and a bit tiles (the mask), pools of different sizes
SHAPES = {"small-chunk": (2, 9, 13, 16, 2, 24), "multi-tile": (3, 7, 5, 16, 4, 144)}


def case(shape, dtype=torch.float32, device="cpu", seed=0):
    layers, nsrc, ndst, bs, heads, dim = shape
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: no host-side draw of GiBs
    src = torch.randn(nsrc, layers, 2, bs, heads, dim, generator=gen, device=device).to(dtype)
    dst = torch.randn(ndst, layers, 2, bs, heads, dim, generator=gen, device=device).to(dtype)
    n = min(nsrc, ndst) - 1
    src_ids = torch.randperm(nsrc, generator=gen, device=device)[:n].tolist()
    dst_ids = torch.randperm(ndst, generator=gen, device=device)[:n].tolist()
    return src, dst, src_ids, dst_ids


def expected(src, dst, src_ids, dst_ids, layer=None):
    out = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        if layer is None:
            out[d] = src[s]
        else:
            out[d, layer] = src[s, layer]
    return out


def run_cases(path=None):
    """(kernel output, torch-path output, expected) per case, in a process where triton is interpreted."""
    results = {"usable": block_copy.usable("cpu")}
    block_copy.warm_up(case(SHAPES["multi-tile"])[0])  # both modes, on scratch: must not raise
    for name, shape in SHAPES.items():
        for layer in (None, 1):
            src, dst, src_ids, dst_ids = case(shape)
            kernel, plain = dst.clone(), dst.clone()
            nbytes = BlockCopier(src, kernel, kernel=True).write(src_ids, dst_ids, layer)
            assert nbytes == BlockCopier(src, plain, kernel=False).write(src_ids, dst_ids, layer)
            results[name, layer] = (kernel, plain, expected(src, dst, src_ids, dst_ids, layer))
    if path:
        torch.save(results, path)
    return results


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    pytest.importorskip("triton")
    if block_copy.usable("cpu"):
        return run_cases()
    path = tmp_path_factory.mktemp("block_copy") / "outputs.pt"
    code = f"from tests.cluster.test_block_copy import run_cases; run_cases({str(path)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("layer", [None, 1])
def test_one_launch_copies_exactly_the_blocks_asked(outputs, name, layer):
    assert outputs["usable"]
    kernel, plain, want = outputs[name, layer]
    assert torch.equal(kernel, want) and torch.equal(plain, want)


def test_cpu_pools_take_torch_copies():
    src, dst, _, _ = case(SHAPES["small-chunk"])
    assert not BlockCopier(src, dst).kernel  # the interpreter is for tests


@pytest.mark.parametrize(
    "src_ids, dst_ids, layer, message",
    [
        ([0, 9], [1, 2], None, r"source blocks 0..9 outside 0..8"),
        ([0, 1], [1, 13], None, r"destination blocks 1..13 outside 0..12"),
        ([0, -1], [1, 2], None, r"source blocks -1..0 outside"),
        ([0], [1, 2], None, r"1 source and 2 destination blocks"),
        ([0], [1], 2, r"layer 2 of 2"),
    ],
)
def test_a_wrong_block_or_layer_is_refused_before_any_write(src_ids, dst_ids, layer, message):
    src, dst, _, _ = case(SHAPES["small-chunk"])
    with pytest.raises(ValueError, match=message):
        block_copy.copy_blocks(src, dst, src_ids, dst_ids, layer)


def test_pools_of_another_layout_are_refused():
    src, _, _, _ = case(SHAPES["small-chunk"])
    other = torch.zeros(13, 3, 2, 16, 2, 24)  # three layers against two
    with pytest.raises(ValueError, match="one layout"):
        block_copy.copy_blocks(src, other, [0], [1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layer", [None, 5])
def test_one_gpu_pools_take_the_kernel_and_match_torch(layer):
    shape = (32, 300, 400, 16, 8, 128)  # Llama-3-8B's KV geometry
    src, dst, src_ids, dst_ids = case(shape, torch.bfloat16, "cuda")
    block_copy.warm_up(src)
    copier = BlockCopier(src, dst.clone())
    assert copier.kernel
    copier.write(src_ids, dst_ids, layer)
    plain = dst.clone()
    BlockCopier(src, plain, kernel=False).write(src_ids, dst_ids, layer)
    torch.cuda.synchronize()
    assert torch.equal(copier.dst, plain)
