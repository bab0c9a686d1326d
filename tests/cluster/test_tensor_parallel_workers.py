"""Real tensor-parallel workers (testbed/cluster/tensor_group.py, follower.py): a worker of degree tp
is tp processes over gloo whose leader speaks for the group. Every (prefill TP, decode TP) pair in
{1, 2, 4} x {1, 2, 4} takes one unsharded engine's greedy tokens (colocated TP1: `LLM`), the KV
moves between groups of different degrees with each byte once (each process's bytes on the wire,
measured, against the KV of every request handed off), and no process keeps a block or a staging
buffer; the mixed modes run at TP2 too."""

from __future__ import annotations

import pytest
import torch

from testbed import LLM
from testbed.cluster.emulation import Emulation, emulation_meta, role_pacers
from testbed.errors import ConfigError
from testbed.metrics.record import StepRecord
from testbed.model.config import PRESETS, preset
from testbed.perf.resolve import analytical
from testbed.studies import placements, ratio_sweep
from testbed.studies.real_cluster import serve
from testbed.workload import build_workload
from tests.cluster_helpers import make_config

pytestmark = pytest.mark.slow

# 4 query heads over 2 KV heads: at TP4 each KV head lives on two ranks (replicated, as vLLM does)
WORKLOAD = [
    "model=tiny",
    "workload.num_requests=6",
    "workload.rate=40",
    "workload.input_len.min=20",
    "workload.input_len.max=90",
    "workload.output_len.min=4",
    "workload.output_len.max=10",
    "hardware=cpu",
    "model.max_model_len=256",
    "engine.num_kv_blocks=128",
    "kv_transfer.piece_kib=4",  # several pieces per share
]
PAIRS = [(a, b) for a in (1, 2, 4) for b in (1, 2, 4)]


@pytest.fixture(scope="module")
def reference_tokens():
    cfg = make_config(*WORKLOAD)
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=512, max_model_len=256)
    llm = LLM("tiny", max_model_len=256, num_kv_blocks=128)
    outputs = llm.generate(
        [list(r.prompt_token_ids) for r in workload.requests], [r.output_len for r in workload.requests]
    )
    return {r.request_id: out for r, out in zip(workload.requests, outputs)}


def run(tmp_path, overrides):
    result = serve(make_config(*WORKLOAD, *overrides), tmp_path, progress=False)
    requests = result["requests"].set_index("request_id")
    assert (requests.status == "ok").all(), requests.reason.unique()
    summary = result["summary"]
    assert not any(summary["kv_blocks_leaked"].values()), summary["kv_blocks_leaked"]
    assert not any(b["count"] for b in summary["staging_buffers_leaked"].values())
    return result, requests


def tokens_of(requests) -> dict:
    return {rid: list(row.output_token_ids) for rid, row in requests.iterrows()}


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"P{a}-D{b}" for a, b in PAIRS])
def test_a_prefill_group_of_tp_a_hands_its_kv_to_a_decode_group_of_tp_b(a, b, tmp_path, reference_tokens):
    result, requests = run(
        tmp_path,
        ["mode=disagg", f"cluster.prefill_tp={a}", f"cluster.decode_tp={b}", f"hardware.num_devices={a + b}"],
    )
    assert tokens_of(requests) == reference_tokens
    summary, transfers = result["summary"], result["transfers"]
    wire = summary["kv_wire_bytes"]
    assert len(wire) == a + b  # every process audited
    args = preset("tiny")
    kv_bytes = args.kv_bytes_per_token * 4  # one token's KV, every head once, in float32
    # each decode rank's heads once: the model's KV once, twice at TP4 (each head on two ranks)
    copies = b * args.kv_heads_per_rank(b) // args.num_kv_heads
    handed_off = sum(int(n) * kv_bytes * copies for n in requests.loc[transfers.request_id, "input_len"])
    sent = sum(w["sent"] for w in wire.values())
    received = sum(w["received"] for w in wire.values())
    assert sent == received == handed_off == transfers.kv_bytes.sum()  # measured on every process
    if a == b == 4:  # no rank sends every copy of a replicated head: rank 1 and 3 hold copies
        assert all(w["sent"] for w in list(wire.values())[:1] + list(wire.values())[2:5])


@pytest.mark.parametrize("a, b", [(2, 1), (1, 2), (2, 4)], ids=["P2-D1", "P1-D2", "P2-D4"])
def test_over_ipc_each_prefill_rank_writes_its_heads_into_the_decode_ranks_pools(a, b, tmp_path, reference_tokens):
    """kv_transfer.backend=ipc on one box: every rank maps the decode pools it writes into and
    copies its heads straight into the reserved blocks; the leader's KVDone waits for every rank."""
    result, requests = run(
        tmp_path,
        [
            "mode=disagg",
            f"cluster.prefill_tp={a}",
            f"cluster.decode_tp={b}",
            f"hardware.num_devices={a + b}",
            "kv_transfer.backend=ipc",
        ],
    )
    assert tokens_of(requests) == reference_tokens
    wire = result["summary"]["kv_wire_bytes"]
    assert sum(w["sent"] for w in wire.values()) == result["transfers"].kv_bytes.sum() > 0


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_a_mixed_worker_at_tp2_takes_the_same_tokens(mode, tmp_path, reference_tokens):
    _, requests = run(tmp_path, [f"mode={mode}", "cluster.num_workers=1", "cluster.tp=2", "hardware.num_devices=2"])
    assert tokens_of(requests) == reference_tokens


def test_dropped_kv_is_resent_by_every_rank_without_a_leak(tmp_path, reference_tokens):
    """A dropped attempt sends nothing from any rank; the retry resends every share."""
    result, requests = run(
        tmp_path,
        [
            "mode=disagg",
            "cluster.prefill_tp=2",
            "cluster.decode_tp=2",
            "hardware.num_devices=4",
            "faults.drop_kv_probability=0.3",
            "kv_transfer.on_failure=retry",
            "kv_transfer.max_retries=3",
            "kv_transfer.timeout_s=1",
        ],
    )
    assert tokens_of(requests) == reference_tokens
    assert (result["transfers"].groupby("request_id").attempt.max() > 1).any()


def step_record(decodes: int, context: int) -> StepRecord:
    return StepRecord(0.0, 0.001, "chunked", 0, decodes, decodes, 0, 0, decodes, 0, 0, 0, 0, 0, (), context)


# -- emulated tensor-parallel groups (hardware.emulate) -----------------------------------------
def test_an_emulated_tp_group_is_paced_by_the_simulators_tp_roofline():
    """A rank of TP2 paces its steps by the roofline split over two devices plus its all-reduces
    (the simulator's RooflineModel at tp=2), and a hand-off by the busiest rank's share of the KV."""
    cfg = make_config("hardware.emulate=h100_sxm", "hardware.emulate_model=llama3_8b")
    emulation = Emulation.from_hardware(cfg.hardware)
    tiny_kv = PRESETS["tiny"].kv_bytes_per_token * 4
    one, link1 = role_pacers(emulation, "prefill_only", cfg.model, tiny_kv)
    two, link2 = role_pacers(emulation, "prefill_only", cfg.model, tiny_kv, tp=2, decode_tp=2)
    roofline, _ = analytical("h100_sxm", PRESETS["llama3_8b"], 2, tp=2, **dict(emulation.host))
    shape = step_record(decodes=8, context=8 * 512)
    assert two.modelled_s(shape) == roofline.step_time(0, 0.0, 8, 8 * 512)
    assert two.modelled_s(shape) < one.modelled_s(shape)  # an 8B decode step reads half the weights per rank
    # tiny's 2 KV heads over TP2 -> TP2: each rank one head, so each link carries half the real bytes
    assert link2.bytes_scale == pytest.approx(link1.bytes_scale / 2)
    assert emulation_meta(emulation, cfg.model, True, make_config("cluster.decode_tp=2").cluster)["decode"]["tp"] == 2


def test_a_measured_profile_cannot_pace_a_tp_group(tmp_path):
    with pytest.raises(ConfigError, match="measured profile of one device; a tensor-parallel worker"):
        role_pacers(Emulation("p.json", "p.json", "p.json"), "chunked", make_config().model, 1, tp=2)


def test_an_emulated_tp2_run_records_the_tp_rooflines_step_times(tmp_path, reference_tokens):
    result, requests = run(
        tmp_path,
        [
            "mode=colocated",
            "cluster.num_workers=1",
            "cluster.tp=2",
            "hardware.num_devices=2",
            "hardware.emulate=h100_sxm",
            "hardware.emulate_model=llama3_8b",
        ],
    )
    assert tokens_of(requests) == reference_tokens
    steps = result["steps"]
    emulation = Emulation.from_hardware(make_config("hardware.emulate=h100_sxm").hardware)
    roofline, _ = analytical("h100_sxm", PRESETS["llama3_8b"], 2, tp=2, **dict(emulation.host))
    decodes = steps[steps.prefill_tokens == 0]
    shapes = zip(decodes.decode_seqs, decodes.decode_context)
    expected = [roofline.step_time(0, 0.0, int(n), float(c)) for n, c in shapes]
    assert decodes.modelled_s.tolist() == pytest.approx(expected)
    assert result["summary"]["emulated"]["decode"]["tp"] == 2  # a mixed worker: both phases


# -- the main job's placements on a GPU box ------------------------------------------------------
def test_the_main_job_on_a_gpu_box_runs_tp_placements_of_a_model_one_gpu_cannot_hold(monkeypatch):
    """Real workers on 8 H100s (the visible GPU's table entry, stood in for here): Llama-3-70B fits
    no single device, so ratio_sweep runs the placements at the smallest degrees that hold it."""
    monkeypatch.setattr(placements, "real_device", lambda cfg, kind: "h100_sxm")
    cfg = make_config("+experiment=ratio_sweep", "model=llama3_70b", "hardware.num_devices=8", "size=gpu")
    points = ratio_sweep.points(cfg)
    assert cfg.executor == "real" and points
    labels = {p.knobs["label"] for p in points}
    assert labels == {"colocated-TP4", "colocated-TP8", "1xTP4P-1xTP4D", "chunked-TP4", "chunked-TP8"}
    assert all(max(v for k, v in p.overrides.items() if k.endswith("tp")) >= 4 for p in points)
    monkeypatch.setattr(placements, "real_device", lambda cfg, kind: None)  # CPU workers: TP1, as always
    cpu = make_config("+experiment=ratio_sweep", "hardware.num_devices=3")
    assert placements.fitting_degrees(cpu, 3) == ([1], None)


def test_a_rank_whose_share_broke_says_no_and_retires_it(monkeypatch):
    """The leader's pieces may all arrive while a rank's, from a prefill rank that died mid-send, do
    not: that rank votes no (the leader then fails the attempt on every rank) and returns its
    buffers once they settle, instead of installing KV that is not there."""
    from testbed.cluster import follower as module
    from testbed.cluster.completion import BufferPool, Handle
    from testbed.cluster.kv_wire import Retired, WirePart

    votes = []
    monkeypatch.setattr(module, "agreed", lambda yes, group, device: votes.append(yes) or yes)
    rank = object.__new__(module.Follower)
    rank.engine = type("E", (), {"runner": type("R", (), {"device": "cpu"})()})()
    rank.group, rank.buffers = None, BufferPool("cpu", torch.float32)
    rank.retired = Retired(rank.buffers)
    buffer = rank.buffers.get((2, 4, 1, 16))
    wire = WirePart(buffer, [(0, 4)], [buffer], [Handle.failed("connection reset by peer")])
    rank.incoming = {7: (1, [(None, 0, (0,), wire)])}
    rank.confirm(7)
    assert votes == [False] and 7 not in rank.incoming
    assert not rank.retired.parts and not rank.buffers.loaned  # settled (failed): returned at once
