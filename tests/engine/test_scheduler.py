"""testbed/engine/scheduler.py and its policies, driven without a model (every sampled token is 1),
and the sequence state machine (testbed/engine/sequence.py) through it: every edge, the illegal ones refused."""

import itertools
import random

import pytest

from testbed.engine import BlockManager, Scheduler, SchedulerConfig, Sequence, SequenceStatus
from testbed.engine.block_manager import BlockManager as Blocks
from testbed.engine.config import SchedulerConfig as Config
from testbed.engine.policies import make_policy
from testbed.engine.sequence import EDGES
from testbed.errors import StateError


def make(policy, num_blocks=400, **cfg):
    return Scheduler(make_policy(policy), BlockManager(num_blocks, 4), SchedulerConfig(**cfg))


def fake_step(s):
    batch = s.schedule()
    sampled = [1 if seq.num_computed_tokens + n == seq.num_tokens else None for seq, n in batch.items]
    return batch, s.postprocess(batch, sampled)


def random_arrivals(seed, n=40):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(n):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 90))]
        arrivals.setdefault(rng.randrange(60), []).append(Sequence(i, prompt, rng.randint(1, 30)))
    return arrivals


def run(s, arrivals, check):
    step, done = 0, []
    while s.has_work() or any(k >= step for k in arrivals):
        for seq in arrivals.get(step, []):
            s.add(seq)
        decodes_before = [q for q in s.running if not q.in_prefill]
        batch, result = fake_step(s)
        check(s, batch, result, decodes_before)
        done += result.finished
        step += 1
        assert step < 5000, "no progress"
    assert s.block_manager.num_used_blocks == 0
    return done


@pytest.mark.parametrize("seed", range(4))
def test_chunked_budget_and_no_decode_skipped(seed):
    s = make("chunked", chunk_size=32, max_running=8)

    def check(s, batch, result, decodes_before):
        assert batch.num_tokens <= 32
        scheduled = {seq.seq_id for seq, _ in batch.items}
        assert all(q.seq_id in scheduled for q in decodes_before), "a running decode was skipped"

    arrivals = random_arrivals(seed)
    done = run(s, arrivals, check)
    assert len(done) == 40 and all(q.is_done for q in done)


@pytest.mark.parametrize("seed", range(4))
def test_colocated_never_mixes_prefill_and_decode(seed):
    s = make("colocated", max_batched_tokens=48, max_running=8)

    def check(s, batch, result, _):
        assert batch.num_tokens <= 48
        kinds = {was_prefill for _, _, was_prefill in result.scheduled}
        assert len(kinds) <= 1, "prefill and decode in one step"

    assert len(run(s, random_arrivals(seed), check)) == 40


def test_colocated_prefill_runs_before_waiting_decodes():
    s = make("colocated", max_batched_tokens=64)
    a = Sequence(0, [1] * 10, 5)
    s.add(a)
    fake_step(s)  # a's prefill
    s.add(Sequence(1, [2] * 10, 5))
    batch, _ = fake_step(s)
    assert [seq.seq_id for seq, _ in batch.items] == [1], "the new prefill runs alone; a's decode waits"


def test_prefill_only_hands_off_after_first_token_and_keeps_blocks():
    s = make("prefill_only", max_batched_tokens=64)
    seq = Sequence(0, [3] * 10, 5)
    s.add(seq)
    _, result = fake_step(s)
    assert result.handoff == [seq] and seq.status is SequenceStatus.TRANSFERRING
    assert seq.output_token_ids == [1] and s.block_manager.num_used_blocks == 3
    assert not s.has_work()


def test_decode_only_decodes_sequences_that_arrive_with_kv():
    s = make("decode_only", max_running=4)
    seq = Sequence(0, [3] * 10, 3)
    s.block_manager.allocate(seq, 11)
    seq.num_computed_tokens = 10
    seq.append_token(1)  # the first token, sampled on the prefill worker
    s.add_running(seq)
    while s.has_work():
        batch, _ = fake_step(s)
        assert batch.num_prefill_tokens == 0
    assert seq.is_done and s.block_manager.num_used_blocks == 0


def test_preemption_recomputes_instead_of_crashing():
    s = make("chunked", num_blocks=12, chunk_size=64, max_running=4)  # 48 tokens of KV
    seqs = [Sequence(i, [i] * 14, 20) for i in range(3)]  # each grows to 34 tokens
    done = run(s, {0: seqs}, lambda *a: None)
    assert len(done) == 3 and sum(q.num_preemptions for q in seqs) > 0


def test_waiting_queue_is_fcfs_and_no_sequence_starves():
    s = make("chunked", chunk_size=16, max_running=2)
    seqs = [Sequence(i, [i] * 8, 4) for i in range(6)]
    finished_order = [q.seq_id for q in run(s, {0: seqs}, lambda *a: None)]
    assert sorted(finished_order) == list(range(6))
    assert finished_order[:2] == [0, 1]


def seq(rid: int = 7, n: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), 4)


# -- the sequence state machine ------------------------------------------------------------------------
def scheduler(role: str = "decode_only", num_blocks: int = 16, max_running: int = 4) -> Scheduler:
    return Scheduler(
        make_policy(role),
        Blocks(num_blocks, 4, False),
        Config(max_running=max_running, max_batched_tokens=64, chunk_size=64),
    )


def test_every_edge_is_exercised_through_the_scheduler():
    s = scheduler()
    a, b, c = seq(1), seq(2), seq(3)
    assert s.reserve(a) and a.status is SequenceStatus.RECEIVING  # WAITING -> RECEIVING
    s.install(1, 9)  # RECEIVING -> RUNNING
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 8
    assert s.reserve(b)
    s.recompute(2, 9)  # RECEIVING -> WAITING, with P's token
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [9] and b in s.waiting
    assert s.reserve(c)
    assert s.abort(3).status is SequenceStatus.FAILED  # RECEIVING -> FAILED
    assert s.abort(2).status is SequenceStatus.FAILED and s.abort(1).status is SequenceStatus.FAILED
    assert s.block_manager.num_used_blocks == 0 and s.abort(1) is None
    p = scheduler("prefill_only")
    d = seq(4)
    p.add(d)
    batch = p.schedule()  # WAITING -> RUNNING
    p.postprocess(batch, [5])  # RUNNING -> TRANSFERRING
    assert d.status is SequenceStatus.TRANSFERRING and p.block_manager.num_used_blocks > 0
    assert p.release(4).status is SequenceStatus.FINISHED and p.block_manager.num_used_blocks == 0


def test_reserve_is_back_pressure_not_an_error():
    s = scheduler(max_running=1)
    assert s.reserve(seq(1)) and not s.reserve(seq(2))
    assert seq(2).status is SequenceStatus.WAITING and s.num_busy == 1


@pytest.mark.parametrize(
    "old,new", [(o, n) for o, n in itertools.product(SequenceStatus, SequenceStatus) if n not in EDGES[o]]
)
def test_the_scheduler_refuses_every_edge_the_drawing_lacks(old, new):
    s = seq()
    s.status = old
    with pytest.raises(StateError, match="no edge"):
        Scheduler.move(s, new)


def test_the_boundary_refuses_out_of_turn_calls():
    s = scheduler()
    a = seq(1)
    s.add(a)
    with pytest.raises(KeyError):
        s.install(1, 9)  # never reserved
    with pytest.raises(KeyError):
        s.release(1)  # never handed off
    s.schedule()  # a is admitted: RUNNING
    with pytest.raises(StateError, match="only a WAITING"):
        s.add(a)
