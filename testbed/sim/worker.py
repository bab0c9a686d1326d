"""A simulated worker: the real Scheduler, BlockManager and policy; the forward pass is a duration.

It keeps the connector's state as the real KVSender (P) and KVReceiver (D) do: P holds a
prefilled request's blocks until its KV has left and steps only while fewer than `max_pending`
of them wait; D reserves blocks for an incoming request only when it has them and room under
max_running, FCFS. The simulation (testbed/sim/simulator.py) moves time and messages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig, SchedulerConfig
from testbed.engine.policies import make_policy
from testbed.engine.scheduler import Batch, Scheduler, StepResult
from testbed.engine.sequence import Sequence, SequenceStatus
from testbed.errors import ConfigError
from testbed.perf.resolve import StepCostModel

SAMPLED_TOKEN = 0  # greedy content is irrelevant to timing


@dataclass
class Outgoing:
    """P side: a request whose KV will go to `decode_rank`."""

    seq: Sequence
    decode_rank: Optional[int] = None
    handoff_t: Optional[float] = None  # prefill done, KV held
    ready_t: Optional[float] = None  # D reserved blocks
    start: Optional[float] = None  # transfer started


@dataclass
class Incoming:
    """D side: blocks reserved for a request whose KV is on its way."""

    seq: Sequence
    prefill_rank: int
    reserved_t: float


class SimWorker:
    def __init__(self, rank: int, role: str, num_blocks: int, engine: EngineConfig, scheduler: SchedulerConfig,
                 max_pending: int):
        if role == "chunked" and scheduler.chunk_size < scheduler.max_running:
            raise ConfigError(f"scheduler.chunk_size={scheduler.chunk_size} must be >= scheduler.max_running="
                              f"{scheduler.max_running} so every running decode fits in a chunked step")
        self.rank, self.role, self.max_pending = rank, role, max_pending
        # a decode worker writes received KV into fresh blocks, never shared ones (as the real worker)
        caching = engine.enable_prefix_caching and role != "decode_only"
        self.block_manager = BlockManager(num_blocks, engine.block_size, caching)
        self.scheduler = Scheduler(make_policy(role), self.block_manager, scheduler)
        self.batch: Optional[Batch] = None  # the step in flight
        self.step_start = 0.0
        self.num_steps = 0
        self.out: dict[int, Outgoing] = {}
        self.num_held = 0  # entries of `out` whose prefill is done: the back-pressure count
        self.link_free_at = 0.0  # P's sends go one at a time
        self.queued: deque[tuple[Sequence, int]] = deque()  # D: reservations waiting for room
        self.incoming: dict[int, Incoming] = {}
        self.deferred_aborts: list[int] = []

    # -- stepping -------------------------------------------------------------------------------
    def can_step(self) -> bool:
        if self.batch is not None or (self.role == "prefill_only" and self.num_held >= self.max_pending):
            return False
        return bool(self.scheduler.waiting or self.scheduler.running)

    def start_step(self, now: float, cost: StepCostModel) -> Optional[float]:
        """Schedule a batch; its duration, or None when nothing is admissible."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return None
        chunks, decodes, context = [], 0, 0
        for seq, n in batch.items:
            if seq.in_prefill:
                chunks.append((n, seq.num_computed_tokens))
            else:
                decodes += 1
                context += seq.num_tokens
        prefill = sum(n for n, _ in chunks)
        self.batch, self.step_start = batch, now
        self.shape = (prefill, decodes, prefill + decodes)
        return cost.step_time(prefill, cost.prefill_context(chunks) if chunks else 0.0, decodes, context)

    def finish_step(self, now: float) -> tuple[StepResult, tuple]:
        """Postprocess the batch in flight with dummy tokens; the result and the step's row."""
        batch, self.batch = self.batch, None
        sampled = [SAMPLED_TOKEN if seq.num_computed_tokens + n == seq.num_tokens else None for seq, n in batch.items]
        result = self.scheduler.postprocess(batch, sampled)
        prefill, decodes, batched = self.shape
        row = (self.rank, self.role, self.num_steps, self.step_start, now, prefill, decodes, batched,
               self.block_manager.num_used_blocks, len(self.scheduler.waiting), len(self.scheduler.running),
               0.0, 0.0, now - self.step_start, 0.0, 0.0)
        self.num_steps += 1
        return result, row

    # -- P: KV out ------------------------------------------------------------------------------
    def bind(self, seq: Sequence, decode_rank: int) -> None:
        self.out[seq.seq_id] = Outgoing(seq, decode_rank)

    def handoff(self, seq: Sequence, now: float) -> Outgoing:
        entry = self.out.setdefault(seq.seq_id, Outgoing(seq))
        entry.handoff_t = now
        self.num_held += 1
        return entry

    def ready(self, rid: int, decode_rank: int, now: float) -> Optional[Outgoing]:
        """D reserved blocks: the entry when it can now be sent."""
        entry = self.out.get(rid)
        if entry is None:
            return None  # aborted meanwhile
        entry.decode_rank, entry.ready_t = decode_rank, now
        return entry

    def sent(self, rid: int) -> Optional[Outgoing]:
        """The KV has left: P's blocks are free again."""
        entry = self.out.pop(rid, None)
        if entry is not None:
            self.num_held -= 1
            self.block_manager.free(entry.seq)
            entry.seq.status = SequenceStatus.FINISHED
        return entry

    # -- D: KV in -------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, prefill_rank: int) -> None:
        self.queued.append((seq, prefill_rank))

    def admit(self, now: float) -> list[Incoming]:
        """Reserve blocks for queued requests in order while there is room (back-pressure)."""
        admitted, limit = [], self.scheduler.config.max_running
        while self.queued:
            seq, prefill_rank = self.queued[0]
            busy = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.incoming)
            if busy >= limit or not self.block_manager.can_allocate(seq, seq.num_tokens + 1):
                break
            self.queued.popleft()
            self.block_manager.allocate(seq, seq.num_tokens + 1)  # the prompt's KV and the first token's slot
            seq.status = SequenceStatus.TRANSFERRING
            entry = self.incoming[seq.seq_id] = Incoming(seq, prefill_rank, now)
            admitted.append(entry)
        return admitted

    def install(self, rid: int) -> Sequence:
        seq = self.incoming.pop(rid).seq
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(SAMPLED_TOKEN)  # the first token, sampled on P
        self.scheduler.add_running(seq)
        return seq

    # -- endings --------------------------------------------------------------------------------
    def abort(self, rid: int) -> None:
        """Drop the request wherever it is on this worker and free its blocks. A real worker reads
        its inbox between steps, never inside one: during a step the abort waits for its end."""
        if self.batch is not None:
            self.deferred_aborts.append(rid)
        else:
            self._abort_now(rid)

    def flush_aborts(self) -> None:
        deferred, self.deferred_aborts = self.deferred_aborts, []
        for rid in deferred:
            self._abort_now(rid)

    def _abort_now(self, rid: int) -> None:
        entry = self.out.pop(rid, None)
        if entry is not None and entry.handoff_t is not None:
            self.num_held -= 1
            self.block_manager.free(entry.seq)
            entry.seq.status = SequenceStatus.FAILED
            return
        self.queued = deque(q for q in self.queued if q[0].seq_id != rid)
        incoming = self.incoming.pop(rid, None)
        if incoming is not None:
            self.block_manager.free(incoming.seq)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.seq_id == rid:
                self.scheduler.abort(seq)
