"""The scheduler: queues, a policy per role, and the bookkeeping after each step.

It never touches tensors or clocks: `schedule()` returns a batch plan and `postprocess()` takes
the sampled tokens. That keeps it runnable under a simulated clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import SchedulerConfig
from testbed.engine.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """(sequence, number of new tokens) pairs: prefill chunks and decodes alike."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def num_decodes(self) -> int:
        return sum(1 for seq, _ in self.items if not seq.in_prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for seq, n in self.items if seq.in_prefill)


@dataclass
class StepResult:
    """What one step changed: the work done ((sequence, new tokens, was it prefill) per item),
    tokens sampled, sequences finished, sequences handed off for transfer."""

    scheduled: list[tuple[Sequence, int, bool]] = field(default_factory=list)
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    handoff: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, policy, block_manager: BlockManager, config: SchedulerConfig):
        self.policy = policy
        self.block_manager = block_manager
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in this pool (decode worker after a transfer)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = self.policy.schedule(self)
        assert batch.num_tokens <= self.policy.token_budget(self), "step token budget exceeded"
        return batch

    # -- building blocks the policies combine ---------------------------------------------
    def schedule_decodes(self, batch: Batch) -> None:
        """One token for every running decode, preempting the newest sequences if KV runs out."""
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not (fits := self.block_manager.can_allocate(seq, seq.num_tokens)):
                victim = self._preempt_newest(exclude=[s for s, _ in batch.items])
                if victim is None or victim is seq:
                    break
            if fits and seq.status is SequenceStatus.RUNNING:
                self.block_manager.allocate(seq, seq.num_tokens)
                batch.items.append((seq, 1))

    def schedule_prefills(self, batch: Batch, budget: int) -> None:
        """Running partial prefills first, then admit waiting sequences, chunked to fit `budget`."""
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                return
            n = min(seq.num_uncomputed_tokens, budget)
            batch.items.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq, seq.num_tokens):
                return  # FCFS: later arrivals do not overtake the head of the queue
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.items.append((seq, n))
            budget -= n

    def _preempt_newest(self, exclude: list[Sequence]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq not in exclude:
                self.running.remove(seq)
                self.block_manager.free(seq)
                seq.reset_for_recompute()
                self.waiting.appendleft(seq)
                return seq
        return None

    # -- after the forward pass -----------------------------------------------------------
    def postprocess(self, batch: Batch, sampled: list[int | None]) -> StepResult:
        result = StepResult()
        for (seq, n), token in zip(batch.items, sampled):
            result.scheduled.append((seq, n, seq.in_prefill))
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the sequence
            seq.append_token(token)
            result.tokens.append((seq, token))
            if seq.is_done:
                self._finish(seq)
                result.finished.append(seq)
            elif self.policy.hands_off_after_prefill:
                self.running.remove(seq)
                seq.status = SequenceStatus.TRANSFERRING
                result.handoff.append(seq)
        return result

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks (failed transfer, lost peer)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FAILED
