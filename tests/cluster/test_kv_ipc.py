"""The ipc KV transport in process: P's blocks copied into D's shared-memory pool, checked against
the KV D would have computed itself; the fence that keeps an ended request's blocks from a late
write; and where ipc is and is not allowed."""

from __future__ import annotations

import os

import pytest
import torch

from testbed import LLM
from testbed.cluster import connector, receiver
from testbed.cluster.kv_ipc import BlockCopier, attach_pool, block_runs, release, shared_pool
from testbed.control.layout import WorkerPlan, check_kv_backend
from testbed.engine import Sequence
from testbed.errors import ConfigError
from testbed.net.faults import FaultsConfig, KVFaults
from testbed.net.messages import KVArrived, KVBegin, KVDone, KVFence, KVPoolAttached, KVPoolExport, Ready, Reserve
from tests.cluster.test_kv_lifecycle import Box, Clock, FakeTracker, kv_config, prefill

P, D = 0, 1
PROMPT = tuple(range(3, 60))  # 57 tokens: a partial last block


def test_block_runs_join_blocks_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9, 10], [1, 2, 3, 7, 9]) == [(4, 1, 3), (9, 7, 1), (10, 9, 1)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("layer", [None, 1])
def test_write_blocks_copies_whole_blocks_into_a_mapped_pool(layer):
    shape = (12, 2, 2, 4, 2, 8)  # block-major, as the engine's pool
    src = torch.randn(shape)
    dst, handle = shared_pool(shape, torch.float32)
    try:
        mapped = attach_pool(handle)  # what P sees: the same memory
        src_blocks, dst_blocks = [7, 8, 2, 3], [0, 1, 5, 11]
        copied = BlockCopier(src, mapped).write(src_blocks, dst_blocks, layer)
        layers = [0, 1] if layer is None else [layer]
        assert copied == len(src_blocks) * len(layers) * 2 * 4 * 2 * 8 * 4
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(dst[d, layers], src[s, layers])
        untouched = [b for b in range(12) if b not in dst_blocks]
        assert not dst[untouched].any()
        if layer is not None:
            assert not dst[:, 0].any()
    finally:
        release(handle)
    assert not os.path.exists(handle.path)


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(receiver, "CompletionTracker", FakeTracker)  # no process group: no wire either
    monkeypatch.setattr(connector, "CompletionTracker", FakeTracker)
    options = dict(num_kv_blocks=64, max_model_len=256)
    p, d = LLM("tiny", policy="prefill_only", **options).engine, LLM("tiny", policy="decode_only", **options).engine
    pool, handle = shared_pool(tuple(d.runner.kv_cache.shape), d.runner.dtype)
    try:  # the shared-memory file goes whatever fails below
        d.runner.adopt_pool(pool)
        inboxes, events = [Box(), Box()], Box()
        clock = Clock()
        kv = kv_config(backend="ipc")
        sender = connector.KVSender(p, P, inboxes, events, kv, KVFaults(FaultsConfig(), seed=0), clock)
        rx = receiver.KVReceiver(d, D, inboxes, events, kv, clock)
        sender.attach(KVPoolExport(D, handle))
        assert inboxes[D].take(KVPoolAttached) == [KVPoolAttached(P)]
        yield p, d, sender, rx, inboxes, events
    finally:
        release(handle)


def _prefill(engine, rid: int = 7) -> Sequence:
    return prefill(engine, rid, PROMPT)


def test_p_writes_the_prompt_kv_into_the_blocks_d_reserved(pair):
    p, d, sender, rx, inboxes, events = pair
    d.block_manager.allocate_fresh(Sequence(-5, [1] * 40, 1), 40)  # D's blocks do not line up with P's
    seq = _prefill(p)
    sender.serve(seq, None)
    sender.handoff(seq, 0.0)
    rx.reserve(Reserve(7, list(PROMPT), 4, P))
    (ready,) = inboxes[P].take(Ready)
    assert ready.blocks and ready.blocks[0] != seq.block_table[0]
    sender.ready(ready)
    assert [type(m) for m in inboxes[D]] == [KVBegin, KVDone] and inboxes[D][1].num_parts == 0
    for msg in inboxes[D]:
        getattr(rx, "on_begin" if isinstance(msg, KVBegin) else "on_done")(msg)
    rx.poll()
    assert [type(e) for e in events if isinstance(e, KVArrived)] == [KVArrived]
    n = len(PROMPT)
    assert torch.equal(d.runner.read_tokens(list(ready.blocks), n), p.runner.read_tokens(seq.block_table, n))


def test_blocks_of_an_ended_request_wait_for_ps_fence(pair):
    p, d, sender, rx, inboxes, events = pair
    seq = _prefill(p)
    sender.serve(seq, None)
    sender.handoff(seq, 0.0)
    rx.reserve(Reserve(7, list(PROMPT), 4, P))
    used = d.num_used_blocks
    assert used > 0
    assert rx.abort(7)  # the router ended it while Ready is on its way to P
    assert d.num_used_blocks == used, "P may still write: the blocks stay reserved"
    assert sender.abort(7)
    (ready,) = inboxes[P].take(Ready)
    sender.ready(ready)  # the Ready arrives after P ended the request: P fences instead of writing
    fences = inboxes[D].take(KVFence)
    assert fences and all(f.rid == 7 for f in fences)
    rx.on_fence(fences[0])
    assert d.num_used_blocks == 0


def test_a_kept_request_is_freed_by_ps_done_or_at_the_end(pair):
    p, d, sender, rx, inboxes, events = pair
    for rid in (7, 8):
        rx.reserve(Reserve(rid, list(PROMPT), 4, P))
        assert rx.abort(rid)
    rx.on_done(KVDone(7, 1, 0, 1, P))
    assert 7 not in rx.kept and 8 in rx.kept
    rx.close()
    assert d.num_used_blocks == 0 and not rx.kept


def _plans(*devices):
    return [WorkerPlan(i, role, dev) for i, (role, dev) in enumerate(devices)]


def test_a_gpu_shared_by_p_and_d_needs_ipc_and_ipc_needs_one_box():
    shared = _plans(("prefill_only", "cuda:0"), ("decode_only", "cuda:0"))
    with pytest.raises(ConfigError, match="share cuda:0.*kv_transfer.backend=ipc"):
        check_kv_backend(shared, "process_group")
    check_kv_backend(shared, "ipc")
    check_kv_backend(_plans(("prefill_only", "cpu"), ("decode_only", "cpu")), "process_group")
    check_kv_backend(_plans(("prefill_only", "cuda:0"), ("decode_only", "cuda:1")), "process_group")
    with pytest.raises(ConfigError, match="one box only"):
        check_kv_backend(shared, "ipc", across_hosts=True)
