"""Closed-loop clients (workload.concurrency): never more than N in flight, think times kept,
Little's law, the same requests as the open loop; the simulator and one real CPU point."""

import json
from pathlib import Path

import numpy as np
import pytest

from testbed.sim.executor import simulate
from testbed.workload import WorkloadConfig, WorkloadError, build_workload
from tests.cluster_helpers import make_config, small_workload

PROFILE = json.loads((Path(__file__).resolve().parents[1] / "testbed/sim/profiles/tiny_cpu.json").read_text())
TINY = dict(vocab_size=512, max_model_len=2048)


def max_in_flight(requests) -> int:
    """From the run's own records: +1 at each arrival, -1 at each end; at one instant the ends
    count first (a user's next request leaves the instant its last one ended)."""
    events = sorted([(t, 1) for t in requests["arrival_s"]] + [(t, 0) for t in requests["finished_s"]])
    level = peak = 0
    for _, starts in events:
        level += 1 if starts else -1
        peak = max(peak, level)
    return peak


def sim(n: int, *extra: str, requests: int = 300):
    cfg = make_config(
        *small_workload(requests, 40.0), "mode=chunked", "cluster.num_workers=1", f"workload.concurrency={n}", *extra
    )
    return simulate(cfg, PROFILE)


# -- the workload alone ------------------------------------------------------------------------------


def test_concurrency_below_zero_is_one_line_naming_the_key():
    with pytest.raises(WorkloadError, match=r"^workload\.concurrency must be >= 0 \(got -1\)$"):
        WorkloadConfig(concurrency=-1).validate()


def test_closed_loop_needs_a_request_count():
    with pytest.raises(WorkloadError, match="workload.num_requests must be > 0 with workload.concurrency"):
        WorkloadConfig(concurrency=2, num_requests=0, duration_s=10.0).validate()


def test_same_requests_as_the_open_loop_only_their_send_times_differ():
    open_loop = build_workload(WorkloadConfig(num_requests=20), seed=3, **TINY)
    closed = build_workload(WorkloadConfig(num_requests=20, concurrency=3, think_time_s=0.5), seed=3, **TINY)
    first = closed.initial()
    assert [r.request_id for r in first] == [0, 1, 2] and all(r.arrival_s == 0.0 for r in first)
    sent = first + [closed.next_turn(first[0], [], 2.0), closed.ended(first[1], 4.0)]
    assert [r.arrival_s for r in sent[3:]] == [2.5, 4.5]  # the end + the think time
    for a, b in zip(open_loop.requests, sent):
        assert (a.request_id, a.prompt_token_ids, a.output_len) == (b.request_id, b.prompt_token_ids, b.output_len)
    assert closed.report["loop"] == "closed" and closed.report["concurrency"] == 3
    assert open_loop.report["loop"] == "open" and open_loop.initial() is open_loop.requests


def test_users_stop_when_the_pool_is_spent():
    closed = build_workload(WorkloadConfig(num_requests=3, concurrency=2), seed=0, **TINY)
    first = closed.initial()
    assert closed.ended(first[0], 1.0).request_id == 2
    assert closed.ended(first[1], 1.0) is None and closed.unsent == 0


def test_paced_users_wait_for_the_open_loop_arrival():
    cfg = WorkloadConfig(num_requests=10, rate=1.0, arrival="constant", concurrency=2, paced=True, think_time_s=0)
    closed = build_workload(cfg, seed=0, **TINY)
    assert [r.arrival_s for r in closed.initial()] == [1.0, 2.0]
    assert closed.ended(closed.requests[0], 2.5).arrival_s == 3.0  # its arrival comes after the free slot
    assert closed.ended(closed.requests[1], 7.0).arrival_s == 7.0  # a slot frees after its arrival


def test_exponential_think_times_have_the_configured_mean():
    cfg = WorkloadConfig(num_requests=4000, concurrency=1, think_time_s=0.2, think_time_dist="exponential")
    closed = build_workload(cfg, seed=1, **TINY)
    request, t, waits = closed.initial()[0], 0.0, []
    while request is not None:
        t += 1.0
        request, before = closed.ended(request, t), t
        if request is not None:
            waits.append(request.arrival_s - before)
    # 3999 exponential draws: the mean's standard error is 0.2 / sqrt(3999) = 0.0032; 4 of them
    assert abs(np.mean(waits) - 0.2) < 4 * 0.2 / np.sqrt(len(waits))
    assert closed.report["mean_think_s"] == pytest.approx(np.mean(waits))


# -- the simulator -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 16])
def test_sim_never_has_more_than_n_in_flight(n):
    out = sim(n)
    requests = out["requests"]
    assert (requests["status"] == "ok").all() and len(requests) == 300
    assert max_in_flight(requests) == n  # reached, never passed


def test_sim_keeps_the_think_time():
    think = 0.03
    requests = sim(4, f"workload.think_time_s={think}")["requests"]
    ends = np.sort(requests["finished_s"].to_numpy())
    later = np.sort(requests["arrival_s"].to_numpy())[4:]  # every request after the users' first
    # each was sent exactly one think time after some request ended
    gaps = np.abs(ends[None, :] + think - later[:, None]).min(axis=1)
    assert gaps.max() < 1e-9


@pytest.mark.parametrize("n, think", [(2, 0.0), (8, 0.0), (8, 0.02)])
def test_sim_obeys_littles_law(n, think):
    """A closed loop of N users: throughput X = N / (R + Z), R the mean E2E, Z the mean think time.
    It holds exactly while all N users are busy; a finite run has a start (all users at t=0, no
    think) and a drain (the last requests finish with fewer users), which together move X by at
    most about N of the M requests' worth: a tolerance of N / M (M = 300: 0.7% to 2.7%) plus 1%."""
    out = sim(n, f"workload.think_time_s={think}")
    requests, summary = out["requests"], out["summary"]
    r = float((requests["finished_s"] - requests["arrival_s"]).mean())
    x = summary["throughput"]["requests_per_s"]
    assert x == pytest.approx(n / (r + think), rel=n / len(requests) + 0.01)


def test_sim_closed_loop_sessions_keep_their_turns_and_the_bound():
    turns = ("workload.turns=3", "workload.think_time_s=0.01", "model.max_model_len=1024")
    requests = sim(3, *turns, requests=30)["requests"]
    assert len(requests) == 90 and (requests["status"] == "ok").all()
    assert max_in_flight(requests) <= 3


def test_sim_ttft_excludes_the_think_time():
    out = sim(2, "workload.think_time_s=0.5", requests=40)
    requests = out["requests"]
    # every request waited 0.5 s after its user's last one; its TTFT counts from its send
    assert out["summary"]["ttft"]["max"] < 0.05
    assert out["summary"]["workload_report"]["mean_think_s"] == pytest.approx(0.5)
    assert requests["arrival_s"].max() > 19 * 0.5  # 20 rounds of two users: the waits happened
