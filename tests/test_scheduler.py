"""Scheduler policies, driven without a model (every sampled token is 1)."""

import random

import pytest

from testbed.engine import BlockManager, Scheduler, SchedulerConfig, Sequence, SequenceStatus
from testbed.engine.policies import make_policy


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
