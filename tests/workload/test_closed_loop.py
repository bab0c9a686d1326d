"""Closed-loop clients (workload.concurrency): never more than N in flight, think times kept,
Little's law, the same requests as the open loop; the simulator and one real CPU point."""

import asyncio
import json

import numpy as np
import pandas as pd
import pytest
import yaml
from aiohttp import web

from testbed.config import Config, with_overrides
from testbed.sim.executor import simulate
from testbed.studies.executors import http_point
from testbed.studies.real_cluster import serve
from testbed.studies.replay import replay
from testbed.studies.runner import run_point
from testbed.workload import WorkloadConfig, WorkloadError, build_workload
from tests.cluster_helpers import make_config, small_workload
from tests.paths import ROOT, TEST_DATA
from tests.stub_server import served

PROFILE = json.loads((ROOT / "testbed/sim/profiles/tiny_cpu.json").read_text())
TINY = dict(vocab_size=512, max_model_len=2048)
REPLAY = TEST_DATA / "replay"


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
    return simulate(cfg.serving, cfg.sim, PROFILE)


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


# -- one real CPU point --------------------------------------------------------------------------------


def test_real_cpu_point_keeps_the_bound_and_littles_law(tmp_path):
    n, think = 2, 0.01
    cfg = make_config(
        *small_workload(30, 40.0),
        "mode=colocated",
        "cluster.num_workers=1",
        f"workload.concurrency={n}",
        f"workload.think_time_s={think}",
    )
    result = serve(cfg, tmp_path, progress=False)
    requests, summary = result["requests"], result["summary"]
    assert (requests["status"] == "ok").all() and len(requests) == 30
    assert max_in_flight(requests) == n
    later = np.sort(requests["arrival_s"].to_numpy())[n:]
    ends = requests["finished_s"].to_numpy()
    assert np.abs(ends[None, :] + think - later[:, None]).min(axis=1).max() < 1e-9  # sent a think after an end
    # Little's law as in the simulator's test: N / M = 2 / 30 for the start and the drain, plus 1%
    r = float((requests["finished_s"] - requests["arrival_s"]).mean())
    assert summary["throughput"]["requests_per_s"] == pytest.approx(n / (r + think), rel=n / 30 + 0.01)
    assert summary["workload_report"]["loop"] == "closed" and summary["workload_report"]["concurrency"] == n


# -- the HTTP client against a stub server -------------------------------------------------------------


class Counting:
    """Streams max_tokens tokens, a chunk each event-loop turn after a short hold, and counts the
    streams open at once: the server's own witness of the client's concurrency."""

    def __init__(self):
        self.open = self.peak = self.served = 0

    async def models(self, request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 256}]})

    async def completions(self, request):
        body = await request.json()
        self.open += 1
        self.peak, self.served = max(self.peak, self.open), self.served + 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)  # the stub's service time (a pace, not a synchronisation)
                await response.write(b'data: {"choices":[{"text":" x","token_ids":[%d]}]}\n\n' % i)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.open -= 1


@pytest.mark.parametrize("n", [1, 3])
def test_http_client_is_a_closed_loop_of_n_users(n, tmp_path):
    stub = Counting()
    with served(stub) as url:
        cfg = make_config(
            *small_workload(24, 1000.0),
            "executor=http",
            f"http.url={url}",
            "http.max_concurrency=16",
            f"workload.concurrency={n}",
        )
        result = http_point(cfg, tmp_path, progress=False)
    requests = result["requests"]
    assert (requests["status"] == "ok").all() and len(requests) == 24 == stub.served
    # the client's records (all n users start at 0, so the bound is reached) and the server agree
    assert max_in_flight(requests) == n and stub.peak <= n
    assert result["summary"]["workload_report"]["concurrency"] == n


# -- replay of a published run with a concurrency cap ----------------------------------------------------


def test_a_reference_with_max_concurrency_replays_as_a_closed_loop(tmp_path):
    """vLLM's bench serve JSON states --max-concurrency; the replay's simulated point runs that many
    users, paced by the file's request rate, and never has more in flight."""
    data = json.loads((REPLAY / "vllm060_a100_llama31_8b_rps4.jsonl").read_text().splitlines()[-1])
    data["max_concurrency"] = 3
    reference = tmp_path / "capped.jsonl"
    reference.write_text(json.dumps(data) + "\n")
    setup = tmp_path / "setup.yaml"
    setup.write_text(yaml.safe_dump({"gpu": "a100_80g", "model": "llama3_8b", "policy": "chunked"}))
    cfg = with_overrides(Config(), {"experiment.name": "replay"})
    result = replay(cfg, reference, setup, tmp_path / "out", run_point, quiet=True)
    overrides = result["overrides"]
    assert overrides["workload.concurrency"] == 3 and overrides["workload.paced"] is True
    requests = pd.read_parquet(tmp_path / "out" / "sim" / "requests.parquet")
    assert max_in_flight(requests) == 3
