"""What the engine reads of a step for its steps.parquet row (testbed/metrics/record.py's
StepRecord), before the forward runs: the batch's shape as a cost model reads it, and the
prompt tokens its prefills found cached. The simulator times a step from the same shape.
And what a step gives back (StepOutput)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from testbed.engine.scheduler import StepResult
    from testbed.metrics.record import StepRecord


class StepShape(NamedTuple):
    """A batch's shape (names as StepRecord's columns)."""

    prefill_tokens: int
    decode_seqs: int
    batched_tokens: int
    prefill_chunks: tuple[tuple[int, int], ...]  # (new tokens, cached tokens) per prefill chunk
    decode_context: int  # the decodes' total context


def step_shape(batch) -> StepShape:
    """The shape of `batch`, read in one pass before the step runs."""
    chunks, context, decodes, decode_tokens = [], 0, 0, 0
    for seq, n in batch.items:
        if seq.in_prefill:
            chunks.append((n, seq.num_computed_tokens))
        else:
            context += len(seq.token_ids)
            decodes += 1
            decode_tokens += n
    prefill = sum(n for n, _ in chunks)
    return StepShape(prefill, decodes, prefill + decode_tokens, tuple(chunks), context)


def hit_tokens(hits) -> int:
    """The prompt tokens a step's StepResult.hits, (rid, cached tokens) pairs, found cached."""
    return sum(tokens for _, tokens in hits)


class StepOutput(NamedTuple):
    """What Engine.step gives back: what the step changed, and its steps.parquet row (None when
    nothing was scheduled)."""

    result: StepResult
    record: StepRecord | None
