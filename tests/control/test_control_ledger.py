"""testbed/control/ledger.py driven directly: the hand-off ledger's sends and receives, leases and
aborts. No clock, no processes."""

from __future__ import annotations

import pytest

from testbed.control.ledger import ReceiveLedger, SendLedger
from testbed.engine.sequence import Sequence
from testbed.errors import StateError

P0, P1, D0 = 0, 1, 2  # two prefill workers' and a decode worker's ranks


def seq(rid: int = 7, n: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), 4)


def test_send_ledger_holds_counts_and_releases():
    ledger = SendLedger()
    s = seq()
    ledger.serve(s, decode_rank=None)
    assert not ledger.get(7).sendable and not ledger.blocked(1)
    ledger.handoff(s, 1.0)
    assert ledger.blocked(1) and not ledger.get(7).sendable
    entry = ledger.ready(7, D0, 1, 1.5)
    assert entry.sendable and entry.wait_s == 0.5 and ledger.ready(7, D0, 1, 1.6) is None  # a duplicate
    assert ledger.ready(7, D0, 2, 2.0).attempt == 2 and entry.wait_s == 0.0  # a resend waits for nothing
    with pytest.raises(StateError):
        ledger.handoff(s, 2.0)
    ledger.release(7)
    assert not ledger.blocked(1) and 7 not in ledger


def test_send_ledger_a_ready_may_overtake_the_request_but_not_an_abort():
    ledger = SendLedger()
    assert ledger.ready(7, D0, 1, 0.5).seq is None  # D answered before P read the request
    ledger.serve(seq(), None)
    assert ledger.handoff(seq(), 1.0).sendable
    assert ledger.abort(7) is not None and ledger.num_held == 0
    assert ledger.ready(7, D0, 2, 2.0) is None and 7 not in ledger  # an aborted request stays ended
    ledger.serve(seq(), None)  # ... until it is served again (re-dispatch)
    assert 7 in ledger


def test_receive_ledger_is_fcfs_and_leases_start_at_begin():
    ledger = ReceiveLedger()
    room = {"slots": 1}

    def reserve(s):
        if room["slots"] == 0:
            return False
        room["slots"] -= 1
        return True

    ledger.request(seq(1), P0)
    ledger.request(seq(2), P1)
    assert [e.seq.seq_id for e in ledger.admit(reserve, 1.0)] == [1]
    assert ledger.num_pending == 2
    entry = ledger.incoming[1]
    assert not ledger.expired(entry, 100.0, 1.0)  # reserved, not begun: never timed
    assert ledger.begin(1, 1, src=P1, t=2.0) is None  # not from its prefill worker
    assert ledger.begin(1, 2, src=P0, t=2.0) is None  # not its attempt
    ledger.begin(1, 1, src=P0, t=2.0)
    assert not ledger.expired(entry, 2.5, 1.0) and ledger.expired(entry, 3.5, 1.0)
    ledger.renew(entry, 3.0)
    assert not ledger.expired(entry, 3.5, 1.0)
    assert ledger.retry(1).attempt == 2 and entry.lease_t is None
    assert ledger.current(1, 1) is None and ledger.current(1, 2) is entry
    ledger.take(1)
    room["slots"] = 1
    assert [e.seq.seq_id for e in ledger.admit(reserve, 4.0)] == [2]
    assert ledger.abort(2) is not None and ledger.abort(2) is None and ledger.num_pending == 0


def test_receive_ledger_abort_drops_a_queued_reservation():
    ledger = ReceiveLedger()
    ledger.request(seq(1), P0)
    assert ledger.abort(1) is None and not ledger.queued
