"""The scheduler: queues, a policy per role, and the bookkeeping after each step.

It never touches tensors or clocks: `schedule()` returns a batch plan and `postprocess()` takes
the sampled tokens. That keeps it runnable under a simulated clock. It is also the one place a
sequence's status changes (`move`, which refuses edges the state machine in sequence.py lacks):
the KV connector reserves, installs, releases and aborts through the methods below and never
touches the queues.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import SchedulerConfig
from testbed.engine.sequence import EDGES, Sequence, SequenceStatus
from testbed.errors import StateError


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


class QuietRun(NamedTuple):
    """`steps` plain decode steps to come (Scheduler.quiet_run)."""

    steps: int
    finishes: bool  # the step after them is a plain decode too, in which a sequence finishes
    seqs: tuple[tuple[int, int], ...]  # (seq_id, output tokens before the first step), in batch order
    context: int  # the decodes' total context at the first step (it grows by len(seqs) a step)
    used: list[int]  # the pool's used blocks after each step


class StepReport(NamedTuple):
    """One step by request id, as the request book reads it (StepResult.by_id); it travels whole in
    a worker's StepEvents."""

    scheduled: list[tuple[int, int, bool]]  # (rid, new tokens, was prefill)
    tokens: list[tuple[int, int, int]]  # (rid, output index, token)
    finished: list[int]
    handoff: list[int]  # prefilled here, its KV to move on
    hits: list[tuple[int, int]]  # (rid, prompt tokens its first prefill found cached)


@dataclass
class StepResult:
    """What one step changed: the work done ((sequence, new tokens, was it prefill) per item),
    tokens sampled, sequences finished, sequences handed off for transfer."""

    scheduled: list[tuple[Sequence, int, bool]] = field(default_factory=list)
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    handoff: list[Sequence] = field(default_factory=list)
    hits: list[tuple[int, int]] = field(default_factory=list)  # (rid, prompt tokens its first prefill found cached)

    def by_id(self) -> StepReport:
        """The step as the request book reads it."""
        return StepReport(
            [(seq.seq_id, n, was_prefill) for seq, n, was_prefill in self.scheduled],
            [(seq.seq_id, seq.num_output_tokens - 1, token) for seq, token in self.tokens],
            [seq.seq_id for seq in self.finished],
            [seq.seq_id for seq in self.handoff],
            self.hits,
        )


class Scheduler:
    def __init__(self, policy, block_manager: BlockManager, config: SchedulerConfig):
        self.policy = policy
        self.block_manager = block_manager
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[int, Sequence] = {}  # TRANSFERRING: prefilled, KV kept for a decode worker
        self.receiving: dict[int, Sequence] = {}  # RECEIVING: blocks reserved for KV on its way

    @staticmethod
    def move(seq: Sequence, status: SequenceStatus) -> None:
        """The one place a status changes: edges the state machine lacks are refused."""
        if status not in EDGES[seq.status]:
            raise StateError(f"sequence {seq.seq_id}: no edge {seq.status.name} -> {status.name}")
        seq.status = status

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise StateError(f"sequence {seq.seq_id} is {seq.status.name}: only a WAITING sequence is queued")
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A WAITING sequence whose KV its caller put in this pool (the profiler stages batches so)."""
        self.move(seq, SequenceStatus.RUNNING)
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_busy(self) -> int:
        """Sequences counted against max_running on a decode worker: queued, running, reserved."""
        return len(self.running) + len(self.waiting) + len(self.receiving)

    def find(self, seq_id: int) -> Sequence | None:
        """The sequence with this id wherever it is on this engine, or None."""
        seq = self.held.get(seq_id) or self.receiving.get(seq_id)
        if seq is None:
            seq = next((s for s in [*self.running, *self.waiting] if s.seq_id == seq_id), None)
        return seq

    # -- the KV connector's side ------------------------------------------------------------
    def reserve(self, seq: Sequence, share_prefix: bool = False) -> bool:
        """D: blocks for the prompt's KV and the first token's slot, when there is room under
        max_running and in the pool; False leaves everything as it was (back-pressure). With
        `share_prefix` the cached leading blocks are shared (seq.num_cached_tokens: KV that need
        not come) and only the rest is fresh; else every block is fresh."""
        if self.num_busy >= self.config.max_running:
            return False
        bm, n = self.block_manager, seq.num_tokens + 1
        if not (bm.can_allocate(seq, n) if share_prefix else bm.can_allocate_fresh(n)):
            return False
        if share_prefix:
            bm.allocate(seq, n)
        else:
            bm.allocate_fresh(seq, n)
        self.move(seq, SequenceStatus.RECEIVING)
        self.receiving[seq.seq_id] = seq
        return True

    def install(self, seq_id: int, first_token: int) -> Sequence:
        """D: the prompt's KV is in the reserved blocks; decode from the first token P sampled."""
        seq = self.receiving.pop(seq_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)  # the received prompt's blocks serve later prompts too
        seq.append_token(first_token)
        self.move(seq, SequenceStatus.RUNNING)
        self.running.append(seq)
        return seq

    def recompute(self, seq_id: int, first_token: int | None) -> Sequence:
        """D: the KV will not come; prefill here instead (keeping P's first token if it has it)."""
        seq = self.receiving.pop(seq_id)
        self.block_manager.free(seq)
        if first_token is not None:
            seq.append_token(first_token)
        seq.reset_for_recompute()
        self.move(seq, SequenceStatus.WAITING)
        self.waiting.append(seq)
        return seq

    def release(self, seq_id: int) -> Sequence:
        """P: the held KV has left (or is no longer needed): free its blocks."""
        seq = self.held.pop(seq_id)
        self.block_manager.free(seq)
        self.move(seq, SequenceStatus.FINISHED)
        return seq

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
            self.move(seq, SequenceStatus.RUNNING)
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
                self.move(seq, SequenceStatus.WAITING)
                self.waiting.appendleft(seq)
                return seq
        return None

    # -- quiet decode steps, applied at once (the simulator's decode runs) ------------------
    def quiet_run(self) -> QuietRun | None:
        """The next steps that are plain decodes changing nothing but lengths: every running
        sequence decodes one token, none finishes, nothing waits or prefills, and the pool
        covers their blocks (no preemption). None when the next step is not a plain decode."""
        running = self.running
        if (
            not running
            or self.waiting
            or len(running) > self.policy.token_budget(self)
            or any(seq.in_prefill for seq in running)
        ):
            return None
        steps = min(seq.max_tokens - len(seq.token_ids) + seq.num_prompt_tokens for seq in running) - 1
        free = self.block_manager.num_free_blocks
        taken = [step for step, _, _ in self._crossings(steps + 1)]  # the step of each block taken
        finishes = len(taken) <= free  # the step after them, which finishes one, fits too
        while not finishes and steps > 0 and sum(step < steps for step in taken) > free:
            steps //= 2
        grown = [0] * steps
        for step in taken:
            if step < steps:
                grown[step] += 1
        return QuietRun(
            steps,
            finishes,
            tuple((seq.seq_id, seq.num_output_tokens) for seq in running),
            sum(len(seq.token_ids) for seq in running),
            list(accumulate(grown, initial=self.block_manager.num_used_blocks))[1:],
        )

    def advance_decodes(self, steps: int, token: int) -> None:
        """Apply the first `steps` steps of a quiet run at once: each sequence gains `steps`
        tokens, and blocks are taken in the order step-by-step scheduling takes them."""
        size = self.block_manager.block_size
        for _, _, seq in sorted(self._crossings(steps), key=lambda c: c[:2]):
            self.block_manager.allocate(seq, len(seq.block_table) * size + 1)
        for seq in self.running:
            seq.num_computed_tokens += steps
            seq.token_ids.extend([token] * steps)
            self.block_manager.commit(seq)

    def _crossings(self, steps: int) -> list[tuple[int, int, Sequence]]:
        """(step, place in the batch, sequence) for each block the next `steps` decodes take:
        step i computes the KV of a sequence's token number len + i."""
        size, found = self.block_manager.block_size, []
        for place, seq in enumerate(self.running):
            have = len(seq.block_table) * size  # tokens the sequence's blocks cover
            for step in range(have - len(seq.token_ids) + 1, steps, size):
                found.append((step, place, seq))
        return found

    # -- after the forward pass -----------------------------------------------------------
    def postprocess(self, batch: Batch, sampled: list[int | None]) -> StepResult:
        result = StepResult()
        for (seq, n), token in zip(batch.items, sampled):
            result.scheduled.append((seq, n, seq.in_prefill))
            if seq.num_cached_tokens and seq.num_computed_tokens == seq.num_cached_tokens and seq.in_prefill:
                result.hits.append((seq.seq_id, seq.num_cached_tokens))  # its first chunk after the hit
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
                self.move(seq, SequenceStatus.TRANSFERRING)
                self.held[seq.seq_id] = seq
                result.handoff.append(seq)
        return result

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.move(seq, SequenceStatus.FINISHED)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a sequence wherever it is and free its blocks (failed request, lost peer); the
        sequence, or None when this engine does not hold it."""
        seq = self.find(seq_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.held.pop(seq_id, None)
        self.receiving.pop(seq_id, None)
        self.block_manager.free(seq)
        self.move(seq, SequenceStatus.FAILED)
        return seq
