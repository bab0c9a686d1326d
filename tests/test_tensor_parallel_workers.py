"""Real tensor-parallel workers (testbed/cluster/tensor_group.py, follower.py): a worker of degree tp
is tp processes over gloo whose leader speaks for the group. Every (prefill TP, decode TP) pair in
{1, 2, 4} x {1, 2, 4} takes one unsharded engine's greedy tokens (colocated TP1: `LLM`), the KV
moves between groups of different degrees with each byte once (each process's bytes on the wire,
measured, against the KV of every request handed off), and no process keeps a block or a staging
buffer; the mixed modes run at TP2 too."""

from __future__ import annotations

import pytest

from testbed import LLM
from testbed.model.config import preset
from testbed.studies.real_point import serve
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
