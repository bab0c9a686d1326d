"""KV-aware routing: the engine's prefix-cache hashes, the router's index of them, the dispatch
rule, and runs that use them (simulated, and real with identical greedy tokens)."""

from __future__ import annotations

import pytest

from testbed.control.book import RequestBook
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.control.dispatch import Dispatcher, WorkerLoad
from testbed.control.kv_index import KVIndex
from testbed.control.request import WorkerStep
from testbed.engine import BlockManager, Sequence
from testbed.engine.prefix import cacheable_blocks, prompt_hashes
from testbed.engine.scheduler import StepReport
from testbed.errors import ConfigError
from testbed.metrics.events import RequestLog
from testbed.workload import Request
from tests.cluster_helpers import make_config, sim_args

BS = 4


def request(rid: int, tokens, output_len: int = 3) -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt_token_ids=tuple(tokens), output_len=output_len)


def prefill(bm: BlockManager, rid: int, tokens) -> Sequence:
    """A prompt run through a prefill: blocks allocated, KV computed, full blocks registered."""
    seq = Sequence(rid, list(tokens), 4)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


# -- the engine's hashes, as the router computes them ------------------------------------------------
def test_the_router_names_blocks_as_the_engine_registers_them():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    bm.track_changes()
    tokens = list(range(1, 15))  # 14 tokens: three full blocks, the last one partial
    seq = prefill(bm, 0, tokens)
    stored, removed = bm.drain_changes()
    assert stored == prompt_hashes(tokens, BS) + [] and removed == []
    assert cacheable_blocks(len(tokens), BS) == 3
    assert bm.drain_changes() == ([], [])  # drained
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3  # kept for hits, not leaked


def test_evictions_are_reported_and_changes_come_out_disjoint():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    bm.track_changes()
    first = prefill(bm, 0, range(1, 10))  # two full blocks registered (and a third, partial)
    bm.free(first)
    hashes = prompt_hashes(list(range(1, 10)), BS)
    second = Sequence(1, list(range(50, 63)), 4)  # 13 tokens, 4 blocks: the whole pool
    bm.allocate(second, second.num_tokens)
    stored, removed = bm.drain_changes()
    assert set(hashes) <= set(removed) and not set(stored) & set(removed)
    assert bm.num_cached_blocks == 0


def test_an_untracked_manager_keeps_no_changes():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    prefill(bm, 0, range(1, 10))
    assert bm.changes is None and bm.drain_changes() == ([], [])


def test_received_kv_goes_into_fresh_blocks_and_is_registered_once_installed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    cached = prefill(bm, 0, range(1, 10))
    incoming = Sequence(1, list(range(1, 10)), 4)  # the same prompt, its KV received from P
    bm.allocate_fresh(incoming, incoming.num_tokens + 1)
    assert not set(incoming.block_table) & set(cached.block_table)  # never written into shared blocks
    incoming.num_computed_tokens = incoming.num_tokens
    bm.commit(incoming)  # duplicates of cached blocks are not registered twice
    bm.check_invariants([cached, incoming])


def test_an_incremental_reservation_shares_the_cached_prefix_and_expects_only_the_rest():
    from testbed.engine.config import SchedulerConfig
    from testbed.engine.policies import make_policy
    from testbed.engine.scheduler import Scheduler

    bm = BlockManager(16, BS, enable_prefix_caching=True)
    cached = prefill(bm, 0, range(1, 10))  # blocks [1..4], [5..8] registered
    held = list(cached.block_table)
    bm.free(cached)
    d = Scheduler(make_policy("decode_only"), bm, SchedulerConfig())
    session = Sequence(1, list(range(1, 10)) + [20, 21, 22, 23, 24], 4)  # the history, then 5 new tokens
    assert d.reserve(session, share_prefix=True)
    assert session.num_cached_tokens == 2 * BS and session.block_table[:2] == held[:2]
    whole = Sequence(2, list(range(1, 10)), 4)
    assert d.reserve(whole) and whole.num_cached_tokens == 0 and not set(whole.block_table) & set(session.block_table)
    d.install(1, first_token=7)
    bm.check_invariants([session, whole])
    assert session.num_computed_tokens == session.num_prompt_tokens


# -- the index and the dispatch rule ------------------------------------------------------------------
def test_the_index_applies_evictions_then_registrations():
    index = KVIndex(BS, [0, 1])
    index.update(0, [11, 12, 13], [])
    index.update(0, [14], [12])
    assert index.cached_tokens(0, [11, 12, 13]) == BS  # the run stops at the first block not held
    assert index.cached_tokens(0, [11]) == BS and index.cached_tokens(1, [11]) == 0
    index.forget(0)
    assert index.blocks(0) == 0


def kv_aware(workers, for_decode=False, weight=1.0):
    loads = {w: WorkerLoad() for w in workers}
    index = KVIndex(BS, workers)
    return Dispatcher("kv_aware", list(workers), loads, for_decode=for_decode, index=index, load_weight=weight)


def test_kv_aware_picks_the_worker_holding_the_prefix_unless_its_load_outweighs_it():
    d = kv_aware([0, 1])
    prompt = list(range(1, 22))  # 5 cacheable blocks: 20 tokens
    d.index.update(1, prompt_hashes(prompt, BS), [])
    assert d.pick(request(0, prompt)) == 1
    d.loads[1].queued_prompt_tokens = 19  # 20 cached - 19 queued > 0 - 0
    assert d.pick(request(0, prompt)) == 1
    d.loads[1].queued_prompt_tokens = 21
    assert d.pick(request(0, prompt)) == 0
    d.loads[1].queued_prompt_tokens = 0
    assert d.pick(request(1, range(100, 121))) == 0  # nothing cached anywhere: the least loaded, then rank


def test_kv_aware_decode_dispatch_weighs_the_prompt_tokens_bound_to_each_worker():
    d = kv_aware([2, 3], for_decode=True, weight=0.5)
    prompt = list(range(1, 22))
    d.index.update(3, prompt_hashes(prompt, BS)[:2], [])  # 8 tokens cached on worker 3
    assert d.bind(request(0, prompt)) == 3
    assert (d.loads[3].bound_sequences, d.loads[3].bound_tokens) == (1, 21)
    assert d.bind(request(1, prompt)) == 2  # 8 - 0.5 x 21 < 0


def test_the_book_keeps_the_index_from_reports_and_forgets_a_lost_worker():
    roles = {0: "prefill_only", 1: "prefill_only", 2: "decode_only"}
    cluster = ClusterConfig(dispatch="kv_aware", decode_dispatch="kv_aware")
    b = RequestBook(cluster, KVTransferConfig(), True, roles, RequestLog(0.0), block_size=BS)
    prompt = list(range(1, 22))
    b.cache_report(1, prompt_hashes(prompt, BS), [])
    assert b.admit(request(0, prompt), 0.0).worker == 1
    b.lose_worker(1)
    assert b.index.blocks(1) == 0
    plain = RequestBook(ClusterConfig(), KVTransferConfig(), True, roles, RequestLog(0.0))
    assert plain.index is None
    plain.cache_report(0, [1], [])  # no index kept: nothing to do


def test_kv_aware_turns_prefix_caching_on_and_bad_settings_are_refused():
    cfg = make_config("cluster.dispatch=kv_aware")
    assert cfg.engine.enable_prefix_caching
    assert not make_config().engine.enable_prefix_caching
    with pytest.raises(ConfigError, match="kv_aware"):
        ClusterConfig(dispatch="cache").validate()
    with pytest.raises(ConfigError, match="kv_aware_load_weight"):
        ClusterConfig(kv_aware_load_weight=-1).validate()


# -- prefill on the decode worker: PPD and conditional disaggregation --------------------------------
def test_when_a_decode_worker_prefills_a_request_itself():
    ppd = KVTransferConfig(multiturn="ppd", ppd_max_append_tokens=64)
    assert ppd.prefills_on_decode(turn=1, prompt_tokens=300, cached_tokens=240)  # a 60-token append
    assert not ppd.prefills_on_decode(turn=1, prompt_tokens=400, cached_tokens=240)  # too long an append
    assert not ppd.prefills_on_decode(turn=1, prompt_tokens=50, cached_tokens=0)  # D lost the session's KV
    assert not ppd.prefills_on_decode(turn=0, prompt_tokens=300, cached_tokens=240)  # a first turn goes to P
    conditional = KVTransferConfig(local_prefill_max_tokens=32)
    assert conditional.prefills_on_decode(turn=0, prompt_tokens=32, cached_tokens=0)
    assert conditional.prefills_on_decode(turn=0, prompt_tokens=300, cached_tokens=280)  # its uncached part
    assert not conditional.prefills_on_decode(turn=0, prompt_tokens=33, cached_tokens=0)
    off = KVTransferConfig(multiturn="incremental")  # local_prefill_max_tokens=0: conditional disaggregation off
    assert not off.prefills_on_decode(turn=1, prompt_tokens=300, cached_tokens=300)  # even a fully cached prompt
    assert not KVTransferConfig().follows_caches and ppd.follows_caches and conditional.follows_caches
    with pytest.raises(ConfigError, match="resend, incremental, ppd"):
        KVTransferConfig(multiturn="always").validate()
    with pytest.raises(ConfigError, match="ppd_max_append_tokens"):
        KVTransferConfig(ppd_max_append_tokens=-1).validate()


def test_a_later_turn_goes_to_the_decode_worker_holding_its_session_and_ends_there():
    from tests.control.test_control_book import loads_balanced

    roles = {0: "prefill_only", 1: "decode_only", 2: "decode_only"}
    kv = KVTransferConfig(multiturn="ppd", decode_binding="early")
    b = RequestBook(ClusterConfig(), kv, True, roles, RequestLog(0.0), block_size=BS)
    history = list(range(1, 41))
    b.cache_report(2, prompt_hashes(history, BS), [])
    first = b.admit(request(0, history[:20]), 0.0)  # turn 0: through P, bound early
    assert (first.worker, first.local, first.decode_worker is not None) == (0, False, True)
    later = Request(
        request_id=1, arrival_s=0.0, prompt_token_ids=tuple(history + [7] * 8), output_len=2, session_id=0, turn=1
    )
    tracked = b.admit(later, 0.0)
    assert (tracked.worker, tracked.local, tracked.decode_worker) == (2, True, None)  # no transfer, no binding
    loads_balanced(b)
    b.on_step(WorkerStep(2, 1.0, 1.0, 100, StepReport([(1, 48, True)], [(1, 0, 5)], [], [], [])), 1.0)
    news = b.on_step(WorkerStep(2, 2.0, 2.0, 100, StepReport([(1, 1, False)], [(1, 1, 6)], [1], [], [])), 2.0)
    assert [t.rid for t in news.finished] == [1] and b.loads[2].bound_sequences == 0
    loads_balanced(b)
    table = b.log.table().set_index("request_id")
    assert table.loc[1, "prefilled_on"] == "decode" and table.loc[0, "prefilled_on"] == "prefill"
    assert list(table.loc[1, "output_token_ids"]) == [5, 6]


# -- runs ---------------------------------------------------------------------------------------------
SESSIONS = ["workload=multiturn", "workload.num_requests=16", "hardware=cpu", "engine.enable_prefix_caching=true"]


def _sim(*overrides):
    from testbed.sim.executor import simulate
    from tests.sim.test_sim import PROFILE  # the shipped CPU profile

    return simulate(*sim_args(make_config(*SESSIONS, *overrides)), PROFILE, num_devices=4)


def test_simulated_kv_aware_routing_finds_more_of_each_prompt_cached_than_round_robin():
    chunked = ["mode=chunked", "cluster.num_workers=4"]
    blind = _sim(*chunked, "cluster.dispatch=round_robin")
    aware = _sim(*chunked, "cluster.dispatch=kv_aware")
    hits = {name: r["requests"].prefix_hit_tokens.sum() for name, r in (("blind", blind), ("aware", aware))}
    assert hits["aware"] > hits["blind"] > 0
    rates = [r["summary"]["prefix_cache"]["hit_rate"] for r in (blind, aware)]
    assert rates[1] > rates[0] and aware["summary"]["prefix_cache"]["by_turn"]["0"]["requests"] == 16
    for result in (blind, aware):
        assert (result["requests"].status == "ok").all()
        assert sum(result["summary"]["kv_blocks_leaked"].values()) == 0
        assert sum(result["summary"]["kv_blocks_cached"].values()) > 0
    later = aware["requests"][aware["requests"].turn > 0]
    assert (later.prefix_hit_tokens > 0).mean() > 0.9  # a session's later turns find their history


def test_simulated_disagg_with_kv_aware_decode_dispatch_leaks_nothing():
    result = _sim(
        "mode=disagg",
        "cluster.num_prefill=2",
        "cluster.num_decode=2",
        "cluster.dispatch=kv_aware",
        "cluster.decode_dispatch=kv_aware",
    )
    assert (result["requests"].status == "ok").all()
    assert sum(result["summary"]["kv_blocks_leaked"].values()) == 0
    assert result["summary"]["kv_blocks_cached"]["worker2"] + result["summary"]["kv_blocks_cached"]["worker3"] > 0


def test_simulated_ppd_appends_later_turns_on_the_decode_worker_and_moves_no_kv_for_them():
    disagg = [
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=2",
        "cluster.dispatch=kv_aware",
        "cluster.decode_dispatch=kv_aware",
    ]
    resend = _sim(*disagg)
    ppd = _sim(*disagg, "kv_transfer.multiturn=ppd")
    assert set(resend["requests"].prefilled_on) == {"prefill"}
    later = ppd["requests"].turn > 0
    assert (ppd["requests"][later].prefilled_on == "decode").mean() > 0.9
    assert ppd["requests"][ppd["requests"].prefilled_on == "decode"].kv_bytes.isna().all()
    assert ppd["transfers"].kv_bytes.sum() < resend["transfers"].kv_bytes.sum() / 3
    for result in (resend, ppd):
        assert (result["requests"].status == "ok").all()
        assert sum(result["summary"]["kv_blocks_leaked"].values()) == 0
    assert ppd["summary"]["prefix_cache"]["by_turn"]["2"]["kv_bytes_mean"] == 0
    assert "decode_only" in ppd["summary"]["decode_worker_itl"]


def test_simulated_incremental_transfer_moves_only_what_the_decode_worker_lacks():
    disagg = [
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=2",
        "cluster.dispatch=kv_aware",
        "cluster.decode_dispatch=kv_aware",
    ]
    resend = _sim(*disagg)
    incremental = _sim(*disagg, "kv_transfer.multiturn=incremental")
    sent = {
        name: r["requests"].set_index("request_id").kv_bytes
        for name, r in (("resend", resend), ("incremental", incremental))
    }
    assert (sent["incremental"] <= sent["resend"]).all() and sent["incremental"].sum() < sent["resend"].sum() / 2
    assert (incremental["requests"].status == "ok").all()
    assert sum(incremental["summary"]["kv_blocks_leaked"].values()) == 0


@pytest.mark.slow
def test_real_cache_aware_runs_give_the_tokens_of_a_run_without_any_cache(tmp_path):
    from testbed.studies.real_cluster import serve

    small = [
        *SESSIONS[:3],
        "workload.num_requests=4",
        "workload.turns=3",
        "workload.rate=20",  # the sessions start together and think briefly: 1/s and 1 s idled 5 s a run
        "workload.think_time_s=0.2",
        "model.max_model_len=512",
        "engine.num_kv_blocks=256",
    ]
    reference = serve(make_config(*small, "mode=colocated", "cluster.num_workers=1"), tmp_path / "ref", progress=False)
    expected = reference["requests"].set_index("request_id").output_token_ids
    runs = {
        "chunked-2": ["mode=chunked", "cluster.num_workers=2", "cluster.dispatch=kv_aware"],
        "disagg-1P2D": [
            "mode=disagg",
            "cluster.num_prefill=1",
            "cluster.num_decode=2",
            "hardware.num_devices=3",
            "cluster.dispatch=kv_aware",
            "cluster.decode_dispatch=kv_aware",
        ],
        "ppd-1P2D": [
            "mode=disagg",
            "cluster.num_prefill=1",
            "cluster.num_decode=2",
            "hardware.num_devices=3",
            "kv_transfer.multiturn=ppd",
            "kv_transfer.decode_binding=early",
        ],
        "conditional-1P1D": ["mode=disagg", "kv_transfer.local_prefill_max_tokens=160"],
        "incremental-1P2D": [
            "mode=disagg",
            "cluster.num_prefill=1",
            "cluster.num_decode=2",
            "hardware.num_devices=3",
            "cluster.decode_dispatch=kv_aware",
            "kv_transfer.multiturn=incremental",
        ],
        "store-chunked-2": ["mode=chunked", "cluster.num_workers=2", "kv_store.capacity_mib=16"],
        "incremental-1P1D-layer": [
            "mode=disagg",
            "kv_transfer.multiturn=incremental",
            "kv_transfer.granularity=layer",
            "kv_transfer.decode_binding=early",
            "kv_transfer.piece_kib=8",
        ],
    }
    for name, overrides in runs.items():
        result = serve(make_config(*small, *overrides), tmp_path / name, progress=False)
        requests = result["requests"].set_index("request_id")
        assert (requests.status == "ok").all(), name
        assert len(requests) == len(expected) and requests.prefix_hit_tokens.sum() > 0, name
        for rid, tokens in expected.items():
            assert list(requests.loc[rid, "output_token_ids"]) == list(tokens), f"request {rid} in {name}"
        assert all(v == 0 for v in result["summary"]["kv_blocks_leaked"].values()), name
        assert sum(result["summary"]["kv_blocks_cached"].values()) > 0, name
        if name.startswith("store"):  # a worker fetches what the other one computed
            assert sum(w["hits"] for w in result["summary"]["kv_store"].values()) > 0, name
        if name.startswith("incremental"):  # later turns find part of their history on D
            later = result["transfers"].merge(requests.reset_index()[["request_id", "turn", "input_len"]])
            later = later[later.turn > 0]
            partial = later.kv_bytes < later.input_len * 2 * 2 * 2 * 16 * 4  # tiny, float32: bytes per token
            assert partial.all() if name.endswith("1P1D-layer") else partial.any(), name  # one D holds every session
        if name.startswith(("ppd", "conditional")):
            assert (requests.prefilled_on == "decode").any() and (requests.prefilled_on == "prefill").any(), name
