"""The KV hand-off lifecycle of one P and one D, in process, on a fake clock and a fake wire.

The wire's pieces complete when a test says so, so every path (lease, resend, abort, a part
for a request D no longer has) is driven step by step, and every staging buffer is accounted for.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from testbed import LLM
from testbed.cluster import connector, receiver
from testbed.cluster.completion import Handle
from testbed.cluster.kv_wire import WirePart, piece_ranges
from testbed.cluster.worker import Worker, WorkerSpec
from testbed.control.config import ClusterConfig, KVFailurePolicy, KVTransferConfig
from testbed.control.transfers import TransferLog
from testbed.engine import EngineConfig, SchedulerConfig, Sequence
from testbed.errors import ConfigError
from testbed.model.config import ModelConfig
from testbed.names import Role
from testbed.net.faults import FaultsConfig, KVFaults
from testbed.net.messages import (
    Audit,
    Failed,
    KVAck,
    KVArrived,
    KVAttemptFailed,
    KVBegin,
    KVDone,
    KVPart,
    KVSent,
    Ready,
    Reserve,
    Stop,
)

P, D = 0, 1
TIMEOUT_S = 1.0
PROMPT = tuple(range(1, 41))


class Box(list):
    """An inbox or the event pipe: what was put, in order."""

    def put(self, msg) -> None:
        self.append(msg)

    def take(self, kind) -> list:
        found = [m for m in self if isinstance(m, kind)]
        self[:] = [m for m in self if not isinstance(m, kind)]
        return found


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Wire:
    """Stands for torch.distributed: each piece posted waits until the test completes or fails it."""

    def __init__(self):
        self.pieces: list[Handle] = []

    def post(self, shape, pool) -> WirePart:
        buffer = pool.get(shape)
        ranges = piece_ranges(tuple(shape), buffer.element_size())
        assert len(ranges) == 1, "a test part is one piece"
        handle = Handle(None, polled=False)
        self.pieces.append(handle)
        return WirePart(buffer, ranges, [buffer], [handle])

    def complete(self, error: str | None = None) -> None:
        for handle in self.pieces:
            handle.error = error
            handle.event.set()
        self.pieces.clear()


class FakeTracker:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s


@pytest.fixture
def wire(monkeypatch):
    wire = Wire()
    monkeypatch.setattr(receiver, "CompletionTracker", FakeTracker)
    monkeypatch.setattr(connector, "CompletionTracker", FakeTracker)
    monkeypatch.setattr(receiver, "receive_part", lambda shape, src, pool, *rest: wire.post(shape, pool))
    monkeypatch.setattr(
        connector,
        "send_pieces",
        lambda runner, table, n, layer, pieces, pool, *rest, **kw: [
            wire.post(runner.kv_shape(n, layer), pool) for _ in pieces
        ],
    )
    monkeypatch.setattr(receiver, "unpack_arrived", _unpack_without_writing)
    return wire


def _unpack_without_writing(runner, block_table, part, layer, start=0) -> bool:
    while part.unpacked < len(part.handles) and part.handles[part.unpacked].done():
        if part.handles[part.unpacked].error:
            return False
        part.unpacked += 1
    return part.unpacked == len(part.handles)


@pytest.fixture
def engines():
    options = dict(num_kv_blocks=64, max_model_len=256)
    return LLM("tiny", policy="prefill_only", **options).engine, LLM("tiny", policy="decode_only", **options).engine


def kv_config(policy: KVFailurePolicy = KVFailurePolicy(), **more) -> KVTransferConfig:
    """kv_transfer as the tests' pair runs it: their lease, 1 MiB pieces, `policy` on a failed attempt."""
    return KVTransferConfig(
        timeout_s=TIMEOUT_S,
        piece_kib=1024,
        on_failure=policy.on_failure,
        max_retries=policy.max_retries,
        retry_fallback=policy.retry_fallback,
        **more,
    )


def make_receiver(engine, policy: KVFailurePolicy, clock: Clock):
    inboxes, events = [Box(), Box()], Box()
    return receiver.KVReceiver(engine, D, inboxes, events, kv_config(policy), clock), inboxes, events


def make_sender(engine, policy: KVFailurePolicy, clock: Clock, drop: float = 0.0):
    inboxes, events = [Box(), Box()], Box()
    faults = KVFaults(FaultsConfig(drop_kv_probability=drop), seed=0)
    sender = connector.KVSender(engine, P, inboxes, events, kv_config(policy), faults, clock)
    return sender, inboxes, events


def send(rx, attempt: int = 1, rid: int = 7) -> None:
    """P's header and done message for one part of `attempt`."""
    rx.on_part(KVPart(rid, 0, rx.engine.runner.kv_shape(len(PROMPT), None), "float32", P, attempt))
    rx.on_done(KVDone(rid, 99, 1, attempt, P))


def begin_and_send(rx, attempt: int = 1, rid: int = 7) -> None:
    rx.on_begin(KVBegin(rid, attempt, P))
    send(rx, attempt, rid)


def prefill(engine, rid: int = 7, prompt: tuple = PROMPT) -> Sequence:
    seq = Sequence(rid, list(prompt), 4)
    engine.add(seq)
    with torch.inference_mode():
        result = engine.step().result
    assert result.handoff == [seq]
    return seq


# -- D: the lease ---------------------------------------------------------------------------------
def test_a_reservation_is_not_timed_while_p_has_not_begun(engines, wire):
    clock = Clock()
    rx, inboxes, events = make_receiver(engines[1], KVFailurePolicy(), clock)
    rx.reserve(Reserve(7, PROMPT, 4, P))
    assert inboxes[P].take(Ready) == [Ready(7, D, 1)]
    clock.now = 100 * TIMEOUT_S  # a long prefill queue on P
    rx.poll()
    assert 7 in rx.incoming and not events.take(Failed) and not events.take(KVAttemptFailed)
    rx.on_begin(KVBegin(7, 1, P))  # the lease starts
    clock.now += 0.9 * TIMEOUT_S
    rx.poll()
    send(rx)  # the header renews it
    clock.now += 0.9 * TIMEOUT_S  # longer than the timeout since the begin, not since the header
    wire.complete()
    rx.poll()
    assert [m.attempt for m in events.take(KVArrived)] == [1] and not events.take(KVAttemptFailed)
    assert [s.seq_id for s in engines[1].scheduler.running] == [7] and not rx.buffers.loaned


def test_a_silent_attempt_is_retried_into_the_same_blocks_then_recomputed(engines, wire):
    clock = Clock()
    policy = KVTransferConfig(on_failure="retry", max_retries=1, retry_fallback="recompute").failure_policy()
    rx, inboxes, events = make_receiver(engines[1], policy, clock)
    rx.reserve(Reserve(7, PROMPT, 4, P))
    blocks = list(rx.incoming[7].seq.block_table)
    rx.on_begin(KVBegin(7, 1, P))
    clock.now = 1.5 * TIMEOUT_S
    rx.poll()
    assert [(m.attempt, m.outcome) for m in events.take(KVAttemptFailed)] == [(1, "timed_out")]
    assert inboxes[P].take(Ready) == [Ready(7, D, 1), Ready(7, D, 2)]
    assert rx.incoming[7].seq.block_table == blocks  # a resend needs no new reservation
    rx.on_begin(KVBegin(7, 1, P))  # a late message of the abandoned attempt: no lease starts
    clock.now = 10 * TIMEOUT_S
    rx.poll()
    assert 7 in rx.incoming and not events.take(KVAttemptFailed)
    rx.on_begin(KVBegin(7, 2, P))
    clock.now += 1.5 * TIMEOUT_S
    rx.poll()
    assert [(m.attempt, m.outcome) for m in events.take(KVAttemptFailed)] == [(2, "timed_out")]
    assert inboxes[P].take(KVAck) == [KVAck(7, 2, installed=False)]  # P may free its copy
    assert [m.kind for m in events.take(Failed)] == ["kv_recompute"]
    assert [s.seq_id for s in engines[1].scheduler.waiting] == [7] and engines[1].num_used_blocks == 0


# -- D: staging buffers on every path --------------------------------------------------------------
def test_parts_for_an_unknown_request_are_drained_and_returned(engines, wire):
    rx, _, _ = make_receiver(engines[1], KVFailurePolicy(), Clock())
    rx.on_part(KVPart(12, 0, engines[1].runner.kv_shape(len(PROMPT), None), "float32", P, 1))
    assert len(rx.buffers.loaned) == 1  # the receive is posted: the wire stays in step with P
    rx.poll()
    assert len(rx.buffers.loaned) == 1 and rx.in_flight  # never returned while the transport may write it
    wire.complete()
    rx.poll()
    assert not rx.buffers.loaned and not rx.in_flight


@pytest.mark.parametrize("ending", ["lease", "abort", "broken"])
def test_an_abandoned_receive_returns_its_buffer_once_settled(engines, wire, ending):
    clock = Clock()
    rx, _, events = make_receiver(engines[1], KVFailurePolicy(on_failure="fail"), clock)
    rx.reserve(Reserve(7, PROMPT, 4, P))
    begin_and_send(rx)
    if ending == "lease":
        clock.now = 1.5 * TIMEOUT_S
        rx.poll()
    elif ending == "abort":
        rx.abort(7)
    else:
        wire.complete(error="Connection closed by peer")
        rx.poll()
    assert 7 not in rx.incoming and engines[1].num_used_blocks == 0
    kinds = [m.kind for m in events.take(Failed)]
    assert kinds == {"lease": ["kv_lost"], "abort": [], "broken": ["kv_broken"]}[ending]
    wire.complete()
    rx.poll()
    assert not rx.buffers.loaned and not rx.in_flight


# -- P: holding the KV, resends, buffers ------------------------------------------------------------
class SlowLink:
    """An emulated link whose modelled transfer lasts `seconds` from its start (LinkPacer's contract)."""

    def __init__(self, clock: Clock, seconds: float):
        self.clock, self.seconds, self.start = clock, seconds, None

    def arrived(self, rid, start, nbytes, now, tokens=0, handoff_t=None, ready_t=None) -> bool:
        return now >= start + self.seconds  # LinkPacer.arrived's signature; only the time since start counts


def test_p_renews_ds_lease_while_an_emulated_link_holds_the_kv_back(engines, wire):
    """A modelled link slower than the lease: D hears KVBegin again before its lease runs out,
    so the attempt is not timed out, and KVDone leaves once the modelled time has passed."""
    clock = Clock()
    tx, inboxes, _ = make_sender(engines[0], KVFailurePolicy(), clock)
    rx, rx_inboxes, events = make_receiver(engines[1], KVFailurePolicy(), clock)
    tx.link = SlowLink(clock, 5 * TIMEOUT_S)
    seq = prefill(engines[0])
    rx.reserve(Reserve(7, PROMPT, 4, P))
    tx.handoff(seq, clock())
    tx.ready(rx_inboxes[P].take(Ready)[0])
    for msg in inboxes[D].take(KVBegin) + inboxes[D].take(KVPart):
        rx.on_begin(msg) if isinstance(msg, KVBegin) else rx.on_part(msg)
    wire.complete()
    while clock.now < 5 * TIMEOUT_S:
        clock.now += TIMEOUT_S / 8
        tx.poll()
        for msg in inboxes[D].take(KVBegin):
            rx.on_begin(msg)
        rx.poll()
        assert not events.take(KVAttemptFailed) and not events.take(Failed), f"timed out at {clock.now}"
    assert inboxes[D].take(KVDone), "the KV leaves once its modelled time has passed"


def test_p_keeps_the_kv_for_a_resend_until_d_acknowledges_it(engines, wire):
    prefill_engine, clock = engines[0], Clock()
    policy = KVFailurePolicy(on_failure="retry", max_retries=2)
    tx, inboxes, events = make_sender(prefill_engine, policy, clock)
    seq = prefill(prefill_engine)
    tx.handoff(seq, clock())
    used = prefill_engine.num_used_blocks
    tx.ready(Ready(7, D, 1))
    assert [type(m) for m in inboxes[D]] == [KVBegin, KVPart, KVDone]
    wire.complete()
    tx.poll()
    assert [m.attempt for m in events.take(KVSent)] == [1] and not tx.buffers.loaned
    assert prefill_engine.num_used_blocks == used  # kept: D may ask again
    tx.ready(Ready(7, D, 2))  # D gave attempt 1 up
    assert [m.attempt for m in inboxes[D] if isinstance(m, KVBegin)] == [1, 2]
    tx.ready(Ready(7, D, 2))  # a duplicate starts nothing
    assert len(tx.buffers.loaned) == 1
    tx.ack(KVAck(7, 2, installed=True))
    assert prefill_engine.num_used_blocks == 0 and 7 not in tx.ledger
    assert [m.attempt for m in events.take(KVSent)] == [2]
    assert len(tx.buffers.loaned) == 1 and tx.in_flight  # its piece has not settled yet
    wire.complete()
    tx.poll()
    assert not tx.buffers.loaned and not tx.in_flight


@pytest.mark.parametrize("ending", ["abort", "broken", "resend"])
def test_an_abandoned_send_returns_its_buffer_once_settled(engines, wire, ending):
    prefill_engine, clock = engines[0], Clock()
    policy = KVFailurePolicy(on_failure="retry" if ending == "resend" else "fail", max_retries=1)
    tx, _, events = make_sender(prefill_engine, policy, clock)
    tx.handoff(prefill(prefill_engine), clock())
    tx.ready(Ready(7, D, 1))
    if ending == "abort":
        tx.abort(7)
    elif ending == "broken":
        wire.complete(error="Connection closed by peer")
    else:
        tx.ready(Ready(7, D, 2))
    tx.poll()
    if ending == "broken":  # D's side decides what follows; P reports and lets go
        assert [bool(m.error) for m in events.take(KVSent)] == [True]
        assert prefill_engine.num_used_blocks == 0 and not tx.buffers.loaned
        return
    assert tx.buffers.loaned and tx.in_flight
    wire.complete()
    tx.poll()
    if ending == "resend":
        tx.ack(KVAck(7, 2, installed=True))
    assert prefill_engine.num_used_blocks == 0 and not tx.buffers.loaned and not tx.in_flight


def test_a_dropped_attempt_begins_but_sends_nothing(engines, wire):
    prefill_engine, clock = engines[0], Clock()
    tx, inboxes, events = make_sender(prefill_engine, KVFailurePolicy(), clock, drop=1.0)
    tx.handoff(prefill(prefill_engine), clock())
    tx.ready(Ready(7, D, 1))
    assert [type(m) for m in inboxes[D]] == [KVBegin]  # D's lease starts and runs out
    tx.poll()
    sent = events.take(KVSent)
    assert len(sent) == 1 and sent[0].dropped and sent[0].kv_bytes == 0
    assert prefill_engine.num_used_blocks == 0 and not tx.buffers.loaned


# -- kv_transfers.parquet ----------------------------------------------------------------------------
def test_transfer_rows_join_both_ends_and_number_attempts_across_bindings():
    log = TransferLog(t0=10.0)
    log.sent(5, P, D, 1, 64, 11.0, 11.1, 0.0, dropped=True)
    log.failed(5, P, D, 1, "timed_out", 12.0)
    log.arrived(5, P, D, 2, 13.5)  # D's report may come before P's
    log.sent(5, P, D, 2, 64, 13.0, 13.4, 0.0)
    log.sent(5, 2, D, 1, 64, 14.0, 14.1, 0.0, error=True)  # re-dispatched to P 2, whose send broke
    log.sent(6, P, D, 1, 64, 15.0, 15.1, 0.0)  # the request failed before D's verdict
    table = log.table()
    assert list(zip(table.request_id, table.attempt, table.outcome)) == [
        (5, 1, "dropped"),
        (5, 2, "ok"),
        (5, 3, "error"),
        (6, 1, "aborted"),
    ]
    assert table.end_s.tolist() == pytest.approx([2.0, 3.5, 4.1, 5.1])
    assert table.start_s.tolist() == pytest.approx([1.0, 3.0, 4.0, 5.0])


# -- config -----------------------------------------------------------------------------------------
def test_failure_policy_after_each_attempt():
    retry = KVTransferConfig(on_failure="retry", max_retries=2, retry_fallback="fail").failure_policy()
    assert [retry.after(n) for n in (1, 2, 3)] == ["retry", "retry", "fail"] and retry.holds_until_ack
    recompute = KVTransferConfig(on_failure="recompute").failure_policy()
    assert recompute.after(1) == "recompute" and not recompute.holds_until_ack


@pytest.mark.parametrize(
    "override, message",
    [
        ({"retry_fallback": "retry"}, "kv_transfer.retry_fallback='retry' is not one of recompute, fail"),
        ({"on_failure": "resend"}, "kv_transfer.on_failure='resend' is not one of fail, recompute, retry"),
        ({"max_retries": -1}, "kv_transfer.max_retries must be >= 0 (got -1)"),
    ],
)
def test_bad_retry_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as error:
        KVTransferConfig(**override).validate()
    assert str(error.value) == message


# -- the end of a run -----------------------------------------------------------------------------
class LateInbox:
    """A worker's inbox whose messages become visible in turns: None marks a moment it is empty
    (the next message is still in its sender's feeder thread)."""

    def __init__(self, *turns):
        self.turns = list(turns)

    def get(self, timeout: float | None = None):
        return self.get_nowait()

    def get_nowait(self):
        if not self.turns or self.turns[0] is None:
            self.turns[:1] = []
            raise queue.Empty
        return self.turns.pop(0)


def test_p_takes_in_an_ack_that_the_routers_stop_overtook(engines, wire):
    """D acknowledges the KV before its request can end, but the router's Stop comes from another
    process and may reach P first: P still frees the KV it kept before it reports its audit."""
    prefill_engine = engines[0]
    policy = KVFailurePolicy(on_failure="retry", max_retries=3)
    spec = WorkerSpec(
        P, 2, Role.PREFILL_ONLY, "cpu", 0, ModelConfig(), EngineConfig(), SchedulerConfig(),
        kv_config(policy), ClusterConfig(), FaultsConfig(), seed=0,
    )  # fmt: skip
    inbox = LateInbox(Stop(), None, KVAck(7, 1, installed=True))
    events = Box()
    worker = Worker(spec, prefill_engine, [inbox, Box()], events)
    seq = prefill(prefill_engine)
    worker.sender.serve(seq, D)
    worker.sender.handoff(seq, time.perf_counter())
    worker.sender.ready(Ready(7, D, 1))
    wire.complete()
    worker.sender.poll()
    assert worker.sender.awaits_ack and prefill_engine.num_used_blocks > 0
    worker.loop()
    (audit,) = events.take(Audit)
    assert audit.used_blocks == 0 and audit.loaned_buffers == 0 and not worker.sender.awaits_ack
