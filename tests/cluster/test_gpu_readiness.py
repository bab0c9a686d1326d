"""What a first GPU run would hit, checked on CPU with the device's memory figures faked: workers
that share a device split its memory by role (and a plan that cannot fit is refused before any
worker starts), a lone GPU worker takes the utilised share of the whole device, CPU pools are sized
from the host's available memory, and the dependency bound follows the torch features used."""

from __future__ import annotations

import dataclasses
import re

import pytest
import tomllib

from testbed.cluster import memory
from testbed.cluster.launcher import Cluster
from testbed.cluster.memory import ModelMemory, plan_kv_memory, role_shares
from testbed.control.layout import WorkerPlan
from testbed.engine import kv_pool
from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError
from testbed.model.config import ModelConfig
from tests.paths import ROOT

GIB = 2**30
LLAMA = ModelConfig(name="llama3_8b", max_model_len=4096)  # bf16 on CUDA: about 15 GiB of weights
ONE_GPU_1P1D = [WorkerPlan(0, "prefill_only", "cuda:0"), WorkerPlan(1, "decode_only", "cuda:0")]


def need(model=LLAMA, engine=EngineConfig(block_size=16), max_running=64):
    return lambda device: ModelMemory.of(model, engine, max_running, device)


def test_p_and_d_on_one_gpu_split_its_memory_by_role():
    engine = EngineConfig(block_size=16)
    total = 80 * GIB
    mib = plan_kv_memory(ONE_GPU_1P1D, engine, need(), memory=lambda device: total)
    model = need()("cuda:0")
    kv = engine.gpu_memory_utilization * total - 2 * model.weight_bytes
    assert mib == pytest.approx([0.2 * kv / 2**20, 0.8 * kv / 2**20])
    # each worker's pool as its engine sizes it from the planned size: together they fit the device's share
    pools = [
        kv_pool.pool_blocks(
            dataclasses.replace(engine, kv_cache_mib=m), model.block_bytes, device_type="cuda", free_bytes=total
        )
        * model.block_bytes
        for m in mib
    ]
    assert sum(pools) + 2 * model.weight_bytes <= engine.gpu_memory_utilization * total
    assert pools[1] > 3 * pools[0] > 0


def test_the_role_split_is_a_knob():
    roles = ["prefill_only", "prefill_only", "decode_only"]
    assert role_shares(roles, 0.3) == pytest.approx([0.15, 0.15, 0.7])
    assert role_shares(["decode_only", "decode_only"], 0.3) == [0.5, 0.5]
    with pytest.raises(ConfigError, match=r"engine.prefill_memory_share must be in \(0, 1\)"):
        EngineConfig(prefill_memory_share=1.0).validate()


def test_workers_alone_on_their_devices_size_their_own_pools():
    plans = [WorkerPlan(0, "prefill_only", "cuda:0"), WorkerPlan(1, "decode_only", "cuda:1")]
    assert plan_kv_memory(plans, EngineConfig(block_size=16), need(), memory=lambda d: 80 * GIB) == [None, None]


def test_a_plan_that_cannot_fit_is_refused_in_one_line_before_any_worker_starts(monkeypatch):
    from testbed.cluster.lifecycle import worker_template
    from tests.cluster_helpers import make_config

    # the share scripts/gpu_check once hard-coded, on an 80 GB GPU: 28 GiB cannot hold two copies of the weights
    cfg = make_config(
        "model=llama3_8b", "model.max_model_len=4096", "mode=disagg", "engine.gpu_memory_utilization=0.35"
    )
    monkeypatch.setattr(memory, "device_bytes", lambda device: 80 * GIB)
    with pytest.raises(ConfigError) as refused:
        Cluster(ONE_GPU_1P1D, worker_template(cfg.serving), 10.0)  # no process is started before __enter__
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "cuda:0 (2 workers: prefill_only, decode_only) cannot fit: "
        "engine.gpu_memory_utilization=0.35 of 80.0 GiB with weights of 2 x 14.96 GiB"
    ), message
    assert "model.max_model_len=4096" in message


def test_a_share_too_small_for_one_request_is_refused_naming_the_knob():
    engine = EngineConfig(block_size=16, prefill_memory_share=0.01)
    long = dataclasses.replace(LLAMA, max_model_len=131072)  # 16 GiB of KV for one request
    with pytest.raises(ConfigError, match=r"the prefill_only worker's share \(engine.prefill_memory_share=0.01\)"):
        plan_kv_memory(ONE_GPU_1P1D, engine, need(long), memory=lambda d: 141 * GIB)


def test_explicit_pools_are_kept_but_checked_against_the_device():
    engine = EngineConfig(block_size=16, num_kv_blocks=1000)
    assert plan_kv_memory(ONE_GPU_1P1D, engine, need(), memory=lambda d: 80 * GIB) == [None, None]
    with pytest.raises(ConfigError, match="cannot hold weights 2 x 14.96 GiB"):
        plan_kv_memory(ONE_GPU_1P1D, engine, need(), memory=lambda d: 24 * GIB)


def test_a_lone_gpu_worker_takes_the_utilised_share_of_the_whole_device():
    config, block = EngineConfig(), 2 * 2**20
    weights, total = 15 * GIB, 80 * GIB
    blocks = kv_pool.pool_blocks(
        config, block, device_type="cuda", free_bytes=total - weights - GIB, total_bytes=total, used_bytes=weights
    )
    assert blocks == int(0.85 * total - weights) // block
    with pytest.raises(ConfigError, match="only 20.00 GiB is free"):  # another process holds the rest
        kv_pool.pool_blocks(
            config, block, device_type="cuda", free_bytes=20 * GIB, total_bytes=total, used_bytes=weights
        )
    assert kv_pool.pool_blocks(EngineConfig(num_kv_blocks=7), block, device_type="cuda") == 7


def test_cpu_pool_is_sized_from_the_available_memory():
    block = 8 * 2**10
    assert kv_pool.pool_blocks(EngineConfig(), block, device_type="cpu", free_bytes=GIB) == int(0.1 * GIB) // block
    assert kv_pool.pool_blocks(EngineConfig(), block, device_type="cpu", free_bytes=GIB, max_blocks=500) == 500
    assert (
        kv_pool.pool_blocks(EngineConfig(cpu_memory_utilization=0.5), block, device_type="cpu", free_bytes=GIB)
        == GIB // 2 // block
    )
    for explicit in (EngineConfig(num_kv_blocks=9), EngineConfig(kv_cache_mib=9 * 8 / 1024)):
        assert kv_pool.pool_blocks(explicit, block, device_type="cpu", free_bytes=GIB) == 9  # explicit wins


def test_an_engine_on_cpu_sizes_its_pool_from_the_host(monkeypatch):
    from testbed import LLM
    from testbed.engine import model_runner

    monkeypatch.setattr(model_runner, "host_available_bytes", lambda: 400 * 2**20)  # 40 MiB at the default 0.1
    block = 16 * 512  # tiny: 512 bytes of K and V per token in float32
    assert LLM("tiny", max_running=64).engine.runner.num_blocks == 40 * 2**20 // block
    # capped at what max_running requests of max_model_len hold; an explicit count wins
    assert LLM("tiny", max_running=2).engine.runner.num_blocks == 2 * 2048 // 16
    assert LLM("tiny", num_kv_blocks=300, max_model_len=1024).engine.runner.num_blocks == 300


def test_cpu_workers_split_the_host_memory():
    plans = [WorkerPlan(0, "prefill_only", "cpu"), WorkerPlan(1, "decode_only", "cpu")]
    small = dataclasses.replace(LLAMA, name="small", dtype="float32", max_model_len=4096)
    model = need(small, max_running=1000)("cpu")
    mib = plan_kv_memory(plans, EngineConfig(block_size=16), need(small, max_running=1000), memory=lambda d: 8 * GIB)
    kv = 0.1 * (8 * GIB - 2 * model.weight_bytes)
    assert mib == pytest.approx([0.2 * kv / 2**20, 0.8 * kv / 2**20])
    capped = plan_kv_memory(plans, EngineConfig(block_size=16), need(small, max_running=1), memory=lambda d: 8 * GIB)
    assert capped == pytest.approx([model.min_kv_bytes / 2**20] * 2)


def test_the_torch_bound_covers_the_features_used():
    """SDPA's enable_gqa came in torch 2.5: the dependency may not allow older releases."""
    uses_gqa = any("enable_gqa" in path.read_text() for path in (ROOT / "testbed").rglob("*.py"))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_dep] = [d for d in deps if re.match(r"torch\b", d)]
    low = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", torch_dep).group(1).split(".")[:2])
    assert not uses_gqa or low >= (2, 5), torch_dep


def test_gpu_check_leaves_the_memory_split_to_the_planner():
    assert "gpu_memory_utilization" not in (ROOT / "scripts" / "gpu_check").read_text()
