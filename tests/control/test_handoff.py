"""The KV hand-off as connectors do it (testbed/control/handoff.py): send, pull, push_layerwise,
their links, and the same rule in the simulator and the emulated cluster's link pacer.

Hand-worked numbers use one shape throughout: Llama-3-8B's KV in bfloat16 is 2 (K, V) x 8 KV
heads x 128 dims x 2 bytes x 32 layers = 131,072 bytes a token, so a 5,000-token prompt is
655,360,000 bytes; the link is 10 us + bytes / 10 GB/s."""

import pytest

from testbed.cluster.emulation import Emulation, role_pacers
from testbed.cluster.pacing import LinkPacer
from testbed.control.config import KVTransferConfig
from testbed.control.handoff import NETWORKS, HandoffRule, layerwise_end
from testbed.errors import ConfigError
from testbed.perf.measured import STEP_TERMS, CostModel
from testbed.sim.executor import simulate
from testbed.studies.real_cluster import serve
from tests.cluster.test_emulate import write_profile
from tests.cluster_helpers import make_config, sim_args, small_workload

TOKENS, LAYERS, NBYTES = 5000, 32, 5000 * 131072
COST = 3.5e-6  # kv_transfer.descriptor_cost_s's default


def link(nbytes: float) -> float:
    return 10e-6 + nbytes / 10e9


def rule(mechanism: str, block_size: int = 16, path: float = 0.0) -> HandoffRule:
    return HandoffRule(mechanism, COST, path, LAYERS, block_size)


def test_send_is_the_link_alone():
    # 10 us + 655,360,000 / 1e10 = 0.00001 + 0.065536
    leg = rule("send").leg(link, NBYTES, TOKENS)
    assert (leg.start, leg.end, leg.ready) == pytest.approx((0.0, 0.065546, 0.065546))


def test_pull_pays_every_block_descriptor():
    # 16-token blocks: ceil(5000 / 16) = 313 blocks x 32 layers x 2 (K, V) = 20,032 descriptors,
    # x 3.5 us = 0.070112 s on top of the link's 0.065546
    assert rule("pull").descriptors(TOKENS) == 20032
    assert rule("pull").leg(link, NBYTES, TOKENS).end == pytest.approx(0.065546 + 0.070112)


def test_pull_cost_grows_with_descriptors_at_fixed_bytes():
    # 128-token blocks: ceil(5000 / 128) = 40 x 32 x 2 = 2,560 descriptors, 0.00896 s: the same
    # bytes in an eighth of the pieces
    small, large = rule("pull", 16), rule("pull", 128)
    assert large.descriptors(TOKENS) == 2560
    assert large.leg(link, NBYTES, TOKENS).end == pytest.approx(0.065546 + 0.00896)
    assert small.leg(link, NBYTES, TOKENS).end - large.leg(link, NBYTES, TOKENS).end == pytest.approx(0.061152)


def test_push_overlapped_with_a_long_prefill_exposes_only_the_last_layer():
    # one layer's send: 10 us + 0.065536 / 32 + 0.070112 / 32 = 0.00001 + 0.002048 + 0.002191
    # = 0.004249 s; a 0.384 s prefill makes a layer every 0.012 s, longer than a send: the link
    # keeps up and only the last layer's send is left after the prefill
    push = rule("push_layerwise")
    assert push.layer_send_s(link, NBYTES, TOKENS) == pytest.approx(0.004249)
    leg = push.leg(link, NBYTES, TOKENS, prefill_s=0.384, link_from_s=-1.0)
    assert leg.end == pytest.approx(0.004249)
    assert leg.start == pytest.approx(-0.384 + 0.012)  # layer 0 went as soon as it was ready


def test_push_exposes_what_the_overlap_cannot_hide():
    # a 0.032 s prefill makes a layer every 0.001 s, faster than a 0.004249 s send: the sends
    # queue from layer 0 (ready at -0.031) and the last lands at 32 x 0.004249 - 31 x 0.001
    leg = rule("push_layerwise").leg(link, NBYTES, TOKENS, prefill_s=0.032, link_from_s=-1.0)
    assert leg.end == pytest.approx(0.135968 - 0.031)
    # a link busy until 0.05 s after the prefill: all 32 sends after it
    assert layerwise_end(0.384, 32, 0.004249, 0.05) == pytest.approx(0.05 + 0.135968)


def test_the_first_token_path_follows_the_kv():
    leg = rule("pull", path=0.2).leg(link, NBYTES, TOKENS)
    assert leg.ready - leg.end == pytest.approx(0.2)


@pytest.mark.parametrize(
    "key, value, allowed",
    [("mechanism", "rdma_pull", "send, pull, push_layerwise"), ("link", "infiniband", "auto, nvlink, rdma, tcp")],
)
def test_an_unknown_mechanism_or_link_is_one_line(key, value, allowed):
    with pytest.raises(ConfigError, match=f"kv_transfer.{key}='{value}' is not one of {allowed}$"):
        KVTransferConfig(**{key: value}).validate()


def test_a_network_rate_without_a_network_is_refused():
    with pytest.raises(ConfigError, match="kv_transfer.link=auto has none"):
        KVTransferConfig(link_gbps=20.0).validate()
    with pytest.raises(ConfigError, match="descriptor_cost_s must be >= 0"):
        KVTransferConfig(descriptor_cost_s=-1.0).validate()
    assert KVTransferConfig(link="tcp", link_gbps=3.0).network == (3.0, NETWORKS["tcp"][1])


# the simulator ---------------------------------------------------------------------------------
ONE_LONG_PROMPT = [
    "executor=sim",
    "sim.profile=a100_80g",
    "model=llama3_8b",
    "mode=disagg",
    "hardware=cpu",
    "hardware.num_devices=2",
    "workload.num_requests=1",
    "workload.rate=1",
    f"workload.input_len.min={TOKENS}",
    f"workload.input_len.max={TOKENS}",
    "workload.output_len.min=4",
    "workload.output_len.max=4",
    "scheduler.max_batched_tokens=8192",
    "kv_transfer.decode_binding=early",  # a push needs its D before the prefill ends
]


def one_request(*overrides: str) -> dict:
    """The request's row, its transfer's row and the TTFT a client behind a disaggregating proxy
    sees (the decode worker's first token: the second here, after the KV)."""
    run = simulate(*sim_args(make_config(*ONE_LONG_PROMPT, *overrides)))
    row, kv = run["requests"].iloc[0], run["transfers"].iloc[0]
    return {"row": row, "kv": kv, "ttft_d": list(row.token_times)[1] - row.arrival_s}


def test_each_mechanism_moves_the_decode_side_ttft_with_the_right_sign():
    send, pull16 = one_request(), one_request("kv_transfer.mechanism=pull")
    pull128 = one_request("kv_transfer.mechanism=pull", "engine.block_size=128")
    push = one_request("kv_transfer.mechanism=push_layerwise")
    path = one_request("kv_transfer.mechanism=pull", "kv_transfer.first_token_path_s=0.2")
    assert push["ttft_d"] < send["ttft_d"] < pull128["ttft_d"] < pull16["ttft_d"]
    # the same prefill, the same decode step: a pull is later by exactly its descriptors (20,032 x 3.5 us)
    assert pull16["ttft_d"] - send["ttft_d"] == pytest.approx(20032 * COST, rel=1e-6)
    assert path["ttft_d"] - pull16["ttft_d"] == pytest.approx(0.2, rel=1e-6)
    assert path["kv"].end_s - path["kv"].send_end_s == pytest.approx(0.2)  # P's link was free before
    # P's own first token does not move; the push's transfer row spans the prefill it overlapped
    assert {r["row"].ttft for r in (send, pull16, push, path)} == {send["row"].ttft}
    assert push["kv"].start_s < push["row"].prefill_end_s < push["kv"].end_s


def test_a_cross_node_plan_pays_the_named_network():
    rdma = one_request("kv_transfer.link=rdma")["kv"]
    gbps, latency = NETWORKS["rdma"]
    assert rdma.end_s - rdma.start_s == pytest.approx(latency + rdma.kv_bytes / (gbps * 1e9), rel=1e-9)
    with pytest.raises(ConfigError, match="kv_transfer.link=nvlink: P and D sit on different nodes"):
        one_request("kv_transfer.link=nvlink", "hardware.num_nodes=2")


# the emulated cluster: the same rule on P's paced link ----------------------------------------
def paced_link(mechanism: str, path: float = 0.0, network=None) -> LinkPacer:
    """P's link at 10 us + bytes / 10 GB/s (a fitted profile's two terms, nothing else)."""
    model = CostModel(**dict.fromkeys(STEP_TERMS, 0.0), transfer_latency_s=10e-6, transfer_bytes_per_s=10e9)
    return LinkPacer(model, rule=rule(mechanism, path=path), network=network)


def test_the_emulated_pull_is_held_for_its_descriptors_and_the_first_token_path():
    link = paced_link("pull", path=0.2)
    assert not link.arrived(1, 10.0, NBYTES, now=10.0, tokens=TOKENS)
    due = 10.0 + 0.065546 + 0.070112 + 0.2  # link, 20,032 descriptors, D's path (the link frees before it)
    assert link.next_due(10.0) == pytest.approx(due)
    assert link.free_at == pytest.approx(due - 0.2)
    assert not link.arrived(1, 10.0, NBYTES, now=due - 1e-6, tokens=TOKENS)
    assert link.arrived(1, 10.0, NBYTES, now=due, tokens=TOKENS)


def test_the_emulated_push_overlaps_its_paced_prefill():
    # D ready before the prefill, a 0.384 s paced prefill ending at 10.0: one layer's send after it
    link = paced_link("push_layerwise")
    link.prefilled(1, 0.384)
    assert not link.arrived(1, 10.0, NBYTES, now=10.0, tokens=TOKENS, handoff_t=10.0, ready_t=9.5)
    assert link.next_due(10.0) == pytest.approx(10.0 + 0.004249)


def test_the_emulated_link_crosses_a_named_network():
    link = paced_link("send", network=(2.0, 0.001))  # 2 GB/s, 1 ms
    assert link.modelled_s(10**6) == pytest.approx(0.001 + 1e6 / 2e9)


def test_role_pacers_build_the_rule_from_kv_transfer():
    cfg = make_config("hardware.emulate=a100_80g", "hardware.emulate_model=llama3_8b", "kv_transfer.mechanism=pull")
    real_kv = cfg.model.args().kv_bytes_per_token * 4
    emulation = Emulation.from_hardware(cfg.hardware)
    _, link = role_pacers(emulation, "prefill_only", cfg.model, real_kv, kv=cfg.kv_transfer, block_size=16)
    assert link.rule.mechanism == "pull" and link.rule.layers == 32 and link.rule.block_size == 16


def test_an_emulated_disagg_run_holds_each_pull_for_its_descriptors_and_path(tmp_path):
    """Real workers paced to a profile whose link is 30 ms + bytes / 20 MB/s: each pull of a prompt
    of n tokens (the tiny model: 2 layers, 16-token blocks) ends no sooner than that link time +
    2 x ceil(n / 16) x 2 descriptors x 1 ms + D's 50 ms path after it began."""
    profile = write_profile(tmp_path / "p.json", overhead_s=0.01, transfer_latency_s=0.03, transfer_bytes_per_s=2e7)
    cfg = make_config(
        *small_workload(4, rate=20.0),
        "mode=disagg",
        f"hardware.emulate={profile}",
        "kv_transfer.mechanism=pull",
        "kv_transfer.descriptor_cost_s=0.001",
        "kv_transfer.first_token_path_s=0.05",
    )
    result = serve(cfg, tmp_path / "run", progress=False)
    requests = result["requests"].set_index("request_id")
    assert (requests.status == "ok").all(), requests.reason.unique()
    kv = result["transfers"].join(requests["input_len"], on="request_id")
    layers = cfg.model.args().num_layers
    descriptors = layers * -(-kv.input_len // cfg.engine.block_size) * 2
    floor = 0.03 + kv.kv_bytes / 2e7 + descriptors * 0.001 + 0.05
    assert len(kv) and ((kv.end_s - kv.start_s) >= floor - 1e-6).all()
