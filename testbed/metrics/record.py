"""One row of steps.parquet, for a real step and a simulated one alike: a named tuple, since a
long simulation makes millions of them (a frozen dataclass cost 40x more to build). The engine
fills it (testbed/engine/engine.py; the batch's shape from testbed/engine/step_shape.py), the
simulator models it, metrics/steps.py tables it."""

from __future__ import annotations

from typing import NamedTuple


class StepRecord(NamedTuple):
    """One row of steps.parquet (times are perf_counter seconds; the recorder rebases them)."""

    start: float
    end: float
    role: str
    prefill_tokens: int
    decode_seqs: int
    batched_tokens: int
    kv_blocks_used: int
    num_waiting: int
    num_running: int
    schedule_s: float  # host work outside the model forward, for the overhead benchmark
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    # the batch's shape as a cost model reads it (testbed.sim.cost_model): prefill chunks as
    # (new tokens, cached tokens) and the total context of the decodes
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_context: int = 0
    # set by a worker paced to an emulated device (hardware.emulate): the modelled step time,
    # and whether the real step took longer than it
    modelled_s: float = float("nan")
    pace_overrun: bool = False
    # the KV pool's size in blocks (occupancy: kv_blocks_used / kv_blocks_total; 0: not known)
    kv_blocks_total: int = 0
    # prompt tokens the step's prefills found in the prefix cache (StepResult.hits: counted on a
    # request's first chunk after the hit), beside the prefill_tokens the step computed
    prefix_hit_tokens: int = 0
    # attention kernel variants JIT-compiled during the step: 0 once Engine.warmup compiled them all
    jit_compiles: int = 0
