"""A simulated worker: the real Scheduler, BlockManager and policy; the forward pass is a duration.

Its KV hand-off state is the real connector's ledger (testbed/control/ledger.py): P holds a
prefilled request's KV until it has left and steps only while fewer than `max_pending` of
them wait; D reserves blocks for an incoming request only when the scheduler has room, FCFS.
Reserving, installing and releasing go through the scheduler's own methods, as on a real
engine. The simulation (testbed/sim/simulator.py) moves time and messages.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional

from testbed.control.config import KVTransferConfig
from testbed.control.ledger import Incoming, Outgoing, ReceiveLedger, SendLedger
from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig, KVStoreConfig, SchedulerConfig
from testbed.engine.policies import make_policy
from testbed.engine.scheduler import Batch, Scheduler, StepResult
from testbed.engine.sequence import Sequence
from testbed.engine.step_shape import StepShape, hit_tokens, step_shape
from testbed.metrics.record import StepRecord
from testbed.names import Role
from testbed.perf.resolve import StepCostModel
from testbed.sim.decode_run import MIN_STEPS, DecodeRun, time_run
from testbed.sim.host import Delay, Draws, HostModel
from testbed.workload import Request

if TYPE_CHECKING:  # the type only: sim.config loads the in-situ fitting code
    from testbed.sim.config import SimConfig

SAMPLED_TOKEN = 0  # greedy content is irrelevant to timing


class SimWorker:
    """The configs it reads come whole (a new knob is read off them here); `store`: a StoreView on
    the run's shared store, or None."""

    def __init__(
        self,
        rank: int,
        role: Role,
        num_blocks: int,
        engine: EngineConfig,
        scheduler: SchedulerConfig,
        kv: KVTransferConfig,
        kv_store: KVStoreConfig,
        sim: SimConfig,
        report_cache: bool = False,
        store=None,
    ):
        scheduler.validate(role)
        self.rank, self.role, self.max_pending = rank, role, kv.max_pending
        self.is_prefill = role == Role.PREFILL_ONLY  # asked at every wake
        self.incremental = kv.incremental  # D reserves onto its cached prefix; P sends only the rest
        self.block_manager = BlockManager(num_blocks, engine.block_size, engine.enable_prefix_caching)
        if report_cache:  # step reports carry prefix-cache changes (KV-aware dispatch)
            self.block_manager.track_changes()
        self.block_manager.store = store
        self.store_bytes_per_s = kv_store.gbps * 1e9
        self.store_charged = 0  # store bytes already counted in a step's time
        self.scheduler = Scheduler(make_policy(role), self.block_manager, scheduler)
        self.batch: Optional[Batch] = None  # the step in flight
        self.shape: Optional[StepShape] = None  # its shape
        self.step_start = 0.0
        self.sender: SendLedger[Outgoing] = SendLedger()
        self.receiver: ReceiveLedger[Incoming] = ReceiveLedger()
        self.link_free_at = 0.0  # P's sends go one at a time
        self.run: Optional[DecodeRun] = None  # quiet decode steps planned ahead
        # multi-step scheduling: decode steps left in the current window after the one in flight,
        # and the window's step reports, held until its end (its tokens leave together)
        self.num_scheduler_steps = sim.num_scheduler_steps
        self.window_left = 0
        self.deferred: list = []
        self.first_token = False  # the step just finished completed a prefill: a first token (its report)
        self.after_prefill = False  # the step just finished prefilled: the next one is stepped on its own

    # -- stepping -------------------------------------------------------------------------------
    def can_step(self) -> bool:
        if self.batch is not None or self.run is not None:
            return False
        if self.is_prefill and self.sender.blocked(self.max_pending):
            return False
        return self.scheduler.has_work()

    def start_step(self, now: float, cost: StepCostModel) -> Optional[float]:
        """Schedule a batch; its duration, or None when nothing is admissible."""
        batch = self._schedule()
        if not batch.items:
            return None
        self._begin(batch, now)
        shape = self.shape
        chunks = shape.prefill_chunks
        return (
            cost.step_time(
                shape.prefill_tokens,
                cost.prefill_context(chunks) if chunks else 0.0,
                shape.decode_seqs,
                shape.decode_context,
            )
            + self._store_time()
        )

    def _schedule(self):
        """The next batch. Multi-step scheduling: inside a window only the running decodes step
        (the waiting queue is out of the scheduler's sight); a decode-only batch outside one opens
        a window of num_scheduler_steps steps; a batch with prefill is a window of one."""
        scheduler = self.scheduler
        if self.window_left and not any(not seq.in_prefill for seq in scheduler.running):
            self.window_left = 0  # every decode of the window finished
        if not self.window_left:
            batch = scheduler.schedule()
        else:
            waiting, scheduler.waiting = scheduler.waiting, deque()
            try:
                batch = scheduler.schedule()
            finally:  # a sequence preempted in the window goes back to the head of the queue
                waiting.extendleft(reversed(scheduler.waiting))
                scheduler.waiting = waiting
        if self.num_scheduler_steps > 1 and batch.items:
            if batch.num_prefill_tokens:
                self.window_left = 0
            else:
                self.window_left = (self.window_left or self.num_scheduler_steps) - 1
        return batch

    def window_open(self) -> bool:
        """The step just finished is inside a multi-step window that goes on (its report waits)."""
        if self.window_left and not any(not seq.in_prefill for seq in self.scheduler.running):
            self.window_left = 0
        return self.window_left > 0

    def _store_time(self) -> float:
        """Store traffic since the last step (the last one's write-through, this one's fetches)
        over the store's link: a real worker copies those blocks synchronously."""
        store = self.block_manager.store
        if store is None:
            return 0.0
        moved = store.stats.bytes_fetched + store.stats.bytes_put
        seconds = (moved - self.store_charged) / self.store_bytes_per_s
        self.store_charged = moved
        return seconds

    def _begin(self, batch: Batch, now: float) -> None:
        self.batch, self.step_start, self.shape = batch, now, step_shape(batch)

    def finish_step(self, now: float) -> tuple[StepResult, StepRecord]:
        """Postprocess the batch in flight with dummy tokens; the result and the step's record."""
        batch, self.batch = self.batch, None
        sampled = [SAMPLED_TOKEN if seq.num_computed_tokens + n == seq.num_tokens else None for seq, n in batch.items]
        self.first_token = any(token is not None and seq.in_prefill for token, (seq, _) in zip(sampled, batch.items))
        result = self.scheduler.postprocess(batch, sampled)
        shape = self.shape
        self.after_prefill = shape.prefill_tokens > 0
        record = StepRecord(
            self.step_start,
            now,
            self.role,
            shape.prefill_tokens,
            shape.decode_seqs,
            shape.batched_tokens,
            self.block_manager.num_used_blocks,
            len(self.scheduler.waiting),
            len(self.scheduler.running),
            0.0,
            0.0,
            now - self.step_start,
            0.0,
            0.0,
            shape.prefill_chunks,
            shape.decode_context,
            kv_blocks_total=self.block_manager.num_blocks,
            prefix_hit_tokens=hit_tokens(result.hits),
        )
        return result, record

    # -- decode runs (testbed/sim/decode_run.py) --------------------------------------------
    def start_run(
        self, now: float, cost: StepCostModel, scale: Delay, host: HostModel, draws: Draws
    ) -> Optional[DecodeRun]:
        """Plan the quiet decode steps ahead as one run, or None when there are too few."""
        if self.after_prefill:  # the step after a prefill has its own contention: stepped on its own
            return None
        quiet = self.scheduler.quiet_run()
        if quiet is None or quiet.steps + quiet.finishes < MIN_STEPS:
            return None
        self.run = time_run(now, quiet, cost, scale, host, draws)
        return self.run

    def end_run(self, t: float, draws: Draws) -> tuple[DecodeRun, int, bool]:
        """Apply the run's steps that ended by `t`: (the run, how many, whether one more step is
        in flight: it becomes this worker's batch, to finish as an ordinary step)."""
        run, self.run = self.run, None
        done, in_flight = run.cut(t, draws)
        self.scheduler.advance_decodes(done, SAMPLED_TOKEN)
        if in_flight:
            self._begin(self.scheduler.schedule(), run.starts[done])
        return run, done, in_flight

    # -- P: KV out ------------------------------------------------------------------------------
    def serve(self, request: Request, decode_rank: Optional[int]) -> None:
        seq = sequence(request)
        self.scheduler.add(seq)
        if self.is_prefill:
            self.sender.serve(seq, decode_rank)

    def handoff(self, seq: Sequence, now: float) -> Outgoing:
        return self.sender.handoff(seq, now)

    def ready(self, rid: int, decode_rank: int, now: float, skip: int = 0) -> Optional[Outgoing]:
        """D reserved blocks, holding the first `skip` prompt tokens already: the entry (attempt 1)."""
        return self.sender.ready(rid, decode_rank, 1, now, skip)

    def hold_link(self, entry: Outgoing, start: float, end: float) -> float:
        """`entry`'s KV holds P's link from `start` to `end` (testbed/sim/handoff.py); returns `end`."""
        entry.start, self.link_free_at = start, max(self.link_free_at, end)
        return end

    def sent(self, rid: int) -> Outgoing:
        """The KV has left: P's blocks are free again."""
        entry = self.sender.release(rid)
        self.scheduler.release(rid)
        return entry

    # -- D: KV in -------------------------------------------------------------------------------
    def reserve(self, request: Request, prefill_rank: int) -> None:
        self.receiver.request(sequence(request), prefill_rank)

    def admit(self, now: float) -> list[Incoming]:
        """Reserve blocks for queued requests in order while there is room (back-pressure)."""
        return self.receiver.admit(lambda seq: self.scheduler.reserve(seq, self.incremental), now)

    def install(self, rid: int) -> Sequence:
        self.receiver.take(rid)
        return self.scheduler.install(rid, SAMPLED_TOKEN)  # the first token, sampled on P


def sequence(request: Request) -> Sequence:
    return Sequence(request.request_id, request.prompt_token_ids, request.output_len)  # Sequence copies the prompt
