"""What a reading of the GPU paths found before any GPU ran them (issue 43), held on CPU: the model
built in its dtype and the pool sized against reserved memory less a profiled step (fake device
memory figures), the forward's device time in the step record, the SDPA backends' chunk indices
built once a step, a polled KV transfer failing after kv_transfer.timeout_s instead of NCCL's
watchdog killing the worker, the roofline's FLOP and byte counts, and no decode graphs on a
prefill-only worker. What only a GPU shows is in scripts/gpu_check's summary."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import pytest
import torch

from testbed.bench import gpu as bench_gpu
from testbed.cluster import completion, worker
from testbed.control.config import ClusterConfig
from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence, kv_pool, model_runner
from testbed.engine.engine import ForwardClock
from testbed.engine.model_runner import ModelRunner, cuda_memory, decode_graphs_wanted
from testbed.errors import ConfigError
from testbed.model import attention, loader
from testbed.model.config import PRESETS

GIB = 2**30
TINY = dataclasses.replace(PRESETS["tiny"], max_model_len=256)


# -- 1. the model in its dtype, the pool against reserved memory ---------------------------------
def test_the_model_is_built_in_its_dtype_not_cast_from_float32(monkeypatch):
    seen = []

    class Recording(loader.Transformer):
        def __init__(self, args):
            seen.append(torch.get_default_dtype())
            super().__init__(args)
            seen.append(self.layers[0].mlp.gate_up_proj.weight.dtype)

    monkeypatch.setattr(loader, "Transformer", Recording)
    model = loader.build_model(TINY, torch.device("cpu"), torch.bfloat16)
    assert seen == [torch.bfloat16, torch.bfloat16]  # never an fp32 copy of the weights
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_sin.dtype == torch.float32  # RoPE's tables name their own dtype
    assert torch.get_default_dtype() == torch.float32


class FakeCuda:
    """An 80 GiB device whose allocator holds 15 GiB of bf16 weights and still caches the 15 GiB an
    fp32 build freed (the first 8B run's state, issue 43 finding 1); a profiled step allocates 3 GiB."""

    def __init__(self, monkeypatch, context=GIB // 2):
        self.total, self.context = 80 * GIB, context
        self.allocated, self.reserved, self.peak = 15 * GIB, 30 * GIB, 15 * GIB
        for name in (
            "empty_cache",
            "memory_reserved",
            "memory_allocated",
            "reset_peak_memory_stats",
            "max_memory_allocated",
            "mem_get_info",
            "synchronize",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def empty_cache(self):
        self.reserved = self.allocated

    def memory_reserved(self, device=None):
        return self.reserved

    def memory_allocated(self, device=None):
        return self.allocated

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def mem_get_info(self, device=None):
        return self.total - self.reserved - self.context, self.total

    def synchronize(self, device=None):
        pass

    def step(self, nbytes):  # a profiled step: its activations allocated, then freed (cached)
        self.peak = max(self.peak, self.allocated + nbytes)
        self.reserved = max(self.reserved, self.allocated + nbytes)


def test_a_gpu_pool_is_sized_against_reserved_memory_less_a_profiled_step(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    block = 2 * 2**20
    config = EngineConfig(block_size=16)
    # before: allocated memory against the free figure, with the fp32 build's cache still reserved
    with pytest.raises(ConfigError, match="other processes hold the rest"):
        kv_pool.pool_blocks(
            config,
            block,
            device_type="cuda",
            free_bytes=cuda.mem_get_info()[0],
            total_bytes=cuda.total,
            used_bytes=cuda.allocated,
        )
    memory = cuda_memory("cuda:0", [lambda: cuda.step(3 * GIB)])
    assert memory == dict(
        free_bytes=80 * GIB - 15 * GIB - GIB // 2, total_bytes=80 * GIB, used_bytes=15 * GIB, reserve_bytes=3 * GIB
    )
    blocks = kv_pool.pool_blocks(config, block, device_type="cuda", **memory)
    assert blocks == (int(0.85 * 80 * GIB) - 15 * GIB - 3 * GIB) // block  # room left for the step


def test_a_pool_and_its_step_that_do_not_fit_what_is_free_are_refused(monkeypatch):
    cuda = FakeCuda(monkeypatch, context=15 * GIB)  # another process holds 15 GiB
    memory = cuda_memory("cuda:0", [lambda: cuda.step(3 * GIB)])
    with pytest.raises(ConfigError, match="3.00 GiB for its steps' activations"):
        kv_pool.pool_blocks(EngineConfig(block_size=16), 2**20, device_type="cuda", **memory)


@pytest.mark.parametrize("role, graph_profile", [("decode_only", True), ("prefill_only", False)])
def test_a_memory_sized_cuda_pool_profiles_the_largest_step_first(monkeypatch, role, graph_profile):
    """The largest step any policy schedules (max_running + the larger token budget), and, where the
    worker will capture decode graphs, the largest bucket's decode beside it."""
    runner = ModelRunner(
        loader.build_model(TINY, torch.device("cpu"), torch.float32),
        EngineConfig(num_kv_blocks=64),
        torch.device("cpu"),
    )
    runner.config = dataclasses.replace(runner.config, num_kv_blocks=None)
    runner.device = SimpleNamespace(type="cuda")
    runner.graphs_wanted = graph_profile
    profiled, calls = [], []
    monkeypatch.setattr(runner, "profile_step", lambda tokens, sampled: profiled.append((tokens, sampled)))

    def fake_memory(device, profiles):
        calls.append(len(profiles))
        for profile in profiles:
            profile()
        return dict(free_bytes=70 * GIB, total_bytes=80 * GIB, used_bytes=GIB, reserve_bytes=GIB)

    monkeypatch.setattr(model_runner, "cuda_memory", fake_memory)
    blocks = runner._pool_blocks(max_running=24, step_tokens=24 + 65536)
    assert profiled == [(24 + 65536, 24)] + ([(32, 32)] if graph_profile else [])  # 32: the bucket for 24
    assert blocks == (int(0.85 * 80 * GIB) - 2 * GIB) // runner.block_bytes


def test_the_profiled_step_runs_prompts_longer_than_a_sequence_on_cpu():
    runner = ModelRunner(
        loader.build_model(TINY, torch.device("cpu"), torch.float32),
        EngineConfig(num_kv_blocks=64),
        torch.device("cpu"),
    )
    runner.profile_step(3 * 256 + 5, 4)  # three prompts of max_model_len and a short one, one forward
    assert runner.kv_cache.abs().sum() == 0  # the pool is untouched: the profile writes a scratch block


def test_the_engine_asks_for_room_for_its_largest_step(monkeypatch):
    seen = {}
    real = ModelRunner.__init__

    def spy(self, *args, **kwargs):
        seen["args"] = args
        real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", spy)
    Engine(
        loader.build_model(TINY, torch.device("cpu"), torch.float32),
        EngineConfig(num_kv_blocks=64),
        SchedulerConfig(max_batched_tokens=4096, chunk_size=256, max_running=8),
        "prefill_only",
        torch.device("cpu"),
    )
    assert seen["args"][-3:] == (8, 8 + 4096, False)  # max_running, step tokens, decodes


# -- 4. the forward's device time --------------------------------------------------------------
class FakeEvent:
    def __init__(self, at_ms):
        self.at_ms = at_ms

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


def test_the_forward_takes_its_device_time_from_the_sampling_sync():
    # the host saw 1 ms of launches and a 9 ms sample (the sync); the stream ran the forward for 8 ms
    assert ForwardClock.split(FakeEvent(0.0), FakeEvent(8.0), 0.001, 0.009) == pytest.approx((0.008, 0.002))
    assert ForwardClock.split(FakeEvent(0.0), FakeEvent(0.5), 0.001, 0.009) == pytest.approx((0.001, 0.009))
    assert ForwardClock.split(FakeEvent(0.0), FakeEvent(99.0), 0.001, 0.009) == pytest.approx((0.010, 0.0))
    assert ForwardClock.split(None, None, 0.001, 0.009) == (0.001, 0.009)  # CPU: the host's stamps


def test_a_step_record_carries_the_device_time_of_its_forward():
    engine = Engine.build(TINY, EngineConfig(num_kv_blocks=64), SchedulerConfig(), "colocated")
    marks = iter([FakeEvent(0.0), FakeEvent(1e6)])  # a forward that ran "1000 s" on the device
    engine.clock = SimpleNamespace(mark=lambda: next(marks), split=ForwardClock.split)
    engine.add(Sequence(0, list(range(1, 40)), 2))
    record = engine.step().record
    assert record.sample_s == 0.0 and record.forward_s > 0  # all of forward + sample is the forward's
    parts = record.schedule_s + record.prepare_s + record.forward_s + record.sample_s + record.postprocess_s
    assert parts == pytest.approx(record.end - record.start)


# -- 5. chunk indices once a step ---------------------------------------------------------------
def test_chunk_indices_are_built_once_a_step_not_once_a_layer(monkeypatch):
    args = dataclasses.replace(TINY, num_layers=4)
    engine = Engine.build(
        args,
        EngineConfig(num_kv_blocks=64, enable_prefix_caching=True),
        SchedulerConfig(chunk_size=64, max_running=4),
        "chunked",
    )
    assert isinstance(engine.runner.backend, attention.TorchAttention)
    built = []
    real = model_runner.chunk_plan
    monkeypatch.setattr(model_runner, "chunk_plan", lambda *a: built.append(a[2]) or real(*a))

    def per_layer(*a):
        raise AssertionError("chunk indices built inside the forward")

    monkeypatch.setattr(attention, "chunk_plan", per_layer)
    engine.add(Sequence(0, [(3 * j) % 500 + 1 for j in range(150)], 3))  # 3 chunks: 2 after cached KV
    engine.add(Sequence(1, [(5 * j) % 500 + 1 for j in range(40)], 3))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert [len(items) for items in built] == [1, 1], built  # one plan for each step with such a chunk
    assert steps > 2


def test_the_chunk_plan_gathers_with_index_tensors():
    # items 1 and 3 follow cached KV; item 0 is a decode, item 2 a fresh prompt
    plan = attention.chunk_plan([1, 3, 4, 2], [9, 10, 4, 6], [1, 3], attention.host_to("cpu"))
    assert plan.items == [1, 3] and plan.items_t.tolist() == [1, 3] and plan.max_q == 3
    assert plan.rows.tolist() == [1, 2, 3, 8, 9]  # not consecutive: an index tensor, built here
    assert plan.real.tolist() == [0, 1, 2, 3, 4]  # rows (0, 0..2) and (1, 0..1) of the (2 x 3) padding
    assert plan.q_lens_t.tolist() == [3, 2] and plan.kv_lens_t.tolist() == [10, 6]


# -- 7. a polled KV transfer bounded by kv_transfer.timeout_s -----------------------------------
class NeverCompletes:
    def is_completed(self):
        return False


class Completes:
    def is_completed(self):
        return True


def test_a_polled_transfer_that_never_completes_fails_after_the_kv_timeout(monkeypatch):
    monkeypatch.setattr(completion.dist, "get_backend", lambda: "nccl")
    tracker = completion.CompletionTracker(timeout_s=0.05)
    stuck, done = tracker.track(NeverCompletes(), peer=1), tracker.track(Completes(), peer=1)
    assert not stuck.done() and done.done() and done.error is None
    time.sleep(0.1)
    assert stuck.done() and stuck.error == "not completed within 0.05 s (kv_transfer.timeout_s)"


def test_an_nccl_watchdog_timeout_aborts_the_communicator_not_the_worker(monkeypatch):
    monkeypatch.setattr(worker.os, "environ", {})
    monkeypatch.setattr(worker.dist, "init_process_group", lambda *a, **k: None)
    spec = SimpleNamespace(cluster=ClusterConfig(start_timeout_s=5.0), rendezvous=None, port=1, rank=0, world_size=2)
    worker._init_group(spec, "nccl")
    assert os.environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    os.environ.clear()
    worker._init_group(spec, "gloo")
    assert os.environ == {}


# -- 8. the roofline's counts ---------------------------------------------------------------------
def layer_params(a) -> int:
    qkv = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    return qkv + a.num_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size


@pytest.mark.parametrize("tied", [False, True])
def test_roofline_counts_only_the_work_a_step_does(tied):
    args = dataclasses.replace(TINY, tie_embeddings=tied)
    engine = Engine.build(args, EngineConfig(num_kv_blocks=64), SchedulerConfig(), "colocated")
    a, layers = engine.args, args.num_layers * layer_params(args)
    head = a.vocab_size * a.hidden_size
    attn = 2 * 2 * a.num_layers * a.num_heads * a.head_dim * 64 * 64 / 2
    assert bench_gpu.prefill_flops(engine, 64) == 2 * layers * 64 + 2 * head + attn  # the head for one token
    assert bench_gpu.prefill_flops(engine, 128, sequences=2) == 2 * layers * 128 + 2 * 2 * head + 2 * attn
    table = a.vocab_size * a.hidden_size
    weights = (layers + a.hidden_size + table * (1 if tied else 2)) * 4  # float32
    assert bench_gpu.weight_bytes(engine) == weights
    # decode: of an untied table only the batch's rows; a tied head reads all of it anyway
    expected = weights if tied else weights - table * 4 + 3 * a.hidden_size * 4
    assert bench_gpu.decode_weight_bytes(engine, 3) == expected


# -- 9. no decode graphs on a prefill-only worker -------------------------------------------------
def test_only_workers_that_decode_capture_graphs():
    assert decode_graphs_wanted(True, "triton", decodes=True)
    assert not decode_graphs_wanted(True, "triton", decodes=False)
    assert not decode_graphs_wanted(True, "flash", decodes=False)
    assert not decode_graphs_wanted(True, "torch", decodes=True)
    assert not decode_graphs_wanted(False, "triton", decodes=True)


@pytest.mark.parametrize("role", ["prefill_only", "decode_only", "colocated"])
def test_a_prefill_only_engine_captures_no_graphs(monkeypatch, role):
    real = EngineConfig.for_device
    monkeypatch.setattr(
        EngineConfig, "for_device", lambda self, *a: dataclasses.replace(real(self, *a), cuda_graphs=True)
    )  # as on CUDA
    captured = []
    monkeypatch.setattr(ModelRunner, "enable_graphs", lambda self, max_batch, capture=True: captured.append(max_batch))
    engine = Engine.build(TINY, EngineConfig(num_kv_blocks=64), SchedulerConfig(max_running=4), role)
    replays = role != "prefill_only" and engine.runner.backend.name != "torch"
    assert engine.runner.graphs_wanted == replays and captured == ([4] if replays else [])
