"""testbed/control/book.py and testbed/control/request.py driven directly: the request book and the
request's two state machines, every transition, and the illegal ones refused. No clock, no processes."""

from __future__ import annotations

import itertools

import pytest

from testbed.control.book import RequestBook
from testbed.control.config import ClusterConfig, KVTransferConfig
from testbed.control.request import BACK_EDGES, FRONT_EDGES, Back, Front, WorkerStep
from testbed.engine.scheduler import StepReport
from testbed.errors import StateError
from testbed.metrics.events import RequestLog
from testbed.workload import Request

P0, P1, D0, D1 = 0, 1, 2, 3
ROLES = {P0: "prefill_only", P1: "prefill_only", D0: "decode_only", D1: "decode_only"}


def request(rid: int, input_len: int = 8, output_len: int = 3) -> Request:
    return Request(
        request_id=rid, arrival_s=0.0, prompt_token_ids=tuple(range(1, input_len + 1)), output_len=output_len
    )


def book(binding: str = "late", on_failure: str = "fail", **cluster) -> RequestBook:
    cfg = ClusterConfig(dispatch="round_robin", decode_dispatch="round_robin", **cluster)
    return RequestBook(
        cfg, KVTransferConfig(decode_binding=binding, on_failure=on_failure), True, ROLES, RequestLog(0.0)
    )


def loads_balanced(b: RequestBook) -> None:
    """The invariant: every worker's load is exactly what the open requests put on it."""
    queued = {rank: 0 for rank in b.loads}
    bound = {rank: 0 for rank in b.loads}
    held = {rank: 0 for rank in b.loads}  # prompt tokens bound to a decode worker
    for t in b.active.values():
        if t.front is Front.QUEUED:
            queued[t.worker] += t.request.input_len
        if t.front is not Front.LEFT:
            bound[t.worker] += 1
            if t.local:  # prefilled on a decode worker
                held[t.worker] += t.request.input_len
        if t.back is not Back.NONE:
            bound[t.decode_worker] += 1
            held[t.decode_worker] += t.request.input_len
    for rank, load in b.loads.items():
        assert (load.queued_prompt_tokens, load.bound_sequences, load.bound_tokens) == (
            queued[rank],
            bound[rank],
            held[rank],
        ), rank


def step(b: RequestBook, worker: int, tokens=(), finished=(), handoff=(), t: float = 1.0):
    report = StepReport([], list(tokens), list(finished), list(handoff), [])
    return b.on_step(WorkerStep(worker, t, t, 100, report), t + 0.001)


# -- the request book --------------------------------------------------------------------------------
def test_a_disaggregated_request_walks_every_front_and_back_state():
    b = book()
    t = b.admit(request(1), 0.0)
    assert (t.worker, t.front, t.back) == (P0, Front.QUEUED, Back.NONE)
    loads_balanced(b)
    news = step(b, P0, tokens=[(1, 0, 11)], handoff=[1])
    assert t.front is Front.PREFILLED and t.back is Back.BOUND and news.bound == [t] and t.decode_worker == D0
    loads_balanced(b)
    b.kv_sent(1, P0, D0, 1.0, 64, moved=True)
    assert t.front is Front.LEFT
    b.kv_arrived(1, D0, 1.1)
    assert t.back is Back.HOLDS
    loads_balanced(b)
    step(b, D0, tokens=[(1, 1, 12)])
    news = step(b, D0, tokens=[(1, 2, 13)], finished=[1], t=2.0)
    assert news.finished == [t] and not b.active and t.output == [11, 12, 13]
    assert all(load.queued_prompt_tokens == 0 and load.bound_sequences == 0 for load in b.loads.values())
    row = b.log.table().iloc[0]
    assert row.status == "ok" and list(row.output_token_ids) == [11, 12, 13]


def test_a_transfer_reported_after_d_finished_the_request_keeps_its_start():
    """P's KVSent travels on P's pipe: a loaded P may report after D decoded the request to its
    end. The row still has the transfer's start; a report from a worker that did not prefill it adds none."""
    b = book()
    b.admit(request(1), 0.0)
    step(b, P0, tokens=[(1, 0, 11)], handoff=[1])
    b.kv_arrived(1, D0, 1.1)
    assert step(b, D0, tokens=[(1, 1, 12), (1, 2, 13)], finished=[1], t=1.2).finished
    b.kv_sent(1, P1, D0, 0.9, 64, moved=True)  # not its prefill worker: nothing
    assert b.log.table().iloc[0].kv_transfer_start_s != b.log.table().iloc[0].kv_transfer_start_s  # NaN
    b.kv_sent(1, P0, D0, 1.0, 64, moved=True)
    row = b.log.table().iloc[0]
    assert row.status == "ok" and row.kv_transfer_start_s == 1.0 and row.kv_bytes == 64


def test_tokens_reach_the_client_in_order_across_p_and_d():
    b = book()
    t = b.admit(request(1), 0.0)
    step(b, P0, handoff=[1])  # (P's first-token report is late)
    news = step(b, D0, tokens=[(1, 1, 12), (1, 2, 13)], finished=[1], t=1.5)
    assert not news.finished and t.output == [] and t.finished_early  # waits for token 0
    news = step(b, P0, tokens=[(1, 0, 11)], t=2.0)
    assert news.finished == [t] and t.output == [11, 12, 13]
    assert b.log.table().iloc[0].prefill_worker == P0


def test_early_binding_binds_at_admission_and_a_recomputed_prefix_is_not_resent():
    b = book(binding="early")
    t = b.admit(request(1), 0.0)
    assert t.back is Back.BOUND and t.decode_worker == D0
    step(b, P0, tokens=[(1, 0, 11)], handoff=[1])
    step(b, D0, tokens=[(1, 0, 99), (1, 1, 12)])  # D recomputed: token 0 again
    assert t.output == [11, 12]


def test_admission_refuses_and_logs_by_whom():
    b = book(max_outstanding=1)
    assert b.admit(request(1), 0.0) is not None
    assert b.admit(request(2), 0.1) is None
    row = b.log.table().set_index("request_id").loc[2]
    assert row.status == "rejected" and row.refused_by == "admission"
    loads_balanced(b)


def test_fail_releases_every_load_and_late_reports_change_nothing():
    b = book()
    t = b.admit(request(1), 0.0)
    step(b, P0, tokens=[(1, 0, 11)], handoff=[1])
    assert b.fail(1, 1.0, "lost").worker == P0
    loads_balanced(b)
    b.kv_sent(1, P0, D0, 1.0, 64, moved=True)  # reports about an ended request are ignored
    b.kv_arrived(1, D0, 1.1)
    assert step(b, D0, tokens=[(1, 1, 12)], finished=[1]).finished == [] and t.output == [11]
    assert b.fail(1, 2.0, "again") is None


def test_a_lost_worker_redispatches_what_depends_on_it():
    b = book(on_failure="retry")
    t = b.admit(request(1), 0.0)
    step(b, P0, tokens=[(1, 0, 11)], handoff=[1])
    b.kv_sent(1, P0, D0, 1.0, 64, moved=True)  # P keeps the KV for a resend until D holds it
    assert b.lose_worker(P0) == [1]
    moved, old = b.redispatch(1)
    assert moved is t and t.worker == P1 and old == [D0] and (t.front, t.back) == (Front.QUEUED, Back.NONE)
    loads_balanced(b)
    b.kv_sent(1, P0, D0, 1.0, 64, moved=True)  # a late report from the dead worker
    assert t.front is Front.QUEUED
    assert b.lose_worker(P1) == [1] and b.redispatch(1) is None


@pytest.mark.parametrize("old,new", [(o, n) for o, n in itertools.product(Front, Front) if n not in FRONT_EDGES[o]])
def test_front_refuses_edges_it_does_not_have(old, new):
    b = book()
    t = b.admit(request(1), 0.0)
    t.front = old
    with pytest.raises(StateError, match="front"):
        b._front(t, new)


@pytest.mark.parametrize("old,new", [(o, n) for o, n in itertools.product(Back, Back) if n not in BACK_EDGES[o]])
def test_back_refuses_edges_it_does_not_have(old, new):
    b = book()
    t = b.admit(request(1), 0.0)
    t.back, t.decode_worker = old, D0
    with pytest.raises(StateError, match="back"):
        b._back(t, new)
