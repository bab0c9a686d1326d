"""The Triton paged decode kernel runs a fixed, small set of variants, all compiled by the engine's
warm-up, so no JIT compile lands in a timed step; the step records count any that would.

On CPU: the split choice and the unspecialised strides read directly, and an engine on the triton
backend under triton's interpreter (a child process, as in tests/model/test_paged_decode.py) with a GPU's
multiprocessor count pretended, so its steps pick the splits a GPU would. On CUDA (gpu marker) the
counter reads the JIT's own caches."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from testbed.model import paged_decode as pd
from tests.paths import ROOT

H100_SMS = 132


def test_default_splits_stay_in_the_buckets(monkeypatch):
    monkeypatch.setattr(pd, "_multiprocessors", lambda device: H100_SMS)
    seen = {
        pd.default_splits(n, kv, max_len, torch.device("cuda"))
        for n in range(1, 80)
        for kv in (1, 2, 8)
        for max_len in (16, 256, 1000, 4096, 32768)
    }
    assert seen <= set(pd.SPLIT_BUCKETS) and len(seen) > 2, seen
    assert [pd.bucket(s) for s in (0, 1, 3, 5, 15, 16, 40)] == [1, 1, 2, 4, 8, 16, 16]


def test_the_variant_set_is_fixed_and_small():
    assert pd.variants() == [("decode", s) for s in pd.SPLIT_BUCKETS] + [("reduce", s) for s in pd.SPLIT_BUCKETS[1:]]
    assert len(pd.variants()) <= 10


def _unspecialised(fn) -> set:
    names = getattr(fn, "do_not_specialize", None)
    names = fn.kwargs.get("do_not_specialize") if names is None else names  # an interpreted kernel keeps kwargs
    arg_names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    return {arg_names[n] if isinstance(n, int) else n for n in names or ()}


@pytest.mark.parametrize("kernel", ["_decode_kernel", "_reduce_kernel"])
def test_strides_are_not_specialised(kernel):
    pytest.importorskip("triton")
    fn = getattr(pd, kernel)
    params = inspect.signature(getattr(fn, "fn", fn)).parameters
    strides = {name for name in params if name.startswith("stride_")}
    assert strides and strides <= _unspecialised(fn), f"{kernel} specialises on {strides - _unspecialised(fn)}"


def warm_engine_run(path=None) -> dict:
    """In a process where triton is interpreted: an engine on the triton backend warms up, then
    serves prompts whose decode batches and contexts vary; what the counter and records say."""
    from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
    from testbed.model.config import PRESETS
    from tests.model.test_paged_decode import _fix_interpreter_for_numpy_2_4

    _fix_interpreter_for_numpy_2_4()
    real, pd._multiprocessors = pd._multiprocessors, lambda device: H100_SMS  # a GPU's split choice
    before, keys_before = pd.jit_compiles(), set(pd._launched)  # in-process, earlier tests' variants
    try:
        args = PRESETS["tiny"]
        engine = Engine.build(
            args,
            EngineConfig(num_kv_blocks=160, attention_backend="triton"),
            SchedulerConfig(max_batched_tokens=1200, chunk_size=1200, max_running=8),
            "chunked",
        )
        engine.warmup()
        after_warmup = pd.jit_compiles()
        lengths = [1100, 700, 300, 130, 40, 9]  # contexts across split choices 1..4, batches 1..6
        for i, n in enumerate(lengths):
            engine.add(Sequence(i, [(3 * i + j) % args.vocab_size for j in range(n)], 2 + i))
        records = engine.run_until_done()
    finally:
        pd._multiprocessors = real
    result = {
        "warmup": after_warmup - before,
        "after_warmup": after_warmup,
        "end": pd.jit_compiles(),
        "records": [r.jit_compiles for r in records],
        "decode_batches": sorted({r.decode_seqs for r in records}),
        "launched": sorted(k[-1] for k in pd._launched - keys_before),
    }
    if path:
        torch.save(result, path)
    return result


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    pytest.importorskip("triton")
    if pd.usable("cpu"):
        return warm_engine_run()
    path = tmp_path_factory.mktemp("variants") / "run.pt"
    code = f"from tests.model.test_kernel_variants import warm_engine_run; warm_engine_run({str(path)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


def test_warmup_compiles_every_variant(warm_run):
    assert warm_run["warmup"] == len(pd.variants()), warm_run
    assert warm_run["launched"] == list(pd.SPLIT_BUCKETS)


def test_no_timed_step_compiles_after_warmup(warm_run):
    assert len(warm_run["decode_batches"]) > 3, warm_run  # the batches did vary
    assert warm_run["records"] and set(warm_run["records"]) == {0}, warm_run
    assert warm_run["end"] == warm_run["after_warmup"]


@pytest.mark.gpu
def test_no_timed_step_compiles_on_cuda_after_warmup():
    """The JIT's own caches: steps of varied batches and contexts after Engine.warmup compile nothing."""
    pytest.importorskip("triton")
    from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
    from testbed.model.config import PRESETS

    args = PRESETS["tiny"]
    for graphs in (False, True):
        engine = Engine.build(
            args,
            EngineConfig(num_kv_blocks=512, attention_backend="triton", cuda_graphs=graphs),
            SchedulerConfig(max_batched_tokens=4096, chunk_size=4096, max_running=48),
            "chunked",
            device="cuda:0",
            dtype="bfloat16",
        )
        engine.warmup()
        before = pd.jit_compiles()
        for i in range(40):
            engine.add(Sequence(i, [(7 * i + j) % args.vocab_size for j in range(1 + 47 * i)], 1 + i % 13))
        records = engine.run_until_done()
        assert [r.jit_compiles for r in records if r.jit_compiles] == [], f"graphs={graphs}"
        assert pd.jit_compiles() == before
