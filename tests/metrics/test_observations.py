"""The observation checklist of a P/D rollout in summary.json (and so sweep.parquet): TTFT by
tenant, TPOT/ITL by output length and by the running batch, KV pool occupancy and prefix-cache
hit rate per worker over time, and the NVML telemetry (energy per output token, NVLink bytes,
utilisation per role). Hand-made timestamps, steps and telemetry; every expected value worked
out by hand. Then the simulator and a real CPU cluster fill the new columns, and on GPUs the
NVLink counters see the KV bytes."""

from __future__ import annotations

import math
import types

import numpy as np
import pandas as pd
import pytest

from testbed.metrics import SLOConfig, json_safe, pooled_itl, request_table, summarize
from testbed.metrics.concurrency import CONCURRENCY_BUCKETS, by_concurrency, token_batches
from testbed.metrics.latency import OUTPUT_BUCKETS, by_output_bucket, ttft_by_tenant
from testbed.metrics.record import StepRecord
from testbed.metrics.steps import steps_table
from testbed.metrics.summary import pool_and_cache_by_worker
from testbed.metrics.telemetry import NOT_RECORDED, counter_delta, gpu_roles, telemetry_summary
from testbed.studies.sweep import flatten
from testbed.tracking import nvml as sampling

NAN = float("nan")


def nan_or(value):
    return pytest.approx(value, nan_ok=True)


# ---- latency splits -----------------------------------------------------------------------------


def test_ttft_by_tenant():
    table = request_table(
        [
            {"request_id": 0, "arrival_s": 0.0, "tenant": "chat", "token_times": [0.1, 0.2]},
            {"request_id": 1, "arrival_s": 1.0, "tenant": "chat", "token_times": [1.3]},
            {"request_id": 2, "arrival_s": 2.0, "tenant": "batch", "token_times": [3.0, 3.5]},
        ]
    )
    split = ttft_by_tenant(table)
    assert list(split) == ["batch", "chat"]
    assert split["batch"]["count"] == 1 and split["batch"]["p50"] == pytest.approx(1.0)
    assert split["chat"]["count"] == 2 and split["chat"]["mean"] == pytest.approx(0.2)
    assert split["chat"]["p99"] == pytest.approx(0.1 + 0.99 * 0.2)  # [0.1, 0.3], linear interpolation


def _evenly(n: int, gap: float, start: float = 1.0) -> list[float]:
    return [start + gap * i for i in range(n)]


def test_tpot_and_itl_by_output_bucket():
    shapes = [(127, 0.01), (128, 0.02), (600, 0.03), (2048, 0.04), (5, 0.05)]  # (tokens, gap)
    table = request_table(
        [
            {"request_id": i, "arrival_s": 0.0, "output_len": n, "token_times": _evenly(n, gap)}
            for i, (n, gap) in enumerate(shapes)
        ]
    )
    split = by_output_bucket(table)
    tpot, itl = split["tpot_by_output_bucket"], split["itl_by_output_bucket"]
    assert list(tpot) == list(itl) == list(OUTPUT_BUCKETS) == ["0-128", "128-512", "512-2K", "2K+"]
    assert [tpot[b]["count"] for b in OUTPUT_BUCKETS] == [2, 1, 1, 1]  # 127 and 5 below 128; 128 in 128-512
    assert tpot["0-128"]["mean"] == pytest.approx(0.03) and tpot["0-128"]["max"] == pytest.approx(0.05)
    assert [tpot[b]["p50"] for b in list(OUTPUT_BUCKETS)[1:]] == pytest.approx([0.02, 0.03, 0.04])
    assert [itl[b]["count"] for b in OUTPUT_BUCKETS] == [126 + 4, 127, 599, 2047]
    assert itl["0-128"]["mean"] == pytest.approx((126 * 0.01 + 4 * 0.05) / 130)
    assert itl["2K+"]["p99"] == pytest.approx(0.04)
    assert sum(itl[b]["count"] for b in OUTPUT_BUCKETS) == len(pooled_itl(table))  # every gap, once


# ---- the running batch at each token ------------------------------------------------------------


def _step(worker, start, end, decodes=0, chunks=(), role="decode_only"):
    return {
        "worker": worker,
        "role": role,
        "start_s": start,
        "end_s": end,
        "decode_seqs": decodes,
        "prefill_tokens": sum(n for n, _ in chunks),
        "prefill_chunks": chunks,
    }


# P (worker 0) prefills; D (worker 1) decodes. A token is stamped by its worker after its step
# ended and before the worker's next step started.
STEPS = pd.DataFrame(
    [
        _step(0, 0.0, 0.1, chunks=((50, 0), (50, 0)), role="prefill_only"),  # 2 sequences
        _step(1, 0.15, 0.2, decodes=1),
        _step(0, 0.3, 0.4, chunks=((30, 0),), role="prefill_only"),  # 1 sequence
        _step(1, 0.2, 0.25, decodes=2),  # rows out of time order: the join sorts a worker's steps
        _step(1, 0.45, 0.5, decodes=2, chunks=((8, 16),)),  # 3 sequences (an append beside 2 decodes)
    ]
)


def _batch_requests():
    worker = {
        0: [0.1005, 0.2, 0.25, 0.5],  # A: a stamp a little after its step's end
        1: [0.1, 0.25, 0.5],  # B
        2: [0.35],
    }  # C: stamped inside P's second step: no step of P fits it
    return request_table(
        [
            {
                "request_id": rid,
                "arrival_s": 0.0,
                "prefill_worker": 0,
                "decode_worker": 1,
                "output_len": len(times),
                "token_worker_times": times,
                "token_times": [t + 0.01 for t in times],
            }
            for rid, times in worker.items()
        ]
    )


def test_each_token_gets_the_batch_of_the_step_that_produced_it():
    batch = token_batches(_batch_requests(), STEPS)
    np.testing.assert_array_equal(batch, [2, 1, 2, 3, 2, 2, 3, NAN])
    assert np.isnan(token_batches(_batch_requests(), None)).all()  # no steps: nothing invented


def test_tpot_and_itl_by_concurrency():
    table = _batch_requests()
    split = by_concurrency(table, STEPS)
    itl, tpot = split["itl_by_concurrency"], split["tpot_by_concurrency"]
    assert list(itl) == list(tpot) == list(CONCURRENCY_BUCKETS) == ["1", "2-4", "5-16", "17-64", "65+"]
    # gaps by the batch of their later token: A 0.0995 (1), 0.05 (2), 0.25 (3); B 0.15 (2), 0.25 (3)
    assert [itl[b]["count"] for b in CONCURRENCY_BUCKETS] == [1, 4, 0, 0, 0]
    assert itl["1"]["mean"] == pytest.approx(0.0995)
    assert itl["2-4"]["mean"] == pytest.approx((0.05 + 0.25 + 0.15 + 0.25) / 4)
    assert math.isnan(itl["5-16"]["mean"])
    # TPOT by the mean batch after the first token: A (1+2+3)/3 = 2, B (2+3)/2 = 2.5; C has no TPOT
    assert tpot["2-4"]["count"] == 2 and tpot["1"]["count"] == 0
    assert tpot["2-4"]["mean"] == pytest.approx(((0.5 - 0.1005) / 3 + 0.4 / 2) / 2)
    assert split["concurrency"]["tokens_joined"] == 7 and split["concurrency"]["tokens_unjoined"] == 1
    assert split["concurrency"]["mean"] == pytest.approx(15 / 7) and split["concurrency"]["max"] == 3
    gaps = len(pooled_itl(table))
    assert sum(itl[b]["count"] for b in CONCURRENCY_BUCKETS) == gaps  # no later token is unjoined here


# ---- KV pool occupancy and prefix hit rate per step, per worker ---------------------------------


def _record(start, prefill=0, decodes=0, used=0, total=20, hits=0):
    return StepRecord(
        start=start,
        end=start + 0.01,
        role="chunked",
        prefill_tokens=prefill,
        decode_seqs=decodes,
        batched_tokens=prefill + decodes,
        kv_blocks_used=used,
        num_waiting=0,
        num_running=decodes,
        schedule_s=0.0,
        prepare_s=0.0,
        forward_s=0.01,
        sample_s=0.0,
        postprocess_s=0.0,
        kv_blocks_total=total,
        prefix_hit_tokens=hits,
    )


def _pool_steps():
    return steps_table(
        [
            (0, _record(10.0, prefill=60, used=5, hits=40)),
            (0, _record(10.1, decodes=3, used=10)),
            (1, _record(10.1, prefill=100, used=1, total=0)),  # a pool of unknown size
            (0, _record(10.2, prefill=30, decodes=2, used=15, hits=90)),
        ],
        10.0,
    )


def test_steps_table_has_occupancy_and_hit_rate_per_step():
    steps = _pool_steps()
    by_worker = steps.sort_values(["worker", "step"])
    np.testing.assert_allclose(by_worker["kv_occupancy"], [0.25, 0.5, 0.75, NAN])
    np.testing.assert_allclose(by_worker["prefix_hit_rate"], [0.4, NAN, 0.75, 0.0])  # hits / (hits + computed)
    assert by_worker["kv_blocks_total"].tolist() == [20, 20, 20, 0]
    assert by_worker["prefix_hit_tokens"].tolist() == [40, 0, 90, 0]


def test_occupancy_and_hit_rate_p50_p99_per_worker():
    figures = pool_and_cache_by_worker(_pool_steps())
    occupancy, hit_rate = figures["kv_occupancy_by_worker"], figures["prefix_hit_rate_by_worker"]
    assert set(occupancy) == set(hit_rate) == {"worker0", "worker1"}
    assert occupancy["worker0"]["p50"] == pytest.approx(0.5)
    assert occupancy["worker0"]["p99"] == pytest.approx(0.5 + 0.98 * 0.25)  # [0.25, 0.5, 0.75] at 1.98
    assert math.isnan(occupancy["worker1"]["p50"])  # pool size unknown: no occupancy, not a guess
    assert hit_rate["worker0"]["p50"] == pytest.approx((0.4 + 0.75) / 2)  # the decode-only step has none
    assert hit_rate["worker0"]["p99"] == pytest.approx(0.4 + 0.99 * 0.35)
    assert hit_rate["worker0"]["overall"] == pytest.approx(130 / 220)
    assert hit_rate["worker1"]["overall"] == 0.0


# ---- telemetry: counters and utilisation from a synthetic table ---------------------------------


def _telemetry() -> pd.DataFrame:
    rows = []
    columns = {  # per GPU: four samples, t = 0..3
        0: {
            "energy_mj": [1000, 3000, 5000, 9000],
            "nvlink_tx_kib": [0, 100, 300, 300],
            "nvlink_rx_kib": [0] * 4,
            "util_pct": [10, 20, 30, 40],
            "mem_util_pct": [5, 5, 5, 5],
            "sm_util_pct": [NAN, 40, 60, 80],
            "dram_bw_util_pct": [NAN, 10, 20, 30],
        },
        1: {
            "energy_mj": [500, 1500, 100, 600],  # the counter was reset between t=1 and t=2
            "nvlink_tx_kib": [10] * 4,
            "nvlink_rx_kib": [0, 100, 250, 300],
            "util_pct": [50, 50, NAN, 70],
            "mem_util_pct": [60, 70, 80, 90],
            "sm_util_pct": [NAN] * 4,
            "dram_bw_util_pct": [NAN] * 4,
        },
        2: {
            "energy_mj": [0, 1e9, 2e9, 3e9],
            "nvlink_tx_kib": [0, 1e9, 2e9, 3e9],
            "nvlink_rx_kib": [0] * 4,
            "util_pct": [100] * 4,
            "mem_util_pct": [100] * 4,
            "sm_util_pct": [100] * 4,
            "dram_bw_util_pct": [100] * 4,
        },  # a GPU no worker of the point uses
    }
    for gpu, values in columns.items():
        for i in reversed(range(4)):  # out of time order: the figures sort by t_s
            rows.append({"t_s": float(i), "gpu": gpu, **{k: float(v[i]) for k, v in values.items()}})
    return pd.DataFrame(rows)


def test_counter_delta_skips_resets():
    assert counter_delta([1000, 3000, 5000, 9000]) == 8000
    assert counter_delta([500, 1500, 100, 600]) == 1500
    assert math.isnan(counter_delta([7.0])) and math.isnan(counter_delta([NAN, 3.0]))


def test_gpu_roles_from_worker_devices():
    workers = [("cuda:0", "prefill_only"), ("cuda:1", "decode_only"), ("cuda:1", "chunked"), ("cpu", "decode_only")]
    assert gpu_roles(workers) == {0: "prefill_only", 1: "chunked+decode_only"}
    assert gpu_roles([("cpu", "colocated")]) == {}


def test_energy_nvlink_and_utilisation_per_role():
    roles = {0: "prefill_only", 1: "decode_only"}
    t = telemetry_summary(_telemetry(), roles, output_tokens=19)
    assert t["available"] is True and t["gpus"] == 2 and t["samples"] == 8
    assert t["energy_j"] == pytest.approx(8.0 + 1.5)  # mJ rises: 8000 and 1000 + 500
    assert t["energy_per_output_token_j"] == pytest.approx(9.5 / 19)
    assert t["nvlink_tx_bytes"] == 300 * 1024 and t["nvlink_rx_bytes"] == 300 * 1024
    p, d = t["by_role"]["prefill_only"], t["by_role"]["decode_only"]
    assert (
        p["util_pct_mean"],
        p["mem_util_pct_mean"],
        p["sm_util_pct_mean"],
        p["dram_bw_util_pct_mean"],
    ) == pytest.approx((25.0, 5.0, 60.0, 20.0))
    assert d["util_pct_mean"] == pytest.approx(170 / 3) and d["mem_util_pct_mean"] == pytest.approx(75.0)
    assert d["sm_util_pct_mean"] is None  # no GPM on that GPU: absent, not zero
    assert (p["energy_j"], d["energy_j"]) == pytest.approx((8.0, 1.5))


def test_a_gpu_without_a_counter_leaves_the_total_unknown():
    table = _telemetry()
    table.loc[table["gpu"] == 1, "energy_mj"] = NAN
    t = telemetry_summary(table, {0: "prefill_only", 1: "decode_only"}, output_tokens=19)
    assert t["energy_j"] is None and t["energy_per_output_token_j"] is None
    assert t["by_role"]["prefill_only"]["energy_j"] == pytest.approx(8.0)
    assert telemetry_summary(table, {0: "prefill_only", 5: "decode_only"}, 19)["energy_j"] is None  # no samples


def test_without_nvml_every_figure_is_none_beside_the_marker():
    for telemetry, roles, reason in (
        (None, {}, NOT_RECORDED),
        (_telemetry(), {}, "no GPU among the point's workers"),
        (None, {0: "prefill_only"}, NOT_RECORDED),
    ):
        t = telemetry_summary(telemetry, roles, output_tokens=10)
        assert t["available"] is False and t["reason"] == reason
        assert all(t[key] is None for key in ("energy_j", "energy_per_output_token_j", "nvlink_tx_bytes"))
        assert all(v is None for role in t["by_role"].values() for k, v in role.items() if k != "gpus")


def _served():
    return request_table(
        [
            {
                "request_id": i,
                "arrival_s": 0.1 * i,
                "input_len": 10,
                "output_len": 4,
                "token_times": _evenly(4, 0.01, 0.1 * i + 0.05),
            }
            for i in range(5)
        ]
    )


def test_summary_and_sweep_row_carry_the_telemetry():
    roles = {0: "prefill_only", 1: "decode_only"}
    summary = json_safe(summarize(_served(), slo=SLOConfig(), telemetry=_telemetry(), gpu_roles=roles))
    assert summary["telemetry"]["energy_per_output_token_j"] == pytest.approx(9.5 / 20)  # 5 requests x 4 tokens
    assert summary["kv_transfer"]["nvlink_tx_bytes"] == 300 * 1024  # beside kv_transfer.bytes_total
    row = flatten(summary)
    assert row["telemetry_available"] == 1.0 and row["kv_transfer_nvlink_rx_bytes"] == 300 * 1024
    assert row["telemetry_by_role_decode_only_util_pct_mean"] == pytest.approx(170 / 3)
    for key in (
        "ttft_by_tenant_default_p99",
        "tpot_by_output_bucket_0-128_p99",
        "itl_by_output_bucket_2K+_count",
        "itl_by_concurrency_1_count",
        "tpot_by_concurrency_65+_p50",
        "concurrency_tokens_unjoined",
    ):
        assert key in row, key


def test_on_cpu_the_summary_says_telemetry_is_absent():
    summary = json_safe(summarize(_served(), slo=SLOConfig()))
    assert summary["telemetry"]["available"] is False
    assert summary["telemetry"]["energy_per_output_token_j"] is None
    assert summary["kv_transfer"]["nvlink_tx_bytes"] is None
    row = flatten(summary)
    assert row["telemetry_available"] == 0.0 and math.isnan(row["telemetry_energy_per_output_token_j"])
    assert math.isnan(row["kv_transfer_nvlink_tx_bytes"])


# ---- telemetry: the sampler against a fake NVML -------------------------------------------------


def _fake_nvml(gpm: bool):
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    energy, reads = {0: 0}, {0: 0}

    def total_energy(h):
        energy[h] += 2500
        return energy[h]

    def field_values(h, fields):
        reads[h] += 1
        return [
            types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=100 * reads[h] + (f == 139)))
            for f, _ in fields
        ]

    nvml.__dict__.update(
        NVMLError=NVMLError,
        NVML_SUCCESS=0,
        NVML_CLOCK_SM=1,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX=138,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX=139,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=70, memory=35),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1 << 30),
        nvmlDeviceGetPowerUsage=lambda h: 300_000,
        nvmlDeviceGetClockInfo=lambda h, clock: 1980,
        nvmlDeviceGetTotalEnergyConsumption=total_energy,
        nvmlDeviceGetFieldValues=field_values,
    )
    if gpm:
        pynvml = pytest.importorskip("pynvml")
        samples = []

        def metrics_get(request):
            assert request.version == pynvml.NVML_GPM_METRICS_GET_VERSION and request.numMetrics == 2
            assert [request.metrics[i].metricId for i in range(2)] == [
                pynvml.NVML_GPM_METRIC_SM_UTIL,
                pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
            ]
            request.metrics[0].value, request.metrics[1].value = 61.5, 23.25
            request.metrics[1].nvmlReturn = 0
            return request

        nvml.__dict__.update(
            c_nvmlGpmMetricsGet_t=pynvml.c_nvmlGpmMetricsGet_t,  # the binding's own ctypes struct
            NVML_GPM_METRICS_GET_VERSION=pynvml.NVML_GPM_METRICS_GET_VERSION,
            NVML_GPM_METRIC_SM_UTIL=pynvml.NVML_GPM_METRIC_SM_UTIL,
            NVML_GPM_METRIC_DRAM_BW_UTIL=pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
            nvmlGpmQueryDeviceSupport=lambda h: types.SimpleNamespace(isSupportedDevice=1),
            nvmlGpmSampleAlloc=lambda: samples.append(pynvml.c_nvmlGpmSample_t()) or samples[-1],
            nvmlGpmSampleGet=lambda h, sample: sample,
            nvmlGpmMetricsGet=metrics_get,
            nvmlGpmSampleFree=lambda sample: samples.remove(sample),
        )
        nvml.samples = samples
    return nvml


def _sample(nvml, count: int) -> pd.DataFrame:
    """`count` samples of GPU 0 through the sampler's own _sample, without its thread."""
    gpu = sampling.GpuHandle(0, "GPU-aaaa", 0, nvlink_scopes=(sampling.NVLINK_ALL_LINKS,))
    gpu.gpm = sampling.Gpm.open(nvml, 0)
    sampler = object.__new__(sampling.NvmlSampler)
    sampler._nvml, sampler._gpus, sampler._t0, sampler._last_counters = nvml, [gpu], 0.0, {}
    rows = pd.DataFrame([sampler._sample(gpu) for _ in range(count)], columns=sampling.COLUMNS)
    if gpu.gpm is not None:
        gpu.gpm.close()
    return rows


@pytest.mark.parametrize("gpm", [False, True])
def test_sampler_records_counters_utilisation_and_gpm(gpm):
    nvml = _fake_nvml(gpm)
    rows = _sample(nvml, 3)
    assert rows["energy_mj"].tolist() == [2500, 5000, 7500]  # the counter as read: deltas come later
    assert rows["nvlink_tx_kib"].tolist() == [100, 200, 300] and rows["nvlink_rx_kib"].tolist() == [101, 201, 301]
    assert (rows["util_pct"] == 70).all() and (rows["mem_util_pct"] == 35).all()
    if gpm:  # the first sample has no interval behind it
        assert math.isnan(rows["sm_util_pct"][0]) and rows["sm_util_pct"][1:].tolist() == [61.5, 61.5]
        assert rows["dram_bw_util_pct"][1:].tolist() == [23.25, 23.25]
        assert nvml.samples == []  # every GPM sample buffer freed
    else:
        assert rows["sm_util_pct"].isna().all() and rows["dram_bw_util_pct"].isna().all()
    t = telemetry_summary(rows, {0: "decode_only"}, output_tokens=5)
    assert t["energy_j"] == pytest.approx(5.0) and t["energy_per_output_token_j"] == pytest.approx(1.0)
    assert t["nvlink_tx_bytes"] == t["nvlink_rx_bytes"] == 200 * 1024


def test_a_binding_without_the_energy_call_gives_nan():
    nvml = _fake_nvml(False)
    del nvml.nvmlDeviceGetTotalEnergyConsumption  # an older nvidia-ml-py
    assert _sample(nvml, 2)["energy_mj"].isna().all()


# ---- the simulator and a real CPU cluster fill the new columns ----------------------------------

SIM_LAYOUTS = {
    "chunked": ["mode=chunked", "cluster.num_workers=2"],
    # D prefills later turns itself (PPD): their tokens come from D alone
    "disagg-ppd": [
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=2",
        "cluster.dispatch=session_affinity",
        "kv_transfer.multiturn=ppd",
    ],
}


@pytest.mark.parametrize("layout", list(SIM_LAYOUTS))
def test_the_simulator_fills_pool_and_prefix_columns_and_joins_every_token(layout):
    from testbed.sim.executor import simulate
    from tests.cluster_helpers import make_config, sim_args
    from tests.sim.test_sim import PROFILE

    result = simulate(
        *sim_args(
            make_config(
                "workload=multiturn",
                "workload.num_requests=24",
                "workload.rate=50",
                "workload.think_time_s=0.01",
                "engine.enable_prefix_caching=true",
                "hardware=cpu",
                *SIM_LAYOUTS[layout],
            )
        ),
        PROFILE,
    )
    steps, requests, summary = result["steps"], result["requests"], result["summary"]
    assert (requests.status == "ok").all()
    assert layout != "disagg-ppd" or (requests.prefilled_on == "decode").any()
    assert (steps["kv_blocks_total"] > 0).all() and steps["kv_occupancy"].between(0, 1).all()
    assert steps["prefix_hit_tokens"].sum() == requests["prefix_hit_tokens"].sum() > 0
    workers = {f"worker{w}" for w in steps["worker"].unique()}
    assert set(summary["kv_occupancy_by_worker"]) == set(summary["prefix_hit_rate_by_worker"]) == workers
    assert summary["concurrency"]["tokens_unjoined"] == 0
    assert summary["concurrency"]["tokens_joined"] == requests["num_tokens"].sum()
    assert summary["telemetry"]["available"] is False


@pytest.mark.slow
def test_a_real_disagg_run_fills_the_columns_and_joins_every_token(tmp_path):
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config, small_workload

    cfg = make_config(*small_workload(), "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1")
    result = serve(cfg, tmp_path, progress=False)
    steps, summary = result["steps"], result["summary"]
    assert (steps["kv_blocks_total"] == 256).all() and steps["kv_occupancy"].between(0, 1).all()
    assert summary["concurrency"]["tokens_unjoined"] == 0
    assert summary["concurrency"]["tokens_joined"] == result["requests"]["num_tokens"].sum()
    assert sum(v["count"] for v in summary["itl_by_concurrency"].values()) == len(pooled_itl(result["requests"]))
    assert summary["telemetry"]["available"] is False and summary["kv_transfer"]["nvlink_tx_bytes"] is None
    back = pd.read_parquet(tmp_path / "steps.parquet")
    assert {"kv_occupancy", "prefix_hit_rate", "kv_blocks_total", "prefix_hit_tokens"} <= set(back.columns)


# ---- GPUs: NVML sees the run ---------------------------------------------------------------------

GPU_RUN = [
    "workload.num_requests=16",
    "workload.rate=20",
    "model.max_model_len=2048",
    "engine.num_kv_blocks=512",
    "workload.input_len.min=1000",
    "workload.input_len.max=1800",
    "workload.output_len.min=4",
    "workload.output_len.max=8",
    "hardware=gpu",
    "model.dtype=float32",
]


def _skip_without_nvml():
    pytest.importorskip("pynvml")
    if not sampling.gpu_inventory().get("available"):
        pytest.skip("NVML is not available")


@pytest.mark.gpu
def test_telemetry_of_a_gpu_run(tmp_path):
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config

    _skip_without_nvml()
    summary = serve(make_config(*GPU_RUN, "mode=colocated", "cluster.num_workers=1"), tmp_path, progress=False)[
        "summary"
    ]
    t = summary["telemetry"]
    assert t["available"] is True and t["gpus"] == 1 and t["samples"] > 0
    assert t["by_role"]["colocated"]["util_pct_mean"] is not None
    if t["energy_j"] is not None:  # Volta and newer
        assert t["energy_j"] > 0 and t["energy_per_output_token_j"] > 0


@pytest.mark.gpu
@pytest.mark.multigpu  # NCCL cannot pair two ranks on one GPU
def test_nvlink_bytes_cover_the_kv_bytes_of_a_1p1d_run(tmp_path):
    from testbed.studies.real_cluster import serve
    from tests.cluster_helpers import make_config

    _skip_without_nvml()
    result = serve(
        make_config(*GPU_RUN, "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1"), tmp_path, progress=False
    )
    kv = result["summary"]["kv_transfer"]
    if kv["nvlink_tx_bytes"] is None:
        pytest.skip("no NVLink counters between these GPUs (PCIe, or the driver lacks the fields)")
    assert kv["bytes_total"] > 0
    assert kv["nvlink_tx_bytes"] >= kv["bytes_total"] and kv["nvlink_rx_bytes"] >= kv["bytes_total"]
