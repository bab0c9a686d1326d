"""Tensor parallelism in the simulator and the analytical cost model: the presets at real shapes,
TP1 exactly as before, the TP step and memory rules, the one-line refusals, the layout, the KV
hand-off between groups of different degrees, the plan study's placement search, and the
phenomena TP exists to show (decode TPOT falls with TP while per-GPU throughput falls; a long
prefill shortens with TP)."""

from __future__ import annotations

import json

import pytest

from testbed.config import compose_config, with_overrides
from testbed.control.config import ClusterConfig
from testbed.control.layout import plan_on_devices
from testbed.errors import ConfigError
from testbed.model.config import PRESETS, ModelConfig
from testbed.perf import GPUS, RooflineModel, weight_params
from testbed.perf.roofline import rank_params
from testbed.sim.executor import simulate
from testbed.sizing import compose_sized
from testbed.studies import layouts, placements, plan, ratio_sweep

H100 = GPUS["h100_sxm"]
L70 = PRESETS["llama3_70b"]
GPU_SIM = ["executor=sim", "sim.profile=h100_sxm", "hardware=cpu"]


def sim_config(*overrides: str):
    return compose_config([*GPU_SIM, *overrides])


def fixed(key: str, n: int) -> list[str]:
    return [f"{key}.dist=fixed", f"{key}.mean={n}", f"{key}.min={n}", f"{key}.max={n}"]


# -- presets ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, params, layers, kv_heads",
    [("llama3_70b", 70.55e9, 80, 8), ("llama31_405b", 405.85e9, 126, 8), ("qwen2_5_72b", 72.71e9, 80, 8)],
)
def test_large_presets_have_their_published_sizes(name, params, layers, kv_heads):
    args = ModelConfig(name=name).args()
    assert weight_params(args) == pytest.approx(params, rel=1e-3)
    assert (args.num_layers, args.num_kv_heads, args.head_dim) == (layers, kv_heads, 128)


def test_llama2_7b_is_multi_head_attention():
    args = PRESETS["llama2_7b"]
    assert args.num_kv_heads == args.num_heads == 32 and args.kv_heads_per_rank(4) == 8


def test_a_config_json_alone_serves_the_simulator(tmp_path):
    hf = {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))  # no weights: the simulator needs none
    cfg = sim_config(
        "model=hf", f"model.path={tmp_path}", "cluster.tp=4", "cluster.num_workers=2", "workload.num_requests=8"
    )
    result = simulate(cfg.serving, cfg.sim)
    assert (result["requests"]["status"] == "ok").sum() == 8 and result["summary"]["num_gpus"] == 8


# -- the cost model -------------------------------------------------------------------------------
# step_time (hex) of a 2048-token prefill, a decode of 32 at context 2048 and a mixed step; the
# pool's blocks at gpu_memory_utilization 0.85 in 16-token blocks; a 123456789-byte KV send: the
# one-device model before tensor parallelism existed (h100_sxm, bfloat16)
BEFORE_TP = {
    "llama3_8b": ["0x1.8f4075b67d029p-5", "0x1.66a74b76328e1p-7", "0x1.14608c81db2e7p-6", 27004],
    "qwen2_5_7b": ["0x1.7253e21f4050ap-5", "0x1.20c2138e81adbp-7", "0x1.dea8e502169f4p-7", 62628],
    "llama2_7b": ["0x1.7b5568fcd3273p-5", "0x1.45ccafb03fea9p-6", "0x1.79d6a862e4dedp-6", 7059],
}


@pytest.mark.parametrize("name", sorted(BEFORE_TP))
def test_tp1_is_the_one_device_model_to_the_last_bit(name):
    from testbed.engine.config import EngineConfig
    from testbed.sim.pools import gpu_pool_blocks

    model = RooflineModel(H100, PRESETS[name], 2, tp=1)
    shapes = [
        (2048, model.prefill_context([(2048, 0)]), 0, 0),
        (0, 0.0, 32, 32 * 2048),
        (512, model.prefill_context([(512, 1024)]), 16, 16 * 3000),
    ]
    assert [model.step_time(*s).hex() for s in shapes] == BEFORE_TP[name][:3]
    engine = EngineConfig(block_size=16)
    assert gpu_pool_blocks(model, engine) == BEFORE_TP[name][3]
    assert model.transfer_time(123456789).hex() == "0x1.721468997bcf8p-12"
    assert model.breakdown(512, 100.0, 8, 800)["all_reduce"] == 0.0


def ring_all_reduce_s(tp: int, tokens: int, hidden: int) -> float:
    steps = 2 * (tp - 1)
    return steps / tp * tokens * hidden * 2 / (H100.nvlink_bytes_per_s * H100.nvlink_share) + steps * 0.6e-6


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_tp_step_splits_the_work_and_adds_two_all_reduces_a_layer(tp):
    one, group = RooflineModel(H100, L70, 2), RooflineModel(H100, L70, 2, tp=tp)
    for tokens, seqs in ((2048, 0), (0, 32)):
        ctx = one.prefill_context([(tokens, 0)]) if tokens else 0.0
        a, b = (
            one.breakdown(tokens, ctx, seqs, 32 * 2048 * (seqs > 0)),
            group.breakdown(tokens, ctx, seqs, 32 * 2048 * (seqs > 0)),
        )
        assert b["gemm"] == pytest.approx(a["gemm"] / tp, rel=0.02)  # weights and FLOPs split
        assert b["decode_attention"] == pytest.approx(a["decode_attention"] / tp, rel=0.02)  # 8 KV heads over tp ranks
        assert b["overhead"] == a["overhead"]  # the host does not split
        assert b["all_reduce"] == pytest.approx(2 * 80 * ring_all_reduce_s(tp, tokens + seqs, 8192), rel=1e-12)


def test_replicated_kv_heads_count_once_per_rank():
    big = PRESETS["llama31_405b"]  # 8 KV heads: at TP16 each is held by two ranks
    at8, at16 = RooflineModel(H100, big, 2, tp=8), RooflineModel(H100, big, 2, tp=16)
    assert at8.rank_kv_bytes_per_token == at16.rank_kv_bytes_per_token == 2 * 126 * 128 * 2
    assert (
        at16.breakdown(0, 0.0, 32, 65536)["decode_attention"]
        > 0.9 * at8.breakdown(0, 0.0, 32, 65536)["decode_attention"]
    )
    assert rank_params(big, 16) > rank_params(big, 8) / 2  # the replicated k/v projections


def test_memory_per_device_shares_the_weights_and_sizes_the_pool_from_the_rest():
    from testbed.engine.config import EngineConfig
    from testbed.sim.pools import gpu_pool_blocks

    engine = EngineConfig(block_size=16)
    with pytest.raises(ConfigError, match=r"do not fit .* split the weights over more devices"):
        gpu_pool_blocks(RooflineModel(H100, L70, 2), engine)
    for tp in (4, 8):
        model = RooflineModel(H100, L70, 2, tp=tp)
        per_device = H100.memory_bytes * 0.85 - rank_params(L70, tp) * 2
        assert model.kv_pool_bytes(0.85) == per_device
        # the group's tokens: each rank's pool over its share of a token's KV (tp x the device's bytes)
        tokens = gpu_pool_blocks(model, engine) * 16
        assert tokens == pytest.approx(tp * per_device / (L70.kv_bytes_per_token * 2), rel=1e-3)
    assert rank_params(L70, 8) * 8 == pytest.approx(weight_params(L70), rel=1e-3)  # the vocabulary split too


# -- configuration ------------------------------------------------------------------------------
def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_real_tp_workers_refuse_what_they_do_not_combine_with_in_one_line():
    compose_config(["model=tiny", "mode=disagg", "cluster.decode_tp=2", "hardware=cpu"])  # real TP workers run
    for setting in ("kv_transfer.granularity=layer", "kv_store.capacity_mib=8"):
        with pytest.raises(ConfigError) as real:
            compose_config(["model=tiny", "mode=disagg", "cluster.decode_tp=2", "hardware=cpu", setting])
        assert one_line(real).startswith("cluster.decode_tp=2 with "), setting
        assert "use kv_transfer.granularity=request" in one_line(real)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=llama3_70b", "cluster.tp=3"],
            "cluster.tp=3 does not split model.num_heads=64 and model.num_kv_heads=8",
        ),
        (["model=qwen2_5_7b", "cluster.tp=8"], "allowed 1, 2, 4, 28"),  # 28 heads: 8 does not divide them
        (["model=llama3_70b", "cluster.tp=4", "cluster.num_workers=3", "hardware.num_devices=8"], "needs 12 devices"),
    ],
)
def test_a_tp_degree_that_cannot_be_placed_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        sim_config(*overrides)
    assert message in one_line(refused)


def test_kv_heads_fewer_than_ranks_are_replicated_not_refused():
    sim_config("model=llama3_70b", "cluster.tp=16")  # 8 KV heads, each on two of 16 ranks
    assert not PRESETS["qwen2_5_7b"].splits_over(7)  # 28 heads split over 7, but 7 is no multiple of 4 KV heads


def test_a_measured_profile_refuses_tp_in_one_line():
    cfg = compose_config(["executor=sim", "hardware=cpu", "cluster.tp=2", "hardware.num_devices=2"])
    with pytest.raises(ConfigError) as refused:
        simulate(cfg.serving, cfg.sim)
    assert "tensor parallelism is modelled on the analytical GPUs only" in one_line(refused)


def test_a_tp_worker_takes_consecutive_devices():
    cluster = ClusterConfig(num_prefill=2, num_decode=1, prefill_tp=2, decode_tp=4)
    plans = plan_on_devices("disagg", cluster, "sim", 8, "eight")
    assert [p.devices for p in plans] == [["sim:0", "sim:1"], ["sim:2", "sim:3"], [f"sim:{i}" for i in range(4, 8)]]
    with pytest.raises(ConfigError, match="needs 8 devices"):
        plan_on_devices("disagg", cluster, "sim", 7, "seven")
    assert [p.devices for p in plan_on_devices("chunked", ClusterConfig(num_workers=3), "sim", 3, "")] == [
        ["sim:0"],
        ["sim:1"],
        ["sim:2"],
    ]


# -- the simulator --------------------------------------------------------------------------------
@pytest.mark.parametrize("p_tp, d_tp", [(1, 4), (2, 4), (4, 2)])
def test_the_kv_moves_once_each_rank_its_share_in_parallel(p_tp, d_tp):
    cfg = sim_config(
        "model=llama3_8b",  # 8 KV heads, as Llama-3-70B, whose weights one device does not hold
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=1",
        f"cluster.prefill_tp={p_tp}",
        f"cluster.decode_tp={d_tp}",
        f"hardware.num_devices={p_tp + d_tp}",
        "workload.num_requests=3",
        "workload.rate=0.5",
        *fixed("workload.input_len", 1000),
        *fixed("workload.output_len", 8),
    )
    result = simulate(cfg.serving, cfg.sim)
    transfers, summary = result["transfers"], result["summary"]
    kv = 1000 * PRESETS["llama3_8b"].kv_bytes_per_token * 2
    assert (transfers["kv_bytes"] == kv).all()  # the request's KV, each byte once
    share = kv // min(p_tp, d_tp)  # 8 KV heads: the narrower group's ranks carry the most
    link = H100.link_latency_s + share / (H100.nvlink_bytes_per_s * H100.nvlink_share)
    assert (transfers["end_s"] - transfers["start_s"]).to_numpy() == pytest.approx(link, rel=1e-9)
    assert [w["tp"] for w in summary["workers"].values()] == [p_tp, d_tp] and summary["num_gpus"] == p_tp + d_tp
    assert summary["sim"]["profiles"]["decode"]["tp"] == d_tp


# -- the placement search -----------------------------------------------------------------------
def test_placements_of_eight_devices():
    found = placements.disaggregated(8, [1, 2, 4, 8])
    assert len(found) == 21 and all(p.workers * p.tp + p.decode * p.decode_tp == 8 for p in found)
    labels = {p.label for p in found}
    assert {"2xTP2P-1xTP4D", "1P7D", "1xTP4P-1xTP4D"} <= labels and "1xTP8P-0xTP1D" not in labels
    assert [p.label for p in placements.mixed("colocated", 8, [1, 2, 4, 8])] == [
        "colocated",
        "colocated-TP2",
        "colocated-TP4",
        "colocated-TP8",
    ]


def test_every_study_lays_out_the_cluster_s_tp_degrees():
    cfg = compose_sized(["+experiment=rate_sweep", *GPU_SIM, "model=llama3_70b", "hardware.num_devices=8", "size=gpu"])
    tp = with_overrides(cfg, {"cluster.tp": 4, "cluster.prefill_tp": 2, "cluster.decode_tp": 4})
    laid = dict(layouts.layouts(tp, ["colocated", "disagg"], all_splits=True))
    assert laid["colocated-TP4"]["cluster.num_workers"] == 2
    assert set(laid) == {"colocated-TP4", "2xTP2P-1xTP4D"}  # 2 x 2 + 1 x 4 = 8
    assert dict(layouts.layouts(tp, ["disagg"]))["2xTP2P-1xTP4D"] == {
        "mode": "disagg",
        "cluster.num_prefill": 2,
        "cluster.num_decode": 1,
    }


def plan_config(*extra: str):
    return compose_sized(["+experiment=plan", *GPU_SIM, "hardware.num_devices=8", "size=gpu", *extra])


def test_plan_without_tp_degrees_searches_the_one_device_splits_as_before():
    points = plan.points(plan_config("model=llama3_8b"))
    labels = {p.knobs["label"] for p in points}
    assert labels == {
        "colocated",
        *(f"{p}P{8 - p}D" for p in range(1, 8)),
        "chunked",
        "chunked512",
        "chunked2048",
        "chunked8192",
    }
    assert not any("tp" in key for p in points for key in p.overrides)


def test_plan_over_tp_degrees_prunes_what_does_not_fit_memory():
    cfg = plan_config("model=llama3_70b", "experiment.own.tp_degrees=[1,2,4,8]")
    kept, pruned = placements.search(cfg, 8, cfg.experiment.own["tp_degrees"])
    assert [p.label for p in kept] == ["colocated-TP4", "colocated-TP8", "1xTP4P-1xTP4D", "chunked-TP4", "chunked-TP8"]
    assert "141.1 GB of weights" in pruned["4P4D"] and "70.6 GB of weights" in pruned["colocated-TP2"]
    points = plan.points(cfg)
    disagg = [p for p in points if p.knobs["label"] == "1xTP4P-1xTP4D"]
    assert disagg[0].knobs["prefill_tp"] == disagg[0].knobs["decode_tp"] == 4
    assert disagg[0].overrides["cluster.prefill_tp"] == 4 and disagg[0].overrides["executor"] == "sim"


def test_the_planners_propose_only_layouts_that_fit_70b_on_eight_h100s():
    """Llama-3-70B on 8 H100s: one device holds no worker, so no planner may answer a one-device
    split (the analytical one answered 7P1D, a layout the placement search prunes). Both refuse it
    with the search's own reason (one rule), and plan workers of the smallest degree that holds
    the model instead: a layout the search keeps."""
    from testbed.sim.load_split import analytical_split
    from testbed.sim.slo_split import slo_split
    from testbed.studies.report import plan_lines

    cfg = plan_config("model=llama3_70b")
    kept, pruned = placements.search(cfg, 8, [1, 2, 4, 8])
    for planner in (lambda c: analytical_split(c.serving, c.sim, None, 8), lambda c: slo_split(c.serving, c.sim, 8)):
        with pytest.raises(ConfigError, match="no P:D split of 8 devices to propose") as refused:
            planner(cfg)
        assert pruned["7P1D"] in str(refused.value)
    planned, why = placements.planning(cfg, 8)
    assert (planned.cluster.prefill_tp, planned.cluster.decode_tp) == (4, 4) and why.startswith("workers of TP4")
    labels = {p.label for p in kept}
    analytical = analytical_split(planned.serving, planned.sim, None, 8)
    assert analytical["split"] == analytical["mean"]["split"] == "1xTP4P-1xTP4D" and "1xTP4P-1xTP4D" in labels
    slo = slo_split(planned.serving, planned.sim, 8, rate=1.0)
    assert set(slo["splits"]) == {"1xTP4P-1xTP4D"} and slo["best"] in (None, "1xTP4P-1xTP4D")
    skipped = {"analytical": None, "analytical_skipped": "no P:D split", "simulated": {"goodput": {}, "best": {}}}
    assert plan_lines(skipped)[1] == "  analytical: none (no P:D split)"
    small = plan_config("model=llama3_8b")  # one device holds it: the one-device splits, as always
    assert placements.planning(small, 8) == (small, None)
    assert analytical_split(small.serving, small.sim, None, 8)["split"] in {f"{p}P{8 - p}D" for p in range(1, 8)}


def test_plan_over_tp_degrees_runs_every_placement_on_all_the_devices(tmp_path):
    from testbed.studies.runner import run

    cfg = compose_sized(
        [
            "+experiment=plan",
            "size=tiny",
            "sim.profile=h100_sxm",  # the tiny model on an analytical GPU: TP needs one
            "experiment.own.tp_degrees=[1,2]",
            "experiment.own.chunk_sizes=[]",
            "experiment.search_points=0",
        ]
    )
    result = run(cfg, tmp_path)
    search, table = result["aggregate"]["placements"], result["table"]
    assert set(search["searched"]) == {"colocated", "1P2D", "2P1D", "1xTP1P-1xTP2D", "1xTP2P-1xTP1D", "chunked"}
    assert search["best"] in search["searched"] and search["pruned"] == {}
    assert set(table["num_gpus"]) == {3}  # a TP2 worker counts both its devices
    rows = table[table["label"] == "1xTP1P-1xTP2D"]
    assert set(rows["prefill_tp"]) == {1} and set(rows["decode_tp"]) == {2}


def test_the_placement_search_reports_its_leader_with_the_interval():
    from testbed.studies.plan import placement_search

    cfg = plan_config("model=llama3_70b", "experiment.own.tp_degrees=[1,2,4,8]")
    simulated = {
        "colocated-TP4": {"goodput_per_gpu": 0.5, "goodput_per_gpu_low": 0.4, "goodput_per_gpu_high": 0.6},
        "colocated-TP8": {"goodput_per_gpu": 0.3, "goodput_per_gpu_low": 0.2, "goodput_per_gpu_high": 0.4},
    }
    out = placement_search(cfg, [1, 2, 4, 8], simulated, {"label": "colocated-TP4", "separated": True})
    assert (out["best"], out["goodput_per_gpu_low"], out["goodput_per_gpu_high"], out["separated"]) == (
        "colocated-TP4",
        0.4,
        0.6,
        True,
    )
    assert len(out["pruned"]) == 24 and out["searched"] == list(simulated)


# -- the phenomena ------------------------------------------------------------------------------
def colocated_run(tp: int, *workload: str) -> dict:
    """One colocated worker of TP `tp` on an analytical H100, Llama-3-70B, host time 0 (what does not
    split is then the all-reduce alone)."""
    cfg = sim_config(
        "model=llama3_70b",
        "model.max_model_len=12288",  # an 8K prompt, and TP2 still holds one sequence
        "mode=colocated",
        f"cluster.tp={tp}",
        "cluster.num_workers=1",
        f"hardware.num_devices={tp}",
        "engine.host_overhead_s=0",
        *workload,
    )
    return simulate(cfg.serving, cfg.sim)["summary"]


def test_decode_tpot_falls_with_tp_while_per_gpu_throughput_falls():
    small_batch = ["workload.num_requests=4", "workload.rate=1e6", *fixed("workload.input_len", 128)]
    runs = {tp: colocated_run(tp, *small_batch, *fixed("workload.output_len", 64)) for tp in (2, 4, 8)}
    tpot = {tp: s["tpot"]["p50"] for tp, s in runs.items()}
    per_gpu = {tp: 4 / tpot[tp] / tp for tp in tpot}  # tokens/s per GPU at the batch of 4
    assert tpot[2] > tpot[4] > tpot[8], tpot  # fewer weights per device to read each step
    assert per_gpu[2] > per_gpu[4] > per_gpu[8], per_gpu  # the all-reduces do not shrink with TP
    assert per_gpu[8] < 0.9 * per_gpu[2], per_gpu  # a free all-reduce would keep it level
    assert tpot[2] / tpot[8] < 4  # sublinear


def test_a_long_prefill_shortens_with_tp():
    long_prompt = ["workload.num_requests=1", *fixed("workload.input_len", 8192), *fixed("workload.output_len", 2)]
    ttft = {tp: colocated_run(tp, *long_prompt, "scheduler.max_batched_tokens=8192")["ttft"]["p50"] for tp in (2, 4, 8)}
    assert ttft[2] > ttft[4] > ttft[8], ttft  # compute-bound: the FLOPs split
    # but each layer's two all-reduces of 8192 x 8192 x 2 bytes do not: 2.7 with them, 3.5 were they free
    assert 2 < ttft[2] / ttft[8] < 3.2, ttft


RATIO_70B = [
    "+experiment=ratio_sweep",
    "executor=sim",
    "model=llama3_70b",
    "hardware.num_devices=8",
    "sim.profile=h100_sxm",
]


def placement_of(point) -> placements.Placement:
    o = point.overrides
    if o["mode"] == "disagg":
        return placements.Placement(
            "disagg", o["cluster.num_prefill"], o["cluster.prefill_tp"], o["cluster.num_decode"], o["cluster.decode_tp"]
        )
    return placements.Placement(o["mode"], o["cluster.num_workers"], o["cluster.tp"])


def test_ratio_sweep_of_a_model_one_device_cannot_hold_runs_the_smallest_tp_degrees_that_fit(caplog):
    """The issue's command: Llama-3-70B on 8 simulated H100s takes TP4 (the smallest degree that
    holds its weights and one 32K sequence within 0.85 of 80 GB) and TP8, said in one log line;
    every point is a placement of all 8 devices that fits memory."""
    cfg = compose_sized(RATIO_70B)
    assert cfg.size == "gpu" and cfg.experiment.own.get("tp_degrees", [1]) == [1]
    with caplog.at_level("INFO", logger="testbed"):
        points = ratio_sweep.points(cfg)
    (line,) = [r.getMessage() for r in caplog.records if "experiment.own.tp_degrees=[4, 8]" in r.getMessage()]
    assert "141.1 GB of weights" in line and "TP4 is the smallest degree" in line
    labels = {p.knobs["label"] for p in points}
    assert labels == {"colocated-TP4", "colocated-TP8", "1xTP4P-1xTP4D", "chunked-TP4", "chunked-TP8"}
    assert len(points) == len(labels) * len(cfg.experiment.rates)
    for point in points:
        p = placement_of(point)
        assert placements.pruned(cfg, p) is None, point.name
        assert min(t for _, t in p.degrees()) >= 4 and p.label == point.knobs["label"]
        assert p.workers * p.tp + p.decode * p.decode_tp == 8 if p.mode == "disagg" else p.workers * p.tp == 8
        assert set(p.knobs.items()) <= set(point.knobs.items())


def test_ratio_sweep_of_a_model_that_fits_one_device_is_as_before():
    cfg = compose_sized([*RATIO_70B, "model=llama3_8b"])
    assert placements.fitting_degrees(cfg, 8) == ([1], None)
    configs = layouts.layouts(cfg, ["colocated", "chunked"]) + layouts.layouts(cfg, ["disagg"], all_splits=True)
    points = ratio_sweep.points(cfg)
    assert [(p.knobs["label"], p.overrides) for p in points] == [
        (label, {**o, "workload.rate": r}) for label, o in configs for r in cfg.experiment.rates
    ]
    assert not any("tp" in key for p in points for key in p.overrides)


def test_ratio_sweep_over_tp_degrees_takes_the_placement_search():
    cfg = compose_sized([*RATIO_70B, "experiment.own.tp_degrees=[4]"])
    labels = {p.knobs["label"] for p in ratio_sweep.points(cfg)}
    assert labels == {"colocated-TP4", "1xTP4P-1xTP4D", "chunked-TP4"}
