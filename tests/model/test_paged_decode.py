"""The Triton paged decode kernel against a gather-and-softmax reference: on CPU under triton's
interpreter, and on CUDA (gpu marker) inside a captured CUDA graph.

The interpreter needs TRITON_INTERPRET=1 set before triton is first imported (triton.language jits
its own helpers on import), which a test cannot do once anything in the session has imported it: the
CPU cases run in a child process started with it set, unless this process already runs under it."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from testbed.model import paged_decode as pd
from tests.paths import ROOT

NAN = float("nan")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: inputs, p and the output rounded to 8 bits


def make_case(
    lens, block_size, group, dtype, kv_heads=2, dim=64, device="cpu", seed=0, num_blocks=None, block_major=False
):
    """Caches whose blocks are handed out shuffled; block 0 (where padded table entries point) and
    the slots past each sequence's last token hold NaN, which the kernel must never read. block_major:
    the caches are layer 1's views of a (blocks, 3 layers, 2, block_size, Hkv, D) pool, as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks or 1 + sum(counts) + 2  # block 0, each sequence's blocks, two never handed out
    if block_major:
        pool = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
        k, v = pool[:, 1, 0], pool[:, 1, 1]
    else:
        k, v = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype) for _ in "kv")
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), max(counts) + 1, dtype=torch.int32)  # at least one padded column
    for i, (n, c) in enumerate(zip(lens, counts)):
        tables[i, :c] = ids[sum(counts[:i]) : sum(counts[: i + 1])]
        if c:
            k[tables[i, c - 1], n - (c - 1) * block_size :] = NAN
            v[tables[i, c - 1], n - (c - 1) * block_size :] = NAN
    k[0] = v[0] = NAN
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(dtype)
    to = dict(device=device)
    return q.to(**to), k.to(**to), v.to(**to), tables.to(**to), torch.tensor(lens, dtype=torch.int32, **to)


def reference(q, k, v, tables, lens, scale=None):
    # per sequence: its first kv_len tokens gathered through the table, K/V repeated for GQA, float32
    n, heads, dim = q.shape
    group = heads // k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(n, heads, dim, device=q.device)
    for i, length in enumerate(lens.tolist()):
        kk, vv = (c[tables[i].long()].flatten(0, 1)[:length].float().repeat_interleave(group, 1) for c in (k, v))
        p = (torch.einsum("hd,lhd->hl", q[i].float(), kk) * scale).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", p, vv) if length else 0.0
    return out


def check(out, ref, dtype):
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


# name -> (make_case arguments, paged_decode arguments). Lengths off block multiples, one token, one
# that ends a block early; then splits over the KV length (some empty), kv_len 0 and head_dim 40
CASES = (
    {
        f"{str(dtype).removeprefix('torch.')}-block{bs}-group{g}": (
            dict(lens=[1, bs + 5, 2 * bs - 3], block_size=bs, group=g, dtype=dtype),
            {},
        )
        for dtype in (torch.float32, torch.bfloat16)
        for bs in (16, 256)
        for g in (1, 4, 3)
    }
    | {
        f"splits{s}-empty-dim40": (
            dict(lens=[0, 1, 37, 150], block_size=16, group=3, dtype=torch.float32, dim=40),
            dict(scale=0.3, num_splits=s),
        )
        for s in (1, 2, 5)
    }
    | {
        f"block-major-{str(dtype).removeprefix('torch.')}": (
            dict(lens=[1, 21, 29], block_size=16, group=3, dtype=dtype, block_major=True),
            {},
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
)


def run_cases(path=None):
    """The kernel's output (or its error) for each of CASES; in a process where triton is interpreted."""
    _fix_interpreter_for_numpy_2_4()
    results = {"usable": pd.usable("cpu")}
    for name, (spec, call) in CASES.items():
        try:
            results[name] = pd.paged_decode(*make_case(**spec), **call)
        except Exception as e:  # noqa: BLE001 (each case's test reports its own)
            results[name] = f"{type(e).__name__}: {e}"
    if path:
        torch.save(results, path)
    return results


def _fix_interpreter_for_numpy_2_4():
    # numpy >= 2.4 refuses int() of the interpreter's shape-(1,) scalars, which the kernel's loop up to
    # a length read on the device needs (triton#9171, fixed after 3.6): the upstream fix
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.fixed = True
    interpreter._patch_lang_tensor = patch


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    pytest.importorskip("triton")
    if pd.usable("cpu"):  # this process imported triton under TRITON_INTERPRET=1
        return run_cases()
    path = tmp_path_factory.mktemp("paged_decode") / "outputs.pt"
    code = f"from tests.model.test_paged_decode import run_cases; run_cases({str(path)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", CASES)
def test_matches_reference(outputs, name):
    spec, call = CASES[name]
    if isinstance(outputs[name], str):
        pytest.fail(outputs[name])
    check(outputs[name], reference(*make_case(**spec), scale=call.get("scale")), spec["dtype"])
    if spec["lens"][0] == 0:
        assert not outputs[name][0].any()  # kv_len 0: zeros


def test_usable(outputs, monkeypatch):
    assert outputs["usable"] and not pd.usable("meta")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pd.usable("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):  # not triton's own obscure error
        pd.paged_decode(*make_case([3], 16, 1, torch.float32))


def test_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("paged_decode_without_triton", pd.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.AVAILABLE and not module.usable("cuda")
    with pytest.raises(RuntimeError, match="triton"):
        module.paged_decode(*make_case([3], 16, 1, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_graph_replay(block_size):
    # captured once, replayed after the lengths and tables change in place: nothing read on the host
    pytest.importorskip("triton")
    shape = dict(kv_heads=8, dim=128, device="cuda", num_blocks=64)
    first = make_case([1, 40, 700], block_size, 4, torch.bfloat16, **shape)
    second = make_case([300, 0, 9], block_size, 4, torch.bfloat16, seed=1, **shape)
    q, k, v, tables, lens = (x.clone() for x in first)
    tables = torch.zeros(3, 64, dtype=torch.int32, device="cuda")  # wide enough for both cases
    tables[:, : first[3].shape[1]] = first[3]
    pd.paged_decode(q, k, v, tables, lens)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pd.paged_decode(q, k, v, tables, lens)
    for case in (first, second):
        for buffer, value in zip((q, k, v, lens), case[:3] + case[4:]):
            buffer.copy_(value)
        tables.zero_()[:, : case[3].shape[1]] = case[3]
        graph.replay()
        check(out, reference(*case), torch.bfloat16)
