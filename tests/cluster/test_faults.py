"""Faults: dead and stalled workers, lost and late KV, a starved pool, and overload."""

import pytest

from testbed.studies.real_cluster import serve
from tests.cluster_helpers import make_config, small_workload

pytestmark = pytest.mark.slow

LONG = ["workload.output_len.min=60", "workload.output_len.max=90"]  # requests live long enough to be hit


def kinds(summary):
    return [f["kind"] for f in summary["faults"]]


def assert_no_leaks(summary, dead=()):
    """Every process of every surviving worker (a tensor-parallel worker's ranks each) audited: no
    KV block and no staging buffer still held."""
    survivors = {p for w, v in summary["workers"].items() if w not in dead for p in v["processes"]}
    assert summary["kv_blocks_leaked"] == {w: 0 for w in survivors}
    assert summary["staging_buffers_leaked"] == {w: {"count": 0, "bytes": 0} for w in survivors}


TP2 = ["cluster.prefill_tp=2", "cluster.decode_tp=2"]  # every worker two processes (sharded model, KV shares)


@pytest.mark.parametrize("tp", [[], TP2], ids=["tp1", "tp2"])
def test_killed_prefill_worker_requests_are_redispatched(tmp_path, tp):
    cfg = make_config(
        *small_workload(n=24, rate=30),
        *LONG,
        *tp,
        "mode=disagg",
        "cluster.num_prefill=2",
        "cluster.num_decode=1",
        "faults.kill_worker=0",
        "faults.kill_at_s=0.3",
        "cluster.on_worker_failure=redispatch",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    assert (requests.status == "ok").all(), requests.reason.unique()
    assert (requests.output_token_ids.map(len) == requests.output_len).all()
    assert kinds(summary)[0] == "kill_worker"
    assert_no_leaks(summary, dead={"worker0"})


def test_killed_mixed_worker_fails_its_requests(tmp_path):
    # arrivals over 2.4 s, each request decoding 100+ tokens: the victim still holds requests when a
    # loaded router injects the kill a second or more late
    cfg = make_config(
        *small_workload(n=24, rate=10),
        "workload.output_len.min=100",
        "workload.output_len.max=130",
        "mode=chunked",
        "cluster.num_workers=2",
        "scheduler.chunk_size=64",
        "scheduler.max_running=16",
        "faults.kill_worker=1",
        "faults.kill_at_s=0.3",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests = result["requests"]
    failed = requests[requests.status == "failed"]
    assert len(failed) > 0 and (failed.reason == "worker 1 (chunked) died").all()
    served_by_victim = requests[(requests.status == "ok") & (requests.prefill_worker == 1)]
    # only what it finished before it died (the kill's own time: a loaded router injects it late)
    killed_at = next(f["t_s"] for f in result["summary"]["faults"] if f["kind"] == "kill_worker")
    assert (served_by_victim.finished_s < killed_at + 0.5).all()
    assert_no_leaks(result["summary"], dead={"worker1"})


@pytest.mark.parametrize(
    "on_failure, tp", [("fail", []), ("recompute", []), ("recompute", TP2)], ids=["fail", "recompute", "recompute-tp2"]
)
def test_dropped_kv_times_out_and_is_failed_or_recomputed(tmp_path, on_failure, tp):
    cfg = make_config(
        *small_workload(n=12, rate=30),
        *tp,
        "mode=disagg",
        "faults.drop_kv_probability=0.3",
        "kv_transfer.timeout_s=1",
        f"kv_transfer.on_failure={on_failure}",
        "seed=1",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    drops = [f["request_id"] for f in summary["faults"] if f["kind"] == "drop_kv"]
    assert drops
    dropped = requests.set_index("request_id").loc[drops]
    if on_failure == "fail":
        assert (dropped.status == "failed").all() and dropped.reason.str.contains("timed out").all()
    else:
        assert (dropped.status == "ok").all()
        assert (dropped.output_token_ids.map(len) == dropped.output_len).all()
    assert (requests.drop(index=requests.index[requests.request_id.isin(drops)]).status == "ok").all()
    transfers = result["transfers"].set_index("request_id")
    assert (transfers.loc[drops, "outcome"] == "dropped").all()
    assert_no_leaks(summary)


def test_retry_resends_dropped_kv_until_it_arrives(tmp_path):
    cfg = make_config(
        *small_workload(n=12, rate=30),
        "mode=disagg",
        "faults.drop_kv_probability=0.3",
        "kv_transfer.timeout_s=1",
        "kv_transfer.on_failure=retry",
        "kv_transfer.max_retries=3",
        "seed=1",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, summary, transfers = result["requests"], result["summary"], result["transfers"]
    assert (requests.status == "ok").all(), requests.reason.unique()  # no request lost
    assert (requests.output_token_ids.map(len) == requests.output_len).all()
    attempts = transfers.groupby("request_id").attempt.agg(["count", "max"])
    assert (attempts["count"] == attempts["max"]).all()  # one row per attempt, numbered from 1
    assert attempts["count"].max() > 1  # retried requests show several rows
    drops = {f["request_id"] for f in summary["faults"] if f["kind"] == "drop_kv"}
    assert drops and set(transfers[transfers.outcome == "dropped"].request_id) == drops
    last = transfers.sort_values("attempt").groupby("request_id").tail(1).set_index("request_id")
    exhausted = attempts["count"] == 1 + 3  # every resend dropped too: recomputed on D
    assert len(last) == len(requests) and ((last.outcome == "ok") | exhausted).all()
    assert summary["kv_transfer"]["count"] == (transfers.outcome == "ok").sum()  # the figures count arrivals
    assert_no_leaks(summary)


@pytest.mark.parametrize(
    "fallback, tp", [("recompute", []), ("fail", []), ("fail", TP2)], ids=["recompute", "fail", "fail-tp2"]
)
def test_retries_exhausted_fall_back_to_recompute_or_fail(tmp_path, fallback, tp):
    cfg = make_config(
        *small_workload(n=6, rate=30),
        *tp,
        "mode=disagg",
        "faults.drop_kv_probability=1",
        "kv_transfer.timeout_s=0.5",
        "kv_transfer.on_failure=retry",
        "kv_transfer.max_retries=1",
        f"kv_transfer.retry_fallback={fallback}",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, transfers, summary = result["requests"], result["transfers"], result["summary"]
    assert sorted(transfers.groupby("request_id").attempt.apply(sorted)) == [[1, 2]] * len(requests)
    # every attempt lost: dropped by P, or given up by D (its 0.5 s lease is wall time) before a P kept
    # waiting for a core (the run's own measure) got to it; on a quiet host P drops every one first
    assert transfers.outcome.isin(["dropped", "timed_out"]).all(), transfers.outcome
    assert (transfers.outcome == "dropped").all() or summary["host"]["contended"], "a timeout on a quiet host"
    if fallback == "recompute":
        assert (requests.status == "ok").all() and (requests.output_token_ids.map(len) == requests.output_len).all()
    else:
        assert (requests.status == "failed").all() and requests.reason.str.contains("timed out").all()
    assert_no_leaks(summary)


@pytest.mark.parametrize("tp", [[], TP2], ids=["tp1", "tp2"])
def test_decode_worker_killed_with_kv_on_the_wire_fails_for_its_death_only(tmp_path, tp):
    """Worker 2 stops reading (stalled) while P's sends to it wait on the wire, then dies: those
    sends break on P (or P drops them when the router ends their requests first: which comes first
    is a race), and the requests fail because worker 2 died, not as transfer errors. At TP2 every
    rank of worker 2 dies with it, and every rank of P and of worker 1 ends clean."""
    cfg = make_config(
        *small_workload(n=30, rate=40),
        *LONG,
        *tp,
        "mode=disagg",
        "cluster.num_prefill=1",
        "cluster.num_decode=2",
        "cluster.decode_dispatch=round_robin",
        "kv_transfer.decode_binding=early",
        "faults.delay_kv_ms=200",
        "faults.stall_worker=2",
        "faults.stall_at_s=0.3",
        "faults.stall_ms=3000",
        "faults.kill_worker=2",
        "faults.kill_at_s=0.8",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, transfers, summary = result["requests"], result["transfers"], result["summary"]
    failed = requests[requests.status == "failed"]
    assert len(failed) > 0 and (failed.reason == "worker 2 (decode_only) died").all(), failed.reason.unique()
    ok = requests[requests.status == "ok"]
    assert len(ok) > 0 and (ok.output_token_ids.map(len) == ok.output_len).all()
    # the attempts on the wire to worker 2 keep their rows: broken on P, else aborted when the request failed
    unfinished = transfers[(transfers.decode_worker == 2) & (transfers.outcome != "ok")]
    assert unfinished.outcome.isin(["error", "aborted"]).all(), unfinished.outcome
    assert set(unfinished.request_id) <= set(failed.request_id)
    # 0.3 s and 0.8 s are wall time: on a host that kept the workers waiting for a core (the run's own
    # measure), P may have sent nothing to worker 2 by its death; on a quiet one its sends are on the wire
    assert len(unfinished) > 0 or summary["host"]["contended"], "nothing on the wire to worker 2 on a quiet host"
    assert_no_leaks(summary, dead={"worker2"})


def test_delayed_kv_shows_in_transfer_times(tmp_path):
    cfg = make_config(*small_workload(n=6, rate=20), "mode=disagg", "faults.delay_kv_ms=80")
    result = serve(cfg, tmp_path, progress=False)
    requests = result["requests"]
    sent = requests.dropna(subset=["kv_transfer_start_s"])
    assert len(sent) > 0 and ((sent.kv_transfer_start_s - sent.prefill_end_s) >= 0.08).all()
    assert (requests.status == "ok").all()
    assert_no_leaks(result["summary"])


STALLED = [
    *small_workload(n=20, rate=20),
    *LONG,
    "mode=chunked",
    "cluster.num_workers=2",
    "scheduler.chunk_size=64",
    "scheduler.max_running=16",
    "faults.stall_worker=1",
    "faults.stall_at_s=0.3",
    "faults.stall_ms=3000",
    "cluster.heartbeat_s=0.1",
]


def test_a_stalled_worker_whose_process_lives_is_slow_not_lost(tmp_path):
    """Silent for 3 s, six times the 5 heartbeats (0.5 s) that once declared it dead, but its process
    is alive: it is counted slow, nothing is redispatched or failed, and its requests finish."""
    result = serve(make_config(*STALLED, "cluster.on_worker_failure=redispatch"), tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    assert "stall_worker" in kinds(summary) and "redispatch" not in kinds(summary)
    assert (requests.status == "ok").all(), requests.reason.unique()
    assert (requests.output_token_ids.map(len) == requests.output_len).all()
    assert (requests.prefill_worker == 1).any()  # the stalled worker served its share
    worker = summary["workers"]["worker1"]
    assert worker["alive_at_end"] and worker["slow_periods"] >= 1
    stalled = [s for s in summary["slow_periods"] if s["worker"] == "worker1" and s["silent_s"] > 2.5]
    assert stalled and stalled[0]["ended"] == "reported", summary["slow_periods"]
    assert stalled[0]["cpu_s"] is None or stalled[0]["cpu_s"] < 0.5  # asleep, not computing
    assert_no_leaks(summary)


def test_a_silent_worker_past_the_stall_timeout_is_lost_as_hung(tmp_path):
    """The same stall past cluster.stall_timeout_s (1 s): the worker is lost as hung, though its
    process is alive, and its requests are redispatched."""
    cfg = make_config(*STALLED, "cluster.stall_timeout_s=1", "cluster.on_worker_failure=redispatch")
    result = serve(cfg, tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    assert "stall_worker" in kinds(summary)
    assert not summary["workers"]["worker1"]["alive_at_end"]
    assert [s["ended"] for s in summary["slow_periods"] if s["worker"] == "worker1"][-1] == "lost (hung)"
    if summary["host"]["contended"]:
        # 1 s of silence is wall time: on a host that kept the workers waiting for a core (the run's own
        # measure), the other worker can fall silent that long too; its requests then fail, named
        assert (
            set(requests.status) <= {"ok", "failed"}
            and requests[requests.status == "failed"].reason.str.contains("worker").all()
        )
        return
    assert "redispatch" in kinds(summary)
    assert (requests.status == "ok").all(), requests.reason.unique()
    assert_no_leaks(summary, dead={"worker1"})


def test_exhausted_kv_pool_preempts_but_completes(tmp_path):
    cfg = make_config(
        *small_workload(n=16, rate=100),
        *LONG,
        "mode=chunked",
        "scheduler.chunk_size=64",
        "scheduler.max_running=16",
        "faults.exhaust_kv_pool=true",
    )
    result = serve(cfg, tmp_path, progress=False)
    assert (result["requests"].status == "ok").all()
    assert result["steps"].kv_blocks_used.max() <= 16  # max_model_len 256 / block 16
    assert_no_leaks(result["summary"])


def test_soak_above_capacity_stays_flat(tmp_path):
    """Thousands of requests faster than one tiny worker serves them: admission control rejects
    the excess, every admitted request completes, and no process grows."""
    cfg = make_config(
        *small_workload(n=3000, rate=1000),
        *LONG,
        "mode=chunked",
        "scheduler.chunk_size=64",
        "scheduler.max_running=16",
        "cluster.max_outstanding=32",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    rejected = requests[requests.status == "rejected"]
    assert len(rejected) > 0 and rejected.reason.str.contains("cluster.max_outstanding=32").all()
    assert (requests[requests.status != "rejected"].status == "ok").all()
    for name, rss in summary["memory"].items():
        assert rss["samples"] >= 3, name
        assert rss["last_mib"] <= rss["first_mib"] * 1.25 + 32, (name, rss)
    assert_no_leaks(summary)


def test_a_hang_that_outlasts_the_stall_timeout_fails_what_waits(tmp_path):
    """One worker frozen for 3 s, too briefly to be declared lost (heartbeat 100 s): the run's own
    bound (cluster.stall_timeout_s) fails the waiting requests and the run still ends."""
    cfg = make_config(
        *small_workload(n=20, rate=20),
        *LONG,
        "mode=chunked",
        "cluster.num_workers=1",
        "scheduler.chunk_size=64",
        "scheduler.max_running=16",
        "faults.stall_worker=0",
        "faults.stall_at_s=0.3",
        "faults.stall_ms=3000",
        "cluster.heartbeat_s=100",
        "cluster.stall_timeout_s=1",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests = result["requests"]
    failed = requests[requests.status == "failed"]
    assert len(failed) > 0 and failed.reason.str.contains("cluster.stall_timeout_s").all()
    assert (requests.status.isin(["ok", "failed"])).all()
    assert_no_leaks(result["summary"])
