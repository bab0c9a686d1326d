"""One inference engine on one device: schedule, run, postprocess."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig, SchedulerConfig
from testbed.engine.kv_store import StoreView
from testbed.engine.model_runner import ModelRunner
from testbed.engine.policies import make_policy
from testbed.engine.scheduler import Batch, Scheduler, StepResult
from testbed.engine.sequence import Sequence, check_fits
from testbed.engine.step_shape import StepOutput, StepShape, hit_tokens, step_shape
from testbed.metrics.record import StepRecord
from testbed.model.attention import jit_compiles
from testbed.model.config import ModelArgs
from testbed.model.llama import Transformer
from testbed.model.loader import build_model, resolve_dtype
from testbed.names import Role

log = logging.getLogger(__name__)


class ModelPart(NamedTuple):
    """The model's part of a step (prepare, forward, sample): the order it ran the batch's items in,
    the tokens it sampled, and its times (perf_counter seconds)."""

    order: list[int]
    tokens: list[int]
    start: float  # the preparation began
    end: float  # the sampled tokens are on the host
    prepare_s: float
    forward_s: float
    sample_s: float


class Engine:
    def __init__(
        self,
        model: Transformer,
        engine_config: EngineConfig,
        scheduler_config: SchedulerConfig,
        policy: str,
        device: torch.device,
        fit_max_model_len: bool = False,
    ):
        engine_config.validate()
        scheduler_config.validate(policy)
        # resolves what is unset; max_running bounds a CPU pool sized from the memory, a GPU pool
        # leaves room for the largest step any policy schedules
        s = scheduler_config
        self.runner = ModelRunner(
            model,
            engine_config,
            device,
            fit_max_model_len,
            s.max_running,
            s.max_running + max(s.max_batched_tokens, s.chunk_size),
            policy != Role.PREFILL_ONLY,
        )
        if self.runner.config.cuda_graphs and self.runner.backend.name == "torch":
            log.warning("engine.cuda_graphs: off with the torch attention backend (flash-attn or triton replays)")
        if self.runner.graphs_wanted:
            self.runner.enable_graphs(scheduler_config.max_running)
        self.args: ModelArgs = self.runner.args  # max_model_len as the pool allows
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.runner.block_size, engine_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(make_policy(policy), self.block_manager, scheduler_config)
        self.role = str(policy)  # a plain str: every step report pickles it (a member unpickles by lookup)
        self.clock = ForwardClock(device)
        # after_layer(layer, sequences whose prefill completes this step): the KV streaming hook
        self.after_layer = None

    @classmethod
    def build(
        cls,
        args: ModelArgs,
        engine_config: EngineConfig,
        scheduler_config: SchedulerConfig,
        policy: str,
        device: str | torch.device = "cpu",
        dtype: str = "auto",
        path: str | None = None,
        seed: int = 0,
        fit_max_model_len: bool = False,
        shard=None,
    ):
        """`shard`: the model a tensor-parallel rank keeps of the full one (None: all of it)."""
        device = torch.device(device)
        model = build_model(args, device, resolve_dtype(dtype, device), path=path, seed=seed)
        model = shard(model) if shard is not None else model
        return cls(model, engine_config, scheduler_config, policy, device, fit_max_model_len)

    # -- requests in --------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        check_fits(prompt_len, max_tokens, self.args.max_model_len)

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step loop ------------------------------------------------------------------------
    def step(self) -> StepOutput:
        compiled, start = jit_compiles(), time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.items:
            return StepOutput(StepResult(), None)
        shape = step_shape(batch)  # before the postprocess moves the sequences on
        ran = self._run(batch)
        result = self.scheduler.postprocess(batch, self.runner.scatter(batch, ran.order, ran.tokens))
        end = time.perf_counter()
        return StepOutput(result, self._record(shape, ran, (start, end), result, compiled))

    def _run(self, batch: Batch) -> ModelPart:
        t1 = time.perf_counter()
        prepared = self.runner.prepare(batch)
        t2, began = time.perf_counter(), self.clock.mark()
        logits = self.runner.forward(prepared, self._layer_hook(batch))
        ended, t3 = self.clock.mark(), time.perf_counter()  # on CUDA the forward is still in flight here
        tokens = self.runner.sample(logits)  # the host sync: the forward has run once this returns
        t4 = time.perf_counter()
        forward_s, sample_s = self.clock.split(began, ended, t3 - t2, t4 - t3)
        return ModelPart(prepared.order, tokens, t1, t4, t2 - t1, forward_s, sample_s)

    def _layer_hook(self, batch):
        """after_layer bound to the sequences whose prefill this step completes, or None."""
        if self.after_layer is None:
            return None
        finishing = [seq for seq, n in batch.items if seq.in_prefill and seq.num_computed_tokens + n == seq.num_tokens]
        return (lambda layer: self.after_layer(layer, finishing)) if finishing else None

    def _record(
        self, shape: StepShape, ran: ModelPart, span: tuple[float, float], result: StepResult, compiled: int
    ) -> StepRecord:
        """The step's steps.parquet row; `span`: (start, end) of the whole step, `compiled`: the JIT
        compiles counted before it."""
        start, end = span
        return StepRecord(
            start=start,
            end=end,
            role=self.role,
            prefill_tokens=shape.prefill_tokens,
            decode_seqs=shape.decode_seqs,
            batched_tokens=shape.batched_tokens,
            kv_blocks_used=self.block_manager.num_used_blocks,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            schedule_s=ran.start - start,
            prepare_s=ran.prepare_s,
            forward_s=ran.forward_s,
            sample_s=ran.sample_s,
            postprocess_s=end - ran.end,
            prefill_chunks=shape.prefill_chunks,
            decode_context=shape.decode_context,
            kv_blocks_total=self.block_manager.num_blocks,
            prefix_hit_tokens=hit_tokens(result.hits),
            jit_compiles=jit_compiles() - compiled,
        )

    def run_until_done(self) -> list[StepRecord]:
        records = []
        while self.has_work():
            record = self.step().record
            assert record is not None, "the engine has work but scheduled nothing"
            records.append(record)
        return records

    def warmup(self, prompt_len: int = 64) -> None:
        """One prefill and a few decodes before serving, then every variant of the JIT-compiled
        attention kernels: first calls pay for lazy initialisation (kernels, allocator) and compiles,
        which would otherwise land on the first requests' TTFT and TPOT (StepRecord.jit_compiles
        counts any that still do)."""
        prompt_len = min(prompt_len, self.args.max_model_len - 4)
        seq = Sequence(-1, [i % self.args.vocab_size for i in range(prompt_len)], 3)
        policy = self.scheduler.policy
        self.scheduler.policy = make_policy(Role.CHUNKED if policy.name == Role.CHUNKED else Role.COLOCATED)
        try:
            self.add(seq)
            self.run_until_done()
        finally:
            self.scheduler.policy = policy
        assert self.num_used_blocks == 0 and not self.has_work()
        runner = self.runner
        runner.backend.warm_up(*runner.kv_caches[0], self.args.num_heads, runner.dtype)

    # -- the KV connector's boundary: it never touches the scheduler's queues ----------------
    def reserve(self, seq: Sequence, share_prefix: bool = False) -> bool:
        """D: reserve blocks for a request's KV (False: no room yet, ask again later); with
        `share_prefix`, onto the cached blocks of its prefix (incremental transfer)."""
        self.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        return self.scheduler.reserve(seq, share_prefix)

    def install(self, seq_id: int, first_token: int) -> Sequence:
        """D: the KV is in the reserved blocks; the sequence decodes from P's first token."""
        return self.scheduler.install(seq_id, first_token)

    def recompute(self, seq_id: int, first_token: int | None) -> Sequence:
        """D: the KV will not come; prefill the reserved sequence here."""
        return self.scheduler.recompute(seq_id, first_token)

    def release(self, seq_id: int) -> Sequence:
        """P: a handed-off sequence's KV has left: free its blocks."""
        return self.scheduler.release(seq_id)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop the sequence wherever it is on this engine; None when it holds no such sequence."""
        return self.scheduler.abort(seq_id)

    # -- what the worker reports and the end-of-run audit reads ---------------------------------
    def attach_store(self, store) -> None:
        """Share a KV store (testbed/engine/host_store.py): registered blocks are written to it,
        prompts fetch the blocks it holds past the pool's own hits."""
        runner = self.runner
        self.block_manager.store = StoreView(
            store, runner.block_bytes, copy_in=lambda data, b: runner.block_kv(b).copy_(data), copy_out=runner.block_kv
        )

    @property
    def store_stats(self) -> dict:
        store = self.block_manager.store
        return store.stats.as_dict() if store is not None else {}

    def track_cache_changes(self) -> None:
        """From now on, keep the prefix-cache blocks registered and evicted (for KV-aware routing)."""
        self.block_manager.track_changes()

    def cache_changes(self) -> tuple[list[int], list[int]]:
        """(block hashes registered, evicted) since the last call."""
        return self.block_manager.drain_changes()

    @property
    def num_cached_blocks(self) -> int:
        return self.block_manager.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)


class ForwardClock:
    """The forward's time where the device runs it asynchronously. On CUDA the host's stamp after
    the forward shows only its launches, and the sampled tokens' sync absorbs the GPU work, so
    CUDA events around the forward time it on the stream; the forward and the sampling keep their
    sum (the host's). Elsewhere the host's stamps are the times."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        """An event recorded on the current stream (CUDA), else None."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def split(start, end, forward_s: float, sample_s: float) -> tuple[float, float]:
        """(forward_s, sample_s): the events' span as the forward, when the step has synced since
        `end` was recorded (the sampled tokens), at most the two together."""
        if start is None:
            return forward_s, sample_s
        total = forward_s + sample_s
        device_s = min(max(start.elapsed_time(end) / 1e3, forward_s), total)
        return device_s, total - device_s
